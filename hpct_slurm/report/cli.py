"""`hpct-slurm status [--json] [RUN_DIR|JOBID]` and `hpct-slurm report RUN_DIR|JOBID [--json]
[--png FILE]`: read a job's event logs (the I/O edge of `report.model`)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .. import config as C
from ..errors import HpctError, shown
from ..events import Ev
from ..slurm.env import check_job_id
from .files import rank_logs, read_log, run_dir_fd
from .model import (PHASES, FaultStatus, Report, RunEvents, Status, build_report,
                    build_status, check_run, pending_note)
from .records import parse_jsonl

if TYPE_CHECKING:
    from ..slurm.client import SlurmClient

CONTROLLER_LOG = "controller.jsonl"
ENDED = ("done", "requeued", "failed", "ended")  # a Status's states once the run ended


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="where a running job stands: generation, members, "
                                      "spares, latest step per rank, faults so far")
    p.add_argument("target", nargs="?", default=None, metavar="RUN_DIR|JOBID",
                   help="the job's run dir or its Slurm job id (default: $HPCT_RUN_DIR, else "
                        "the newest ./hpct-*/)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=status_main)

    p = sub.add_parser("report", help="what a job did and what its faults cost: goodput, "
                                      "per-phase recovery times, PNG timeline")
    p.add_argument("target", metavar="RUN_DIR|JOBID")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--steps", action="store_true", help="with --json: every step completion")
    p.add_argument("--png", default=None, metavar="FILE", help="write a timeline plot")
    p.set_defaults(func=report_main)


# ---- finding and reading a run dir -------------------------------------------------------

def resolve_run_dir(target: str | None, client: SlurmClient | None = None,
                    cwd: Path | None = None, environ: dict[str, str] | None = None) -> Path:
    """A run dir path as given, or a job id's run dir: `./hpct-<id>`, then Slurm's WorkDir of
    the job (`<WorkDir>/hpct-<id>`, or WorkDir itself when the job ran with --chdir into its
    run dir). With no target: $HPCT_RUN_DIR, else the newest `./hpct-*/`."""
    cwd = cwd or Path.cwd()
    env = os.environ if environ is None else environ
    if target is None:
        if C.read(env, C.RUN_DIR):
            return _checked(Path(C.read(env, C.RUN_DIR)), "$HPCT_RUN_DIR")
        found = sorted(cwd.glob(f"hpct-*/{CONTROLLER_LOG}"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise HpctError(f"no RUN_DIR or JOBID given, HPCT_RUN_DIR is not set and no "
                            f"hpct-*/{CONTROLLER_LOG} is under {str(cwd)!r}")
        return found[-1].parent
    path = Path(target)
    if os.path.isdir(path):   # False, not OSError, for a name too long to be a path
        return _checked(path, "run dir")
    try:
        job_id = check_job_id(target)
    except HpctError:
        raise HpctError(f"{shown(target)} is neither an existing run dir nor a Slurm job "
                        f"id") from None
    tried = [cwd / f"hpct-{job_id}"]
    if _has_log(tried[0]):
        return tried[0]
    from ..slurm.client import SlurmClient

    client = client or SlurmClient()
    try:
        workdir = client.show_job(job_id).work_dir
    except HpctError as exc:
        raise HpctError(f"job {job_id}: no run dir at {str(tried[0])!r} and Slurm does not "
                        f"know the job ({exc.message})") from None
    if workdir:
        candidates = [Path(workdir) / f"hpct-{job_id}", Path(workdir)]
        for c in candidates:
            tried.append(c)
            if _has_log(c) and _job_id_of(c) in (None, job_id):
                return c
    raise HpctError(f"job {job_id}: no {CONTROLLER_LOG} in any of "
                    f"{', '.join(repr(str(p)) for p in tried)} (a job run with --run-dir "
                    f"elsewhere: pass that directory)")


def _has_log(path: Path) -> bool:
    """Whether something stands at `path`'s controller log: a file, or what load_run then
    names (a directory, a FIFO, a link), rather than calling it missing."""
    return os.path.lexists(path / CONTROLLER_LOG)


def _checked(path: Path, what: str) -> Path:
    if not os.path.isdir(path):
        raise HpctError(f"{what} {str(path)!r} does not exist")
    if not _has_log(path):
        raise HpctError(f"{what} {str(path)!r} has no {CONTROLLER_LOG}: not an hpct-slurm run "
                        f"dir, or the controller has not started yet")
    return path


def _job_id_of(run_dir: Path) -> int | None:
    """The job id of the run dir's first record (its controller.start), read as every record
    is (records.py); None when it has none."""
    with run_dir_fd(run_dir) as fd:
        text, _ = read_log(fd, CONTROLLER_LOG, CONTROLLER_LOG, cap=64 * 1024)
    first, _ = parse_jsonl((text or "").split("\n", 1)[0], CONTROLLER_LOG)
    return first[0].get("job_id") if first and first[0]["event"] == Ev.CONTROLLER_START \
        else None


def load_run(run_dir: Path) -> RunEvents:
    """Every readable record under a run dir (files.py says what is never read); what could
    not be read is a warning line each."""
    run_dir = _checked(Path(run_dir), "run dir")
    with run_dir_fd(run_dir) as fd:
        text, warnings = read_log(fd, CONTROLLER_LOG, CONTROLLER_LOG)
        if text is None:
            raise HpctError(f"run dir {str(run_dir)!r}: {warnings[0]}")
        texts, said = rank_logs(fd)
    warnings += said
    controller, said = parse_jsonl(text, str(run_dir / CONTROLLER_LOG))
    warnings += said
    ranks = {}
    for stem, rank_text in texts.items():
        ranks[stem], said = parse_jsonl(rank_text, str(run_dir / "events" / f"{stem}.jsonl"))
        warnings += said
    return check_run(RunEvents(str(run_dir), controller, ranks, warnings))


# ---- commands ----------------------------------------------------------------------------

def status_main(args: argparse.Namespace) -> int:
    run = load_run(resolve_run_dir(args.target))
    st = build_status(run, time.time())
    if st.state == "requeued" and st.job_id is not None:
        st.notes.append(_slurm_says(st.job_id))
    for w in run.warnings:
        print(f"HPCT warning: {printable(w)}", file=sys.stderr)
    print(json.dumps(st.to_dict()) if args.json else format_status(st))
    return 0


def _slurm_says(job_id: int, client: "SlurmClient | None" = None) -> str:
    """A requeued job, as Slurm has it now: why it waits, or that it runs again."""
    from ..slurm.client import SlurmClient

    client = client or SlurmClient()
    try:
        job = client.show_job(job_id)
        note = pending_note(job.state, job.reason, client.node_states())
    except HpctError as exc:
        return f"Slurm: could not read job {job_id} now ({exc.message})"
    return note or f"Slurm: the requeued job is {job.state} now"


def report_main(args: argparse.Namespace) -> int:
    run = load_run(resolve_run_dir(args.target))
    rep = build_report(run)
    for w in rep.warnings:
        print(f"HPCT warning: {printable(w)}", file=sys.stderr)
    d = rep.to_dict(with_steps=args.steps)
    if args.png:
        from .plot import plot_timeline

        d["png"] = str(plot_timeline(rep, Path(args.png)))
    print(json.dumps(d) if args.json else format_report(rep, d.get("png")))
    return 0


def printable(text: str) -> str:
    """`text` for a terminal: every character that does not print (ESC and the other control
    characters, a newline, the bidi overrides) written as its escape (`\\x1b`), so nothing read
    from a log reaches the terminal raw (`--json` escapes them by itself)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _clock(unix: float) -> str:
    """A wall-clock time on this machine's clock and time zone."""
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(unix))


def format_report(rep: Report, png: str | None = None) -> str:
    lines = [f"job {rep.job_id}  {rep.run_dir}  outcome: {rep.outcome}"
             f"{f'  attempts: {rep.attempts}' if rep.attempts > 1 else ''}",
             f"started {_clock(rep.start_unix)}: times below are seconds since then",
             f"wall {rep.wall_s:.2f} s (startup before it {_s(rep.startup_s)} s)  productive "
             f"{rep.productive_s:.2f} s  goodput "
             f"{'-' if rep.goodput is None else f'{100 * rep.goodput:.1f}%'}",
             f"steps: {rep.steps_completed} completed, {rep.steps_recomputed} recomputed "
             f"({rep.step_runs} completions)", "generations:"]
    for g in rep.generations:
        lines.append(f"  {g.attempt}/{g.generation:<3} {g.start_s:8.2f} .. {g.end_s:8.2f} s  "
                     f"steps {g.first_step}..{g.last_step} ({g.steps})  restore "
                     f"{g.restore_step}  {','.join(g.members)}")
    if rep.faults:
        lines.append("faults:")
        for f in rep.faults:
            lines.append(f"  {f.t_s:8.2f} s  {f.node} ({f.role}, gen {f.generation}): "
                         f"{f.reason}; fenced: {f.fenced or '-'}"
                         f"{'  [during recovery]' if f.during_recovery else ''}")
    if rep.recoveries:
        lines.append("recoveries (s): " + "  ".join(PHASES) + "  teardown reform restore")
        for r in rep.recoveries:
            phases = "  ".join(_s(r.phases.get(k)) for k in PHASES)
            sources = sorted(set(r.restore_sources.values()))
            lines.append(f"  gen {r.generation}: {_s(r.recovery_s)} total  {phases}  "
                         f"{_s(r.max_teardown_s)} {_s(r.max_reform_s)} {_s(r.max_restore_s)}"
                         f"  restore step {r.restore_step} from {', '.join(sources) or '-'}"
                         f"  {', '.join(f'{a}->{b}' for a, b in r.taken.items())}")
    for e in rep.escalations:
        lines.append(f"  {e.t_s:8.2f} s  {e.event}: {e.reason}")
    if png:
        lines.append(f"timeline: {png}")
    return "\n".join(printable(line) for line in lines)


def format_status(st: Status) -> str:
    lines = [f"job {st.job_id}  {st.run_dir}  {st.state}  generation {st.generation}"
             f"{f' (attempt {st.attempt})' if st.attempt else ''}  step {st.step}",
             f"members: {','.join(st.members) or '-'}  spares: {','.join(st.spares) or '-'}",
             f"controller: {st.last_controller_event} {st.last_controller_event_s:.1f} s ago"]
    for r in st.ranks:
        seen = f"{r.last_event} {r.last_seen_s:.1f} s ago"
        if r.state == "member" or (r.state == "spare" and r.rank is None):
            lines.append(f"  {r.process:12} rank {_d(r.rank):>3}  gen {_d(r.generation):>2}  "
                         f"step {_d(r.step):>6}  {seen}")
        else:  # not a live rank beside the one that holds its rank now
            what = f"replaced by {r.replaced_by}" if r.state == "replaced" else \
                f"a spare again (replaced by {r.replaced_by})" if r.state == "spare" \
                and r.replaced_by else "a spare again" if r.state == "spare" else r.state
            held = "never held a rank" if r.rank is None else \
                f"held rank {r.rank}, gen {_d(r.generation)}, step {_d(r.step)}"
            lines.append(f"  {r.process:12} {what} ({held})  {seen}")
    for f in st.faults:
        lines.append(f"  fault at {_clock(st.start_unix + f.t_s)} ({f.t_s:.2f} s after the "
                     f"job started)  {f.node}: {f.reason}")
        lines.append(f"    {_fault_outcome(st, f)}")
    lines.extend(st.notes)
    return "\n".join(printable(line) for line in lines)


def _d(x: int | None) -> str:
    return "-" if x is None else str(x)


def _fault_outcome(st: Status, f: FaultStatus) -> str:
    """What became of a fault: its replacement, recovery time, recomputed steps, and where
    each rank's state came from."""
    if f.recovered_in is None:
        if f.role == "spare":
            return "a warm spare: nothing to replace"
        return "recovering" if st.state == "recovering" and f.attempt == st.attempt \
            else "not recovered in place"
    by_kind: dict[str, list[int]] = {}
    for rank, kind in sorted(f.state_sources.items()):
        by_kind.setdefault(kind, []).append(rank)
    sources = ", ".join(f"{k} (rank{'s' if len(v) > 1 else ''} {','.join(map(str, v))})"
                        for k, v in by_kind.items())
    back = f"back in {f.recovery_s:.3f} s" if f.recovery_s is not None else \
        f"never back: the job ended ({st.state}) first" if st.state in ENDED else "not back yet"
    return (f"{f.node} {f'replaced by {f.replaced_by}' if f.replaced_by else 'not replaced'}, "
            f"{back} (generation {f.recovered_in}): restored step {f.restore_step}, "
            f"{f.recomputed_steps} step(s) recomputed; state from {sources or '-'}")
