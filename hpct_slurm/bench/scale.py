"""`hpct-slurm bench scale --ranks N`: the real controller against N simulated ranks.

The controller runs as its own process (bench/scale_ctl.py: the real Controller, its seams
given stand-ins that start nothing), the ranks as light asyncio clients in a few processes
(bench/scale_sim.py: the real protocol and secret, the controller's pacing), grouped into nodes
of 8, each node one relayed connection as relay/node.py makes it. After generation 0 is
assigned and heartbeats have spread out, the bench measures the controller's steady state (its
own CPU seconds per wall second from /proc, its RSS, the messages the ranks sent, by type, and
the frames that carried them), then injects two node losses, one at a time:

* `drop`: one node's connection reset (a crashed node);
* `silent`: one node stops sending and answering, its connection open (a hung node).

For each it reports, from the controller's own event log and the ranks' receipt times (one
machine, one clock): fault -> detected, detected -> STOP sent to every survivor, detected ->
assignment (`detect_to_assign_s`), assignment -> every rank of the new generation has received
its Assign (`assign_to_all_acked_s`, from the receipt times), assignment -> first step done.

Results accumulate in <out>/scale.json (one entry per N, so `--ranks 2304` and `--ranks 16384`
runs add up) with scale.png (latency and CPU against N); the last line printed is the JSON of
this run's largest N.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .. import config as C
from ..errors import HpctError
from ..events import Ev, read_events
from .common import write_result

TASKS_PER_NODE = 8
JOB_ID = 16016
DEFAULT_RANKS = [2304]
# Simulated ranks per simulator process (each one process on this 2-core machine).
RANKS_PER_SIM = 2048


def node_names(ranks: int, spares: int, tpn: int = TASKS_PER_NODE) -> list[str]:
    """The allocation: the batch host first (it trains too), then the other nodes."""
    if ranks < tpn or ranks % tpn:
        raise HpctError(f"--ranks {ranks} must be a positive multiple of {tpn} (nodes of {tpn})")
    return ["localhost"] + [f"sim{i:05d}" for i in range(1, ranks // tpn + spares)]


def sim_slices(nodes: list[str], spares: int, tpn: int, per_sim: int = RANKS_PER_SIM
               ) -> list[list[tuple[str, str]]]:
    """(node, role) lists, one per simulator process, nodes kept whole."""
    roles = [(n, "spare" if i >= len(nodes) - spares else "active") for i, n in enumerate(nodes)]
    per = max(1, per_sim // tpn)
    return [roles[i:i + per] for i in range(0, len(roles), per)]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (clock ticks)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def round_phases(events: list[dict], t_fault: float, generation: int, acked_at: float | None,
                 acked: int, world: int) -> dict[str, Any]:
    """One recovery round's phases from the controller's events (after `t_fault`) and the
    ranks' latest Assign receipt of `generation` (pure: tests feed it records)."""
    def first(name: Ev, **match) -> float | None:
        return next((e["t"] for e in events if e["event"] == name and e["t"] >= t_fault
                     and all(e.get(k) == v for k, v in match.items())), None)

    detect = first(Ev.FAULT_DETECTED)
    stop = first(Ev.FAULT_STOP_SENT)
    assign = first(Ev.RECOVERY_ASSIGN, generation=generation)
    done = first(Ev.RECOVERY_DONE, generation=generation)
    if detect is None or assign is None:
        raise HpctError(f"generation {generation}: the controller logged no "
                        f"{'fault.detected' if detect is None else 'recovery.assign'} "
                        f"after the fault")
    reason = next(e.get("reason") for e in events if e["event"] == Ev.FAULT_DETECTED
                  and e["t"] >= t_fault)
    return {
        "reason": reason,
        "fault_to_detect_s": detect - t_fault,
        "detect_to_stop_sent_s": None if stop is None else stop - detect,
        "detect_to_assign_s": assign - detect,
        "assign_to_all_acked_s": None if acked_at is None else acked_at - assign,
        "acked": acked, "world": world,
        "assign_to_first_step_s": None if done is None else done - assign,
    }


class Driver:
    """The controller process and the simulators of one N."""

    def __init__(self, ranks: int, step_s: float, work: Path, faults: list[str]):
        self.ranks, self.step_s, self.faults = ranks, step_s, faults
        self.spares = len(faults)
        self.profile = ""  # a path: cProfile the controller into it (for finding hot spots)
        self.nodes = node_names(ranks, self.spares)
        self.run_dir = work / f"run-{ranks}"
        self.procs: list[subprocess.Popen] = []
        self.sims: list[subprocess.Popen] = []

    def _spawn(self, module: str, cfg: dict, **kw) -> subprocess.Popen:
        argv = [sys.executable, "-m", f"hpct_slurm.bench.{module}", json.dumps(cfg)]
        p = subprocess.Popen(argv, text=True, **kw)
        self.procs.append(p)
        return p

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, mode=0o700)
        self.ctl = self._spawn("scale_ctl", {
            "run_dir": str(self.run_dir), "job_id": JOB_ID, "nodes": self.nodes,
            "spares": self.spares, "tasks_per_node": TASKS_PER_NODE,
            "profile": self.profile},
            stdout=subprocess.DEVNULL, stderr=open(self.run_dir.parent / f"ctl-{self.ranks}.err", "w"))
        env_file = self.run_dir / "sim-env.json"
        self._until(env_file.exists, "the controller's step environment", 60)
        env = json.loads(env_file.read_text())
        parts = sim_slices(self.nodes, self.spares, TASKS_PER_NODE)
        for part in parts:
            self.sims.append(self._spawn("scale_sim", {
                "job_id": JOB_ID, "env": env, "step_s": self.step_s, "sims": len(parts),
                "tasks_per_node": TASKS_PER_NODE, "nodes": part},
                stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        self.env = env
        for s in self.sims:
            self._line(s, "ready", 600)

    def _until(self, pred, what: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not (got := pred()):
            if self.ctl.poll() is not None:
                raise HpctError(f"the controller exited ({self.ctl.returncode}) waiting for "
                                f"{what}")
            if time.monotonic() > deadline:
                raise HpctError(f"no {what} within {timeout:.0f} s")
            time.sleep(0.05)
        return got

    def _line(self, sim: subprocess.Popen, key: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r, _, _ = select.select([sim.stdout], [], [], 1.0)
            if r:
                line = sim.stdout.readline()
                if not line:
                    raise HpctError(f"a simulator exited ({sim.wait()})")
                obj = json.loads(line)
                if key in obj:
                    return obj
            if self.ctl.poll() is not None:
                raise HpctError(f"the controller exited ({self.ctl.returncode})")
        raise HpctError(f"no {key!r} from a simulator within {timeout:.0f} s")

    def tell(self, cmd: dict) -> None:
        for s in self.sims:
            s.stdin.write(json.dumps(cmd) + "\n")
            s.stdin.flush()

    def status(self) -> list[dict]:
        self.tell({"cmd": "status"})
        return [self._line(s, "status", 60)["status"] for s in self.sims]

    def assigned(self, generation: int) -> tuple[int, float | None]:
        got = [st["assigned"].get(str(generation)) for st in self.status()]
        n = sum(g[0] for g in got if g)
        return n, max((g[1] for g in got if g), default=None)

    def events(self) -> list[dict]:
        return list(read_events(self.run_dir / "controller.jsonl"))

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()


def measure(ranks: int, step_s: float, work: Path, faults: list[str],
            window_s: float = 10.0) -> dict[str, Any]:
    d = Driver(ranks, step_s, work, faults)
    t0 = time.time()
    try:
        d.start()
        t_registered = time.time() - t0
        world = ranks
        d._until(lambda: d.assigned(0)[0] >= world, "generation 0 assigned to every rank", 600)
        t_gen0 = time.time() - t0
        hb = C.read(d.env, C.HEARTBEAT_S)
        # heartbeats spread over their random phases first, then one window of steady state
        time.sleep(max(min(2.0, window_s), hb))
        window = max(window_s, 1.5 * hb)
        d.tell({"cmd": "count", "on": True})
        c0, w0 = cpu_seconds(d.ctl.pid), time.monotonic()
        time.sleep(window)
        c1, w1 = cpu_seconds(d.ctl.pid), time.monotonic()
        sent: dict[str, int] = {}
        for st in d.status():
            for k, v in st["sent"].items():
                sent[k] = sent.get(k, 0) + v
        d.tell({"cmd": "count", "on": False})
        steady = {"window_s": w1 - w0, "controller_cpu_pct": 100 * (c1 - c0) / (w1 - w0),
                  "controller_rss_mb": rss_mb(d.ctl.pid),
                  "messages_per_s": {k: v / (w1 - w0) for k, v in sorted(sent.items())}}
        rounds = []
        for generation, how in enumerate(faults, start=1):
            victim = d.nodes[len(d.nodes) // 2 + generation]  # a member, not the batch host
            t_fault, cpu_before = time.time(), cpu_seconds(d.ctl.pid)
            d.tell({"cmd": how, "node": victim})
            n, last = d._until(lambda: (lambda a: a if a[0] >= world else None)(
                d.assigned(generation)), f"generation {generation} assigned to every rank",
                300)
            d._until(lambda: any(e["event"] == Ev.RECOVERY_DONE
                                 and e.get("generation") == generation for e in d.events()),
                     f"recovery of generation {generation} done", 120)
            r = round_phases(d.events(), t_fault, generation, last, n, world)
            # the controller's own CPU over the whole round (detection wait included): on a
            # loaded machine the wall-clock phases also hold time spent waiting for a core
            r["controller_cpu_s"] = cpu_seconds(d.ctl.pid) - cpu_before
            # when the last survivor had the STOP: the rest of detect -> assign is the
            # survivors answering (Holdings + ready) and the controller reading them
            stops = [st["stopped"].get(str(generation - 1)) for st in d.status()]
            last_stop = max((x[1] for x in stops if x), default=None)
            detect_t = t_fault + r["fault_to_detect_s"]
            r["detect_to_last_stop_received_s"] = None if last_stop is None \
                else last_stop - detect_t
            rounds.append({"fault": how, "node": victim, **r})
        return {"ranks": ranks, "nodes": len(d.nodes), "spares": d.spares,
                "tasks_per_node": TASKS_PER_NODE, "step_s": step_s,
                "heartbeat_s": hb, "step_report_s": C.read(d.env, C.STEP_REPORT_S) or 0.0,
                "register_s": t_registered, "gen0_assigned_s": t_gen0,
                "steady": steady, "rounds": rounds, "wall_s": time.time() - t0}
    finally:
        d.stop()


def headline(m: dict[str, Any]) -> dict[str, Any]:
    """The last line: the worst round's phases, the steady state's CPU and RSS."""
    def worst(key: str) -> float | None:
        vals = [r[key] for r in m["rounds"] if r.get(key) is not None]
        return max(vals) if vals else None
    return {"ranks": m["ranks"], "detect_to_assign_s": worst("detect_to_assign_s"),
            "assign_to_all_acked_s": worst("assign_to_all_acked_s"),
            "controller_cpu_pct": m["steady"]["controller_cpu_pct"],
            "controller_rss_mb": m["steady"]["controller_rss_mb"],
            "silent_detect_s": next((r["fault_to_detect_s"] for r in m["rounds"]
                                     if r["fault"] == "silent"), None)}


def plot(runs: dict[str, dict], path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ns = sorted(runs, key=int)
    xs = [int(n) for n in ns]
    heads = [headline(runs[n]) for n in ns]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("detect_to_assign_s", "detect → assign"),
                       ("assign_to_all_acked_s", "assign → all acked")):
        a.plot(xs, [h[key] for h in heads], "o-", label=label)
    a.set_xscale("log", base=2)
    a.set_xlabel("simulated ranks")
    a.set_ylabel("seconds (worst of the injected faults)")
    a.legend()
    a.set_title("recovery round latency")
    b.plot(xs, [h["controller_cpu_pct"] for h in heads], "o-", color="C3")
    b.set_xscale("log", base=2)
    b.set_xlabel("simulated ranks")
    b.set_ylabel("% of one core")
    b.set_title("controller CPU, steady state")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run(out_dir: Path, quick: bool = False, ranks: list[int] | None = None,
        step_s: float = 1.0, faults: list[str] | None = None) -> dict[str, Any]:
    ranks = ranks or ([256] if quick else DEFAULT_RANKS)
    for n in ranks:
        node_names(n, 0)  # a bad N fails before anything starts
    faults = faults or ["drop", "silent"]
    out = Path(out_dir)
    path = out / "scale.json"
    runs: dict[str, dict] = {}
    if path.exists():
        runs = json.loads(path.read_text()).get("runs", {})
    work = Path(tempfile.mkdtemp(prefix="hpct-scale-"))
    try:
        for n in ranks:
            runs[str(n)] = measure(n, step_s, work, faults)
            print(json.dumps(headline(runs[str(n)])), file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {str(n): headline(runs[str(n)]) for n in sorted(runs, key=int)}
    write_result(out, "scale", {"runs": runs, "summary": summary})
    plot(runs, out / "scale.png")
    return headline(runs[str(max(ranks))])
