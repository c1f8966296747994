"""What the controller is told to do: `Options`, one job's settings (from the command line,
the SPANK plugin's defaults and Slurm's environment: cli.py and controller.main_from_env)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from .. import config as C
from ..errors import HpctError

# What each field may be, checked when an Options is made (from the command line or from
# Python alike: NaN, -1 or tasks_per_node=0 are refused either way). A field whose flag mirrors
# a setting of the table has that setting's rule, the one its flag parses by (cli.py's
# MIRRORS); --heartbeat-timeout takes its own rule from here.
_SECONDS = C.number_rule("seconds")
RULES: dict[str, C.Setting] = {
    "spares": C.BY_NAME[C.SPARES], "active": C.BY_NAME[C.ACTIVE_NODES],
    "persist_every": C.BY_NAME[C.PERSIST_EVERY], "tasks_per_node": C.BY_NAME[C.TASKS_PER_NODE],
    "store": C.BY_NAME[C.STORE], "on_no_spare": C.BY_NAME[C.ON_NO_SPARE],
    "pool_spares": C.BY_NAME[C.POOL_SPARES], "pool_reservation": C.BY_NAME[C.POOL_RESERVATION],
    "progress_timeout_s": C.BY_NAME[C.PROGRESS_TIMEOUT_S],
    "want_spares": C.BY_NAME[C.SPARE_NODES], "on_few_spares": C.BY_NAME[C.ON_FEW_SPARES],
    "heartbeat_timeout_s": _SECONDS, "ready_timeout_s": _SECONDS,
    "collective_timeout_s": C.BY_NAME[C.COLLECTIVE_TIMEOUT_S],
    "init_timeout_s": C.BY_NAME[C.INIT_TIMEOUT_S], "node_poll_s": _SECONDS,
    "job_id": C.number_rule("int", 1), "slurmd_port": C.number_rule("int", 1, 65535),
    "max_stalled_restarts": C.number_rule("int", 1), "restart_count": C.number_rule("int", 0),
}


@dataclass
class Options:
    command: list[str]
    run_dir: Path
    job_id: int
    nodes: list[str]
    batch_host: str
    spares: int = 1
    active: int | None = None
    persist_every: int = 500
    tasks_per_node: int = 1
    heartbeat_timeout_s: float = 3.0
    ready_timeout_s: float = 60.0
    store: str = "rootless"
    collective_timeout_s: float = 10.0
    # bounded so a member lost between assignment and formation costs at most this long
    init_timeout_s: float = 30.0
    on_no_spare: str = "requeue"  # or "fail"
    pool_spares: int = 0  # spares the job may borrow from the cluster pool over its life
    pool_reservation: str = "hpct_spares"
    slurmd_port: int = 6818
    # A running rank whose step does not advance for this long is hung (a deadlocked training
    # thread keeps heartbeating from its background thread): it is fenced and replaced.
    progress_timeout_s: float = 300.0
    # In-process restarts that make no progress (the same restore step every time) before the
    # job escalates (requeue from disk, or fail).
    max_stalled_restarts: int = 3
    # Slurm's own view of the job's nodes, polled this often (sinfo --json, off the loop).
    node_poll_s: float = 5.0
    # Warm spares the user asked for (with --active, the allocation decides how many it gets)
    # and what to do with fewer on a first start: "warn" (an event and a status line) or
    # "refuse" (end the job). A requeued job only warns: it lost the node it is short of.
    want_spares: int | None = None
    on_few_spares: str = "warn"
    restart_count: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in RULES:
                C.check_value(RULES[f.name], getattr(self, f.name), f"Options.{f.name}")
        if not self.command or not all(isinstance(a, str) for a in self.command):
            raise HpctError(f"Options.command must be a non-empty list of strings, not "
                            f"{self.command!r:.200}")
