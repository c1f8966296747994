"""`hpct-slurm prolog|epilog|task-prolog` (what the hook scripts run), `hpct-slurm hooks
install DIR` (the scripts, and the tmpfiles.d line that makes the shm root at boot), and
`hpct-slurm spank build`."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prolog", help="Slurm Prolog: health check, stale sweep, job shm dir")
    p.set_defaults(func=_prolog)
    p = sub.add_parser("epilog", help="Slurm Epilog: remove the job's shm dir")
    p.set_defaults(func=_epilog)
    p = sub.add_parser("task-prolog", help="Slurm TaskProlog: print the task's export lines")
    p.set_defaults(func=_task_prolog)

    p = sub.add_parser("hooks", help="install the hook scripts slurm.conf points at")
    hs = p.add_subparsers(dest="hooks_action", metavar="ACTION")
    hs.required = True
    i = hs.add_parser("install", help="write prolog.sh, epilog.sh, task_prolog.sh into DIR")
    i.add_argument("dest", type=Path, metavar="DIR")
    i.add_argument("--python", default=sys.executable,
                   help="absolute path of the python that has hpct_slurm (default: this one)")
    i.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a setting the hooks run with (HPCT_SHM_ROOT, HPCT_HOOKS_LOG, "
                        "HPCT_SHM_FRACTION, HPCT_DEFAULT_CACHE_MB, HPCT_HEALTH_MIN_SHM_MB, "
                        "HPCT_FENCE, HPCT_FENCE_ALLOW; `hpct-slurm settings` lists all) or "
                        "SLURM_CONF")
    i.add_argument("--tmpfiles-dir", type=Path, default=Path("/etc/tmpfiles.d"), metavar="DIR",
                   help="where to write hpct-slurm.conf, the systemd-tmpfiles line that makes "
                        "the shm root at boot, before any user can take its name (default: "
                        "%(default)s; run `systemd-tmpfiles --create` on it, or reboot)")
    i.add_argument("--no-tmpfiles", action="store_true",
                   help="do not write it (the shm root is made some other way)")
    i.set_defaults(func=_hooks_install)

    p = sub.add_parser("spank", help="the SPANK plugin")
    ss = p.add_subparsers(dest="spank_action", metavar="ACTION")
    ss.required = True
    b = ss.add_parser("build", help="compile the plugin against this machine's Slurm and "
                                    "print its plugstack.conf line")
    b.add_argument("--out", type=Path, default=Path("hpct_spank.so"))
    b.set_defaults(func=_spank_build)


def _log(source: str):
    from ..events import EventLog

    from .. import config as C

    return EventLog(path=C.read(os.environ, C.HOOKS_LOG), stream=sys.stderr,
                    source=source)


def never_fails(source: str, work: Callable[[], int]) -> int:
    """Run a hook's work; any exception is logged (stderr, which slurmd keeps, and the hooks
    log when it can be opened) and the hook exits 0: a Prolog, Epilog or TaskProlog that exits
    non-zero makes Slurm drain the node or fail the job, and a hook that cannot do its work
    (Slurm does not answer, a command is missing, its output cannot be read, a bug here) is no
    reason for either. Only the Prolog's health verdict (exit 1) fails a job on purpose."""
    try:
        return work()
    except Exception as exc:  # noqa: BLE001 - see above
        from ..errors import describe
        from ..events import Ev

        error = describe(exc)
        print(f"hpct: {source} could not do its work, the job runs without it: {error}",
              file=sys.stderr)
        try:
            from .. import config as C
            from ..events import EventLog

            path = C.read(os.environ, C.HOOKS_LOG)
            if path:
                EventLog(path=path, source=source).emit(Ev.HOOK_FAILED, error=error,
                                                        job_id=os.environ.get("SLURM_JOB_ID"))
        except Exception:  # noqa: BLE001 - the stderr line above is the record then
            pass
        return 0


def _prolog(args: argparse.Namespace) -> int:
    def work() -> int:
        from .context import HookConfig, JobContext
        from .fence import FenceConfig
        from .node import SlurmNode
        from .prolog import prolog

        result = prolog(JobContext.from_env(os.environ), HookConfig.from_env(os.environ),
                        SlurmNode(), _log("prolog"), FenceConfig.from_env(os.environ))
        return 0 if result.healthy else 1
    return never_fails("prolog", work)


def _epilog(args: argparse.Namespace) -> int:
    def work() -> int:
        from .context import HookConfig, JobContext
        from .epilog import epilog
        from .fence import FenceConfig

        epilog(JobContext.from_env(os.environ), HookConfig.from_env(os.environ),
               _log("epilog"), FenceConfig.from_env(os.environ))
        return 0
    return never_fails("epilog", work)


def _task_prolog(args: argparse.Namespace) -> int:
    return never_fails("task-prolog", _task_prolog_work)


def _task_prolog_work() -> int:
    from .task_prolog import for_task, format_exports, rendezvous_env, task_env

    from ..errors import describe

    env = task_env(os.environ)
    try:
        env.update(rendezvous_env({**os.environ, **env}))
    except Exception as exc:  # noqa: BLE001 - HpctError, a timeout, ...: the task runs
        # A step the controller did not launch (plain `srun hostname`) has no rendezvous to
        # join; it must still run, with the shm exports.
        print(f"hpct: no rendezvous env: {describe(exc)}", file=sys.stderr)
    sys.stdout.write(format_exports(for_task(env, os.environ)))
    return 0


def _hooks_install(args: argparse.Namespace) -> int:
    from ..errors import HpctError
    from .install import install_hooks, install_tmpfiles, slurm_conf_lines

    settings = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            raise HpctError(f"--set {item!r} is not NAME=VALUE")
        settings[name] = value
    scripts = install_hooks(args.dest.absolute(), args.python, settings)
    if not args.no_tmpfiles:
        path = install_tmpfiles(args.tmpfiles_dir, settings)
        print(f"wrote {path}: run `systemd-tmpfiles --create {path}` now (it runs at every "
              f"boot), on every node", file=sys.stderr)
    print("\n".join(slurm_conf_lines(scripts)))
    return 0


def _spank_build(args: argparse.Namespace) -> int:
    from .install import build_plugin, plugstack_line

    plugin = build_plugin(args.out)
    hpct = Path(sys.executable).parent / "hpct-slurm"
    print(plugstack_line(plugin, hpct=str(hpct) if hpct.exists() else None))
    return 0
