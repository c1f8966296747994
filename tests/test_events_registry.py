"""One registry of event names and rank states (issue 14, item 3): a name that is not in
`hpct_slurm.events.Ev` can neither be written nor read, so a typo cannot silently break
`hpct-slurm report`."""
from __future__ import annotations

import ast
import io
import json
import re
from pathlib import Path

import pytest

import hpct_slurm
from hpct_slurm.errors import HpctError
from hpct_slurm.events import HEARTBEAT_STATES, NAMES, Ev, EventLog, RankState, Role

PACKAGE = Path(hpct_slurm.__file__).parent
DOCS = PACKAGE.parent / "docs"
# A string literal that reads like an event name: `prefix.rest` (dotted names) or `hook_*`.
_NAME_RE = re.compile(r"[a-z]+\.[a-z_]+|hook_[a-z_]+")
_PREFIXES = {n.split(".")[0] for n in NAMES if "." in n}
_NOT_EVENTS = {"json", "jsonl", "out", "py", "txt", "png", "csv", "sbatch", "pt"}


def _literals(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def _looks_like_an_event(s: str) -> bool:
    if not _NAME_RE.fullmatch(s):
        return False
    if s.startswith("hook_"):
        return True
    prefix, _, rest = s.partition(".")
    return prefix in _PREFIXES and rest not in _NOT_EVENTS


def test_an_unregistered_name_is_refused_and_named():
    out = io.StringIO()
    log = EventLog(stream=out)
    with pytest.raises(HpctError, match=r"'recovery\.dnoe' is not registered"):
        log.emit("recovery.dnoe", generation=1)
    assert out.getvalue() == ""  # nothing written


def test_a_registered_name_is_written_as_its_plain_string(tmp_path):
    out = io.StringIO()
    record = EventLog(stream=out).emit(Ev.RECOVERY_DONE, state=RankState.READY, role=Role.SPARE)
    assert type(record["event"]) is str and record["event"] == "recovery.done"
    line = json.loads(out.getvalue())
    assert (line["event"], line["state"], line["role"]) == ("recovery.done", "ready", "spare")
    # a plain string that is registered is accepted as well (logs written by older code)
    assert EventLog(stream=io.StringIO()).emit("rank.step")["event"] == Ev.RANK_STEP


def test_members_compare_hash_and_format_as_their_strings():
    assert Ev.FAULT_DETECTED == "fault.detected" and "fault.detected" in {Ev.FAULT_DETECTED}
    assert f"{Ev.FAULT_DETECTED}" == str(Ev.FAULT_DETECTED) == "fault.detected"
    assert f"({RankState.RUNNING})" == "(running)"
    assert HEARTBEAT_STATES == {"registering", "forming", "running", "collective", "ready",
                                "unhealthy", "done"}
    assert len(NAMES) == len(Ev.__members__)  # @unique: no name registered twice


def test_every_emit_in_the_package_names_a_registered_event():
    """Literal names passed to emit() (there should be none: they come from Ev) and the
    modules' own EV_* / EVENT_* aliases."""
    unregistered, literal = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and node.args and \
                    getattr(node.func, "attr", getattr(node.func, "id", "")) in ("emit", "_emit"):
                arg = node.args[0]
                if isinstance(arg, (ast.Constant, ast.JoinedStr)):
                    literal.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
                    if isinstance(arg, ast.Constant) and arg.value not in NAMES:
                        unregistered.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert unregistered == [] and literal == []


def test_every_event_name_the_readers_use_is_registered():
    """The report, the bench and the demo read events by name: every literal there that reads
    like an event name must be a registered one (a typo would match nothing, silently)."""
    readers = [*(PACKAGE / "report").rglob("*.py"), *(PACKAGE / "bench").rglob("*.py"),
               *(PACKAGE / "goodput").rglob("*.py"), PACKAGE / "demo.py"]
    bad = [f"{p.relative_to(PACKAGE)}:{line}: {s!r}" for p in readers
           for line, s in _literals(p) if _looks_like_an_event(s) and s not in NAMES]
    assert bad == []


def test_every_event_name_the_tests_read_is_registered():
    tests = Path(__file__).parent
    bad = []
    for p in sorted(tests.glob("test_*.py")):
        if p.name == Path(__file__).name:
            continue
        text = p.read_text()
        for m in re.finditer(r"""(?:events?|emit)\(\s*["']([a-z_.]+)["']""", text):
            if m.group(1) not in NAMES and _looks_like_an_event(m.group(1)):
                bad.append(f"{p.name}: {m.group(1)!r}")
        for m in re.finditer(r"""\[["']event["']\]\s*(?:==|!=)\s*["']([a-z_.]+)["']""", text):
            if m.group(1) not in NAMES and _looks_like_an_event(m.group(1)):
                bad.append(f"{p.name}: {m.group(1)!r}")
    assert bad == []



def test_the_troubleshooting_guide_names_every_registered_event():
    guide = (DOCS / "troubleshooting.md").read_text()
    missing = sorted(n for n in NAMES if f"`{n}`" not in guide)
    assert missing == [], f"docs/troubleshooting.md does not mention {missing}"
