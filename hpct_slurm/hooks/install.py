"""Install-time artifacts: the hook scripts slurm.conf points at, the boot-time creation of
the shm root (a systemd tmpfiles.d line), and the SPANK plugin."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Mapping

from .. import config as C
from ..errors import HpctError
from .shm import shm_root

HOOK_COMMANDS = {"prolog": "prolog", "epilog": "epilog", "task_prolog": "task-prolog"}
SLURM_CONF_KEYS = {"prolog": "Prolog", "epilog": "Epilog", "task_prolog": "TaskProlog"}
SPANK_SOURCES = Path(__file__).resolve().parents[2] / "spank"
TMPFILES_NAME = "hpct-slurm.conf"
# What systemd-tmpfiles would read as a quote, an escape, a specifier or a field break.
_TMPFILES_SPECIAL = set(" \t\"'\\%")


def install_hooks(dest: Path, python: str = sys.executable,
                  settings: Mapping[str, str] | None = None) -> dict[str, Path]:
    """Write prolog.sh, epilog.sh and task_prolog.sh into `dest` (mode 0755)."""
    if not os.path.isabs(python) or not os.access(python, os.X_OK):
        raise HpctError(f"python {python!r} is not an absolute path to an executable")
    lines = []
    for name, value in (settings or {}).items():
        # The hooks' own settings (config.py's table, checked now rather than in every
        # prolog) and where Slurm's config is.
        if name != "SLURM_CONF" and (name not in C.BY_NAME or C.BY_NAME[name].shell_only):
            raise HpctError(f"hook setting {name!r} is not an HPCT_* setting (hpct-slurm "
                            f"settings lists them) or SLURM_CONF")
        if "\n" in value:
            raise HpctError(f"hook setting {name}={value!r} spans lines")
        if name != "SLURM_CONF":
            C.read({name: value}, name)
        lines.append(f"export {name}={shlex.quote(value)}\n")
    template = (Path(__file__).parent / "hook.sh").read_text()
    dest.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, command in HOOK_COMMANDS.items():
        text = (template.replace("@SETTINGS@", "".join(lines))
                .replace("@PYTHON@", shlex.quote(python)).replace("@COMMAND@", command))
        written[name] = _write(dest / f"{name}.sh", text, 0o755)
    return written


def _write(path: Path, text: str, mode: int) -> Path:
    """`path` replaced whole (a reader never sees half of it), with `mode`."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    return path


def tmpfiles_line(root: Path) -> str:
    """The tmpfiles.d line that makes the shm root at boot: a directory owned by root, mode
    0755 (what the Prolog checks and keeps), never aged (the jobs' warm caches live there).
    `/dev/shm` is world-writable and emptied at every boot: left to the first Prolog, the name
    could be taken first by any user (a link, a directory of theirs), and the Prolog would then
    refuse it and drain the node."""
    path = str(root)
    if not path.isprintable():
        raise HpctError(f"shm root {path!r} cannot be written as a tmpfiles.d line")
    if _TMPFILES_SPECIAL.intersection(path):
        path = '"' + path.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%") + '"'
    return f"d {path} 0755 root root -\n"


def install_tmpfiles(etc_dir: Path, settings: Mapping[str, str] | None = None) -> Path:
    """Write `<etc_dir>/hpct-slurm.conf` (mode 0644) with the tmpfiles line of the shm root
    the hooks use (HPCT_SHM_ROOT among `settings`, else its default)."""
    line = tmpfiles_line(shm_root(settings or {}))
    try:
        etc_dir.mkdir(parents=True, exist_ok=True)
        return _write(etc_dir / TMPFILES_NAME, "# the hpct-slurm shm root, made at boot before "
                      "any user can take its name (`hpct-slurm hooks install`)\n" + line, 0o644)
    except OSError as exc:
        raise HpctError(f"cannot write {etc_dir / TMPFILES_NAME} ({exc.strerror}): install as "
                        f"root, or pass --tmpfiles-dir (or --no-tmpfiles)") from None


def slurm_conf_lines(scripts: Mapping[str, Path]) -> list[str]:
    return [f"{SLURM_CONF_KEYS[name]}={path}" for name, path in scripts.items()]


def build_plugin(out: Path, sources: Path = SPANK_SOURCES) -> Path:
    """`make -C spank OUT=<out>`: the plugin must be built against the running Slurm."""
    if not (sources / "Makefile").exists():
        raise HpctError(f"SPANK sources not found at {sources}: build from a source checkout "
                        f"(make -C spank)")
    if not Path("/usr/include/slurm/spank.h").exists():
        raise HpctError("/usr/include/slurm/spank.h is missing: install libslurm-dev (the "
                        "headers of the Slurm that runs here)")
    out = out.absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["make", "-s", "-C", str(sources), f"OUT={out}"],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise HpctError(f"building the SPANK plugin failed: "
                        f"{compiler_message(proc.stderr + proc.stdout)}")
    return out


def compiler_message(output: str) -> str:
    """What a failed build says, for one error line: the compiler's first `error:` line (and
    how many more), not make's closing `make: *** [...] Error 1`; else the last line that is
    not make's."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln and not ln.startswith("make")]
    if errors:
        more = f" (and {len(errors) - 1} more error lines)" if len(errors) > 1 else ""
        return errors[0] + more
    own = [ln for ln in lines if not ln.startswith("make")]
    return (own or lines or ["no output"])[-1]


def plugstack_line(plugin: Path, hpct: str | None = None, **options: str | int) -> str:
    """`required <plugin> key=value ...`, the keys being those config.c accepts."""
    args = [f"{k}={v}" for k, v in options.items()]
    if hpct:
        args.append(f"hpct={hpct}")
    for arg in args:
        if any(c.isspace() for c in arg):
            raise HpctError(f"plugstack argument {arg!r} contains whitespace")
    return " ".join(["required", str(plugin), *args])
