"""What a job did and what its faults cost, from its event logs: `hpct-slurm status` and
`hpct-slurm report` (goodput, per-phase recovery times, PNG timeline)."""
from .model import (Fault, FaultStatus, Generation, Recovery, Report, RunEvents, Status,
                    build_report, build_status)
from .records import parse_jsonl

__all__ = ["Fault", "FaultStatus", "Generation", "Recovery", "Report", "RunEvents", "Status",
           "build_report", "build_status", "parse_jsonl"]
