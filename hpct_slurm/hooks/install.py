"""Install-time artifacts: the hook scripts slurm.conf points at, and the SPANK plugin."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Mapping

from .. import config as C
from ..errors import HpctError

HOOK_COMMANDS = {"prolog": "prolog", "epilog": "epilog", "task_prolog": "task-prolog"}
SLURM_CONF_KEYS = {"prolog": "Prolog", "epilog": "Epilog", "task_prolog": "TaskProlog"}
SPANK_SOURCES = Path(__file__).resolve().parents[2] / "spank"


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
        path = dest / f"{name}.sh"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
        written[name] = path
    return written


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
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise HpctError(f"building the SPANK plugin failed: {msg[-1] if msg else 'no output'}")
    return out


def plugstack_line(plugin: Path, hpct: str | None = None, **options: str | int) -> str:
    """`required <plugin> key=value ...`, the keys being those config.c accepts."""
    args = [f"{k}={v}" for k, v in options.items()]
    if hpct:
        args.append(f"hpct={hpct}")
    for arg in args:
        if any(c.isspace() for c in arg):
            raise HpctError(f"plugstack argument {arg!r} contains whitespace")
    return " ".join(["required", str(plugin), *args])
