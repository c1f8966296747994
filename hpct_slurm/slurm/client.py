"""Slurm through its commands: `scontrol`, `sinfo --json`, `squeue --json`, `sbatch`, `scancel`.

Every command is an argv list (never a shell string), run with a timeout; a failure raises
SlurmCommandError carrying the argv, the exit code and Slurm's own message. Output parsing is
pure (the `parse_*` functions) and tested on outputs captured from Slurm 22.05.

Two Slurm habits shape this module:
* `scontrol show hostnames` exits 0 on a bad hostlist (it only prints "Invalid hostlist"), so
  success is judged from the output too.
* `scontrol show node -o` writes free text (Reason, Comment, Extra) unquoted at the end of the
  line; `Reason=` is therefore cut at its trailing `[user@time]` stamp, not at the next space.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import HpctError
from .hostlist import compress, expand

BASE_NODE_STATES = frozenset(
    {"IDLE", "ALLOCATED", "MIXED", "DOWN", "ERROR", "FUTURE", "UNKNOWN"})
# States `scontrol update NodeName=... State=` accepts that this project has a use for.
UPDATE_NODE_STATES = frozenset({"DOWN", "DRAIN", "FAIL", "RESUME", "UNDRAIN"})
_STATES_NEEDING_REASON = frozenset({"DOWN", "DRAIN", "FAIL"})
FINISHED_JOB_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
    "DEADLINE", "OUT_OF_MEMORY", "SPECIAL_EXIT", "REVOKED"})

_KEY_RE = re.compile(r"(?:^| )([A-Za-z][A-Za-z0-9_:/.]*)=")
_NODE_TEXT_TAIL_RE = re.compile(
    r" Reason=(?P<reason>.*?)(?: \[(?P<by>[^\]\s@]*)@(?P<at>[^\]\s]*)\])?"
    r"(?= Comment=| Extra=|$)")
_NULLS = {"", "(null)", "N/A", "None"}


class SlurmCommandError(HpctError):
    """A Slurm command failed; `argv`, `returncode` (None: it never finished) and `stderr`."""

    def __init__(self, argv: Sequence[str], returncode: int | None, stderr: str, what: str = ""):
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
        detail = what or (lines[-1].strip() if lines else "no message")
        status = "timed out" if returncode is None else f"exit {returncode}"
        super().__init__(f"{' '.join(self.argv)} failed ({status}): {detail}")


@dataclass(frozen=True)
class NodeInfo:
    """One node as Slurm sees it. `state` is the base state (IDLE, ALLOCATED, MIXED, DOWN,
    ERROR, FUTURE, UNKNOWN); DRAIN, NOT_RESPONDING, COMPLETING, ... are in `flags`."""

    name: str
    state: str
    flags: frozenset[str]
    reason: str | None
    addr: str | None
    hostname: str | None
    features: tuple[str, ...]
    active_features: tuple[str, ...]

    @property
    def summary(self) -> str:
        """The word sinfo would use: DRAINING while jobs still run on a draining node,
        DRAINED once it is empty, else the base state."""
        if "DRAIN" in self.flags:
            return "DRAINING" if self.state in ("ALLOCATED", "MIXED") else "DRAINED"
        return self.state

    @property
    def lost(self) -> bool:
        """Slurm no longer hears from the node, or has marked it down."""
        return self.state == "DOWN" or "NOT_RESPONDING" in self.flags

    @property
    def usable(self) -> bool:
        """It can take new work now."""
        return (self.state in ("IDLE", "MIXED", "ALLOCATED")
                and not self.flags & {"DRAIN", "NOT_RESPONDING", "FAIL", "MAINTENANCE",
                                      "POWERED_DOWN", "POWERING_DOWN", "REBOOT_REQUESTED"})


@dataclass(frozen=True)
class JobInfo:
    """One job. `flags` is None where the source does not report them (scontrol)."""

    job_id: int
    name: str | None
    user: str | None
    state: str
    nodelist: list[str]
    batch_host: str | None
    restart_count: int
    reason: str | None
    exit_code: int
    exit_signal: int
    flags: frozenset[str] | None

    @property
    def finished(self) -> bool:
        return self.state in FINISHED_JOB_STATES


# ---- pure parsing ------------------------------------------------------------------------

def parse_node_state(text: str) -> tuple[str, frozenset[str]]:
    """`IDLE+DRAIN` -> ("IDLE", {"DRAIN"}). Unknown words stay flags, so new Slurm flags
    never break parsing; a missing base state does."""
    words = [w for w in text.strip().upper().split("+") if w]
    if not words or words[0] not in BASE_NODE_STATES:
        raise HpctError(f"node state {text!r} does not start with one of "
                        f"{', '.join(sorted(BASE_NODE_STATES))}")
    return words[0], frozenset(words[1:])


def parse_scontrol_record(line: str) -> dict[str, str]:
    """`Key=value Key2=a b Key3=...` -> dict. A value runs until the next ` Key=`."""
    matches = list(_KEY_RE.finditer(line))
    if not matches or matches[0].start() != 0:
        raise HpctError(f"scontrol output {line[:80]!r} is not a Key=value record")
    record = {}
    for m, nxt in zip(matches, matches[1:] + [None]):
        end = nxt.start() if nxt else len(line)
        record[m.group(1)] = line[m.end():end].strip()
    return record


def _opt(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value).strip()
    return None if text in _NULLS else text


def _features(value: str | None) -> tuple[str, ...]:
    text = _opt(value)
    return tuple(f for f in text.split(",") if f) if text else ()


def parse_node_record(line: str) -> NodeInfo:
    """One line of `scontrol show node -o`."""
    line = line.rstrip("\n")
    reason = None
    tail = _NODE_TEXT_TAIL_RE.search(line)
    if tail:
        reason = _opt(tail.group("reason"))
        line = line[:tail.start()]
    rec = parse_scontrol_record(line)
    if "NodeName" not in rec or "State" not in rec:
        raise HpctError(f"scontrol node record {line[:80]!r} lacks NodeName or State")
    state, flags = parse_node_state(rec["State"])
    return NodeInfo(name=rec["NodeName"], state=state, flags=flags, reason=reason,
                    addr=_opt(rec.get("NodeAddr")), hostname=_opt(rec.get("NodeHostName")),
                    features=_features(rec.get("AvailableFeatures")),
                    active_features=_features(rec.get("ActiveFeatures")))


def _json_doc(text: str, what: str) -> dict:
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise HpctError(f"{what} output is not JSON ({exc}): {text[:80]!r}") from None
    if not isinstance(doc, dict):
        raise HpctError(f"{what} output is not a JSON object: {text[:80]!r}")
    errors = doc.get("errors") or []
    if errors:
        raise HpctError(f"{what} reported errors: {errors}")
    return doc


def parse_sinfo_json(text: str) -> list[NodeInfo]:
    """The nodes of `sinfo --json` (Slurm 22.05, openapi v0.0.38 layout)."""
    doc = _json_doc(text, "sinfo --json")
    nodes = []
    for n in doc.get("nodes", []):
        state, flags = parse_node_state(n["state"])
        flags |= frozenset(f.upper() for f in n.get("state_flags") or [])
        nodes.append(NodeInfo(
            name=n["name"], state=state, flags=flags, reason=_opt(n.get("reason")),
            addr=_opt(n.get("address")), hostname=_opt(n.get("hostname")),
            features=_features(n.get("features")),
            active_features=_features(n.get("active_features"))))
    return nodes


def _hosts_or_empty(hostlist: str | None) -> list[str]:
    text = _opt(hostlist)
    return expand(text) if text else []


def _uint(value: Any, what: str) -> int:
    text = str(value)
    if not text.isdecimal():
        raise HpctError(f"{what} {text!r} is not a non-negative integer")
    return int(text)


def parse_job_record(line: str) -> JobInfo:
    """One line of `scontrol show job -o`."""
    rec = parse_scontrol_record(line.rstrip("\n"))
    if "JobId" not in rec or "JobState" not in rec:
        raise HpctError(f"scontrol job record {line[:80]!r} lacks JobId or JobState")
    code, _, sig = rec.get("ExitCode", "0:0").partition(":")
    return JobInfo(
        job_id=_uint(rec["JobId"], "JobId"), name=_opt(rec.get("JobName")),
        user=_opt(rec.get("UserId", "").split("(")[0]),
        state=rec["JobState"].split()[0].upper(),
        nodelist=_hosts_or_empty(rec.get("NodeList")),
        batch_host=_opt(rec.get("BatchHost")),
        restart_count=_uint(rec.get("Restarts", "0"), "Restarts"),
        reason=_opt(rec.get("Reason")),
        exit_code=_uint(code, "ExitCode"), exit_signal=_uint(sig or "0", "ExitCode signal"),
        flags=None)


def parse_squeue_json(text: str) -> list[JobInfo]:
    """The jobs of `squeue --json` (Slurm 22.05). `exit_code` there is a wait() status."""
    doc = _json_doc(text, "squeue --json")
    jobs = []
    for j in doc.get("jobs", []):
        status = int(j.get("exit_code") or 0)
        jobs.append(JobInfo(
            job_id=int(j["job_id"]), name=_opt(j.get("name")), user=_opt(j.get("user_name")),
            state=str(j["job_state"]).upper(),
            nodelist=_hosts_or_empty(j.get("nodes")),
            batch_host=_opt(j.get("batch_host")),
            restart_count=int(j.get("restart_cnt") or 0),
            reason=_opt(j.get("state_reason")),
            exit_code=(status >> 8) & 0xFF, exit_signal=status & 0x7F,
            flags=frozenset(str(f).upper() for f in j.get("flags") or [])))
    return jobs


def parse_sbatch_parsable(text: str) -> int:
    """`sbatch --parsable` prints `jobid` or `jobid;cluster`."""
    first = text.strip().split(";")[0]
    if not first.isdecimal():
        raise HpctError(f"sbatch --parsable printed {text.strip()!r}, not a job id")
    return int(first)


def parse_version(text: str) -> str:
    """`slurm-wlm 22.05.8` -> "22.05.8"."""
    m = re.search(r"\b(\d+\.\d+\.\d+)\b", text)
    if not m:
        raise HpctError(f"Slurm version output {text.strip()[:60]!r} has no version number")
    return m.group(1)


def srun_argv(node: str, argv: Sequence[str], extra_opts: Sequence[str] = (),
              ntasks: int = 1, job_id: int | None = None) -> list[str]:
    """`srun -N1 -n<ntasks> -w <node> [--jobid=J] <extra_opts> <argv>`: one step on one node,
    so that a node's failure ends only its own step."""
    if expand(node) != [node]:
        raise HpctError(f"srun node {node!r} is not a single node name")
    if ntasks < 1:
        raise HpctError(f"srun ntasks {ntasks} is not a positive number")
    if not argv:
        raise HpctError("srun needs a command to run")
    cmd = ["srun", "-N1", f"-n{ntasks}", "-w", node]
    if job_id is not None:
        cmd.append(f"--jobid={job_id}")
    return [*cmd, *extra_opts, *argv]


# ---- the client --------------------------------------------------------------------------

@dataclass(frozen=True)
class BackendChoice:
    """Which backend a client uses and why (see pyslurm_backend.select_backend)."""

    name: str
    reason: str


class SlurmClient:
    """Slurm through its CLI. `env` is laid over os.environ for every command (e.g. SLURM_CONF);
    `wrap` prefixes every argv (e.g. `nsenter --net=/run/netns/x --`)."""

    def __init__(self, env: Mapping[str, str] | None = None, wrap: Sequence[str] | None = None,
                 timeout: float = 30.0,
                 backend: BackendChoice = BackendChoice("cli", "CLI backend constructed directly")):
        self.env = dict(env or {})
        self.wrap = list(wrap or [])
        self.timeout = timeout
        self.backend = backend

    # -- plumbing --
    def command(self, argv: Sequence[str]) -> list[str]:
        """The full argv that runs `argv` the way this client does (with `wrap`)."""
        return [*self.wrap, *argv]

    def environ(self) -> dict[str, str]:
        """The environment this client runs Slurm commands with."""
        full = dict(os.environ)
        full.update(self.env)
        return full

    def run(self, argv: Sequence[str], timeout: float | None = None) -> subprocess.CompletedProcess:
        """Run a Slurm command; raise SlurmCommandError unless it exits 0."""
        try:
            proc = subprocess.run(self.command(argv), capture_output=True, text=True,
                                  env=self.environ(), timeout=timeout or self.timeout)
        except FileNotFoundError:
            raise SlurmCommandError(argv, 127, "", what=f"{self.command(argv)[0]} is not "
                                    f"installed or not on PATH") from None
        except subprocess.TimeoutExpired as exc:
            stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
            raise SlurmCommandError(argv, None, stderr,
                                    what=f"no answer within {timeout or self.timeout:g} s") \
                from None
        if proc.returncode != 0:
            raise SlurmCommandError(argv, proc.returncode, proc.stderr or proc.stdout)
        return proc

    # -- reading --
    def version(self) -> str:
        return parse_version(self.run(["scontrol", "--version"]).stdout)

    def show_node(self, name: str) -> NodeInfo:
        if expand(name) != [name]:
            raise HpctError(f"node name {name!r} is not a single node name")
        out = self.run(["scontrol", "show", "node", "-o", name]).stdout
        lines = [ln for ln in out.splitlines() if ln.strip()]
        if len(lines) != 1:
            raise HpctError(f"scontrol show node {name} printed {len(lines)} records, not 1")
        return parse_node_record(lines[0])

    def nodes(self) -> list[NodeInfo]:
        """Every node, from `sinfo --json` (structured: free-text reasons parse safely)."""
        return parse_sinfo_json(self.run(["sinfo", "--json"]).stdout)

    def show_job(self, job_id: int) -> JobInfo:
        out = self.run(["scontrol", "show", "job", "-o", str(int(job_id))]).stdout
        lines = [ln for ln in out.splitlines() if ln.strip()]
        if len(lines) != 1:
            raise HpctError(f"scontrol show job {job_id} printed {len(lines)} records, not 1")
        return parse_job_record(lines[0])

    def jobs(self, user: str | None = None, job_ids: Sequence[int] = ()) -> list[JobInfo]:
        """Jobs slurmctld still remembers (finished ones too, until MinJobAge), with flags.

        Filtered here: Slurm 22.05 ignores --user/--jobs when it prints --json."""
        wanted = {int(j) for j in job_ids}
        return [j for j in parse_squeue_json(self.run(["squeue", "--json"]).stdout)
                if (user is None or j.user == user) and (not wanted or j.job_id in wanted)]

    def show_hostnames(self, hostlist: str) -> list[str]:
        # "--" keeps a hostlist that starts with '-' from being read as an option
        argv = ["scontrol", "--", "show", "hostnames", hostlist]
        proc = self.run(argv)
        if "Invalid hostlist" in proc.stderr or "Invalid hostlist" in proc.stdout:
            raise SlurmCommandError(argv, 0, proc.stderr)
        return proc.stdout.split()

    def show_hostlist(self, hosts: Sequence[str]) -> str:
        argv = ["scontrol", "--", "show", "hostlist", ",".join(hosts)]
        proc = self.run(argv)
        if "Invalid hostlist" in proc.stderr or "Invalid hostlist" in proc.stdout:
            raise SlurmCommandError(argv, 0, proc.stderr)
        return proc.stdout.strip()

    # -- acting --
    def update_node(self, names: str | Sequence[str], state: str,
                    reason: str | None = None) -> None:
        """`scontrol update NodeName=<hostlist> State=<state> [Reason=<reason>]`."""
        hostlist = names if isinstance(names, str) else compress(names)
        expand(hostlist)  # our clear error rather than slurmctld's "Invalid node name"
        state = state.upper()
        if state not in UPDATE_NODE_STATES:
            raise HpctError(f"node state {state!r} is not one of "
                            f"{', '.join(sorted(UPDATE_NODE_STATES))}")
        if reason is not None and (not reason.strip() or not reason.isprintable()):
            raise HpctError(f"node reason {reason!r} is not one printable line")
        if state in _STATES_NEEDING_REASON and reason is None:
            raise HpctError(f"node state {state} needs a reason (Slurm refuses it without one)")
        argv = ["scontrol", "update", f"NodeName={hostlist}", f"State={state}"]
        if reason is not None:
            argv.append(f"Reason={reason}")
        self.run(argv)

    def requeue(self, job_id: int) -> None:
        self.run(["scontrol", "requeue", str(int(job_id))])

    def cancel(self, job_id: int, step: int | None = None, signal: str | None = None) -> None:
        """scancel a job or one step. Slurm 22.05 exits 0 for an unknown job id."""
        target = f"{int(job_id)}" if step is None else f"{int(job_id)}.{int(step)}"
        argv = ["scancel"]
        if signal is not None:
            if not re.fullmatch(r"[A-Z0-9]+", signal):
                raise HpctError(f"signal {signal!r} is not a signal name or number")
            argv.append(f"--signal={signal}")
        self.run([*argv, target])

    def sbatch(self, script: str | os.PathLike | None = None, options: Sequence[str] = (),
               wrap: str | None = None, script_args: Sequence[str] = ()) -> int:
        """Submit a batch script (or `--wrap` a command line); return the job id."""
        if (script is None) == (wrap is None):
            raise HpctError("sbatch needs exactly one of a script path or a --wrap command")
        argv = ["sbatch", "--parsable", *options]
        if script is not None:
            path = Path(script)
            if not path.is_file():
                raise HpctError(f"batch script {str(path)!r} does not exist")
            argv += [str(path), *script_args]
        else:
            argv.append(f"--wrap={wrap}")
        return parse_sbatch_parsable(self.run(argv).stdout)
