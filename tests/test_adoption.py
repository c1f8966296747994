"""Adopting a plain torchrun DDP script keeps its loop (issue 18, item 4): the diff stays within
10 changed lines, docs/adoption.md shows exactly that diff, and the adopted script's own loop
function — run here in one process by what `Job.run` does around it (seed each step, snapshot
after it, restore and re-enter after a fault) — ends bit-identical to a run without a fault,
whether the fault hits mid-epoch, on an epoch's first step, at step 0, or a fresh process
takes over. The same script through a real node crash: tests/test_adoption_cluster.py."""
from __future__ import annotations

import argparse
import ast
import difflib
import json
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from hpct_slurm.errors import HpctError
from hpct_slurm.examples import adopted_ddp
from hpct_slurm.recovery import DistributedSampler
from hpct_slurm.recovery.job import seed_everything, step_seed
from hpct_slurm.recovery.loop import StepLoop
from hpct_slurm.recovery.state import TrainState

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "hpct_slurm" / "examples"
PLAIN = EXAMPLES / "torchrun_ddp.py"
ADOPTED = EXAMPLES / "adopted_ddp.py"
DOC = REPO / "docs" / "adoption.md"
# (plain script, adopted script): the loop-function form, and the loop inline in main() (31)
PAIRS = {"loop function": (PLAIN, ADOPTED),
         "inline": (EXAMPLES / "torchrun_inline.py", EXAMPLES / "adopted_inline.py"),
         # torchtitan's layout: TP plan, fully_shard, a pipeline stage and schedule (46)
         "3d": (EXAMPLES / "torchrun_3d.py", EXAMPLES / "adopted_3d.py")}


# ---- the diff ----------------------------------------------------------------------------

def _code(path: Path) -> list[str]:
    """The script's lines after its module docstring (which says what each script is)."""
    text = path.read_text()
    doc = ast.parse(text).body[0]
    assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
    return text.splitlines()[doc.end_lineno:]


def changed_lines(old: list[str], new: list[str], whitespace: bool = False) -> int:
    """Lines touched turning `old` into `new`: a replaced line counts once; blank lines and
    changes of indentation alone do not count (the way issue 18 counted its 54), unless
    `whitespace` (the way issue 31 counts: a re-indented or blank line is a change too)."""
    a = [line if whitespace else line.strip() for line in old if whitespace or line.strip()]
    b = [line if whitespace else line.strip() for line in new if whitespace or line.strip()]
    ops = difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes()
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal")


def adoption_diff(plain: Path = PLAIN, adopted: Path = ADOPTED) -> str:
    return "\n".join(difflib.unified_diff(_code(plain), _code(adopted), plain.name,
                                          adopted.name, n=1, lineterm=""))


@pytest.mark.parametrize("form", PAIRS)
def test_the_adopted_ddp_script_changes_at_most_10_lines(form):
    plain, adopted = PAIRS[form]
    for whitespace in (False, True):
        n = changed_lines(_code(plain), _code(adopted), whitespace)
        assert n <= 10, adoption_diff(plain, adopted)
    # and it is the loop that is kept: every line of the loop body is unchanged
    body = [ln.strip() for ln in _code(plain) if ln.startswith(" " * 12) and ln.strip()]
    assert body and all(any(ln.strip() == b for ln in _code(adopted)) for b in body)
    if form != "loop function":  # not even re-indented: the loop stays where it was
        assert all(ln in _code(adopted) for ln in _code(plain) if ln.startswith(" " * 12))


@pytest.mark.parametrize("form", PAIRS)
def test_adoption_md_shows_exactly_the_diff(form):
    blocks = re.findall(r"```diff\n(.*?)```", DOC.read_text(), re.S)
    want = [line.rstrip() for line in adoption_diff(*PAIRS[form]).splitlines()]
    assert want in [block.splitlines() for block in blocks], \
        "regenerate the ```diff block in docs/adoption.md: tests/test_adoption.py:adoption_diff()"


def test_changed_lines_counts_replacements_once_and_ignores_whitespace():
    assert changed_lines(["a", "b", "c"], ["a", "B", "c"]) == 1
    assert changed_lines(["a", "b"], ["a", "", "    b", "x", "y"]) == 2
    assert changed_lines(["a", "b", "c"], ["c"]) == 2


# ---- DistributedSampler ------------------------------------------------------------------

@pytest.mark.parametrize("n,world,drop_last", [(512, 4, False), (10, 4, False), (10, 4, True),
                                               (7, 3, False)])
def test_sampler_gives_torchs_indices_in_torchs_order(n, world, drop_last, monkeypatch):
    monkeypatch.setenv("HPCT_WORLD_SIZE", str(world))
    data = list(range(n))
    ours = DistributedSampler(data, seed=3, drop_last=drop_last)
    assert len(ours) == len(torch.utils.data.DistributedSampler(
        data, num_replicas=world, rank=0, seed=3, drop_last=drop_last))
    for rank in range(world):
        theirs = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank,
                                                     seed=3, drop_last=drop_last)
        ours.assign(rank, world)
        for epoch in (0, 5):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            ours.start = 2  # job.steps resuming mid-epoch
            assert list(ours) == list(theirs)[2:]


def test_sampler_before_the_job_knows_its_rank(monkeypatch):
    monkeypatch.delenv("HPCT_WORLD_SIZE", raising=False)
    s = DistributedSampler(list(range(8)))
    with pytest.raises(HpctError, match=r"world size is not known: \$HPCT_WORLD_SIZE"):
        len(s)
    monkeypatch.setenv("HPCT_WORLD_SIZE", "4")
    s = DistributedSampler(list(range(8)))
    assert len(s) == 2  # a scheduler's T_max can be computed before job.run
    with pytest.raises(HpctError, match="has no rank yet"):
        iter(s)
    with pytest.raises(HpctError, match="built for 4 replicas but the job trains 2"):
        s.assign(0, 2)
    monkeypatch.setenv("HPCT_WORLD_SIZE", "four")
    with pytest.raises(HpctError, match="HPCT_WORLD_SIZE 'four' is not a positive integer"):
        DistributedSampler(list(range(8)))


# ---- the adopted script's loop, driven as Job.run drives it ------------------------------

class Fault(RuntimeError):
    """What a failed collective raises in a step."""


class LoopHarness:
    """`Job` around a loop function, minus controller, peers and process group: seeds every
    step from (seed, rank, step), snapshots the registered state after it, and on a fault
    restores a chosen step (this process's own copy, or one handed over to a fresh process)
    and calls the loop function again, as `Job.run` does."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
                 shard: tuple[int, int] = (1, 2)):
        self.shard = shard
        self.loop = StepLoop(self._seed, lambda: None, self._end, lambda given=None: shard)
        self.state = TrainState(model=model, optimizer=opt, lr_scheduler=sched)
        self.state.register(scope="shared", hpct_loop=self.loop.position)
        self.saved: dict[int, tuple] = {-1: self.state.capture_into(None, ("shared",))}
        self.forwards: list[tuple[int, float]] = []  # (step, sum of its batch), every forward
        self.rank = shard[0]

    def _seed(self, step: int) -> None:
        seed_everything(step_seed(0, self.shard[0], step))

    def _end(self, step: int) -> None:
        self.saved[step] = self.state.capture_into(None, ("shared",))

    @property
    def step(self) -> int:
        return self.loop.step

    def epochs(self, n: int):
        return self.loop.epochs(n)

    def steps(self, loader):
        return self.loop.steps(loader)

    def restore(self, step: int, snapshot: tuple | None = None) -> None:
        layout, buf = snapshot if snapshot is not None else self.saved[step]
        self.state.restore_from(layout, buf, scopes=("shared",))
        self.loop.enter(step)

    def run(self, train: Callable[[], None], restore_to: Callable[[int], int] | None = None
            ) -> None:
        """`train()` until it returns; after a Fault in step k, restore `restore_to(k)`."""
        self.loop.enter(-1)
        while True:
            try:
                train()
                self.loop.finish()
                return
            except Fault:
                assert restore_to is not None
                self.restore(restore_to(self.loop.step))


class Forward(torch.nn.Module):
    """The model as the loop sees it (`ddp`): records each batch and fails on request."""

    def __init__(self, harness: LoopHarness, model: torch.nn.Module, fail_at: set[int]):
        super().__init__()
        self.h, self.model, self.fail_at = harness, model, fail_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.h.forwards.append((self.h.step, float(x.sum())))
        if self.h.step in self.fail_at:
            self.fail_at.discard(self.h.step)
            raise Fault(f"collective failed in step {self.h.step}")
        return self.model(x)


@pytest.fixture
def one_process_group(tmp_path, monkeypatch):
    """A world of one for the script's `dist.get_rank()`; its data shard is (1, 2)."""
    monkeypatch.setenv("HPCT_WORLD_SIZE", "2")
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()
    torch.use_deterministic_algorithms(False)


def _build(args: argparse.Namespace):
    torch.manual_seed(1234)
    model = adopted_ddp.TinyLM()
    data = adopted_ddp.token_data(128)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, sampler=sampler)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    return model, sampler, loader, opt, sched


def _train(tmp_path: Path, fail_at: set[int] = frozenset(),  # type: ignore[assignment]
           restore_to: Callable[[int], int] | None = None) -> tuple[dict, LoopHarness]:
    """The adopted script's `train` (4 epochs of 4 steps), through faults at `fail_at`."""
    args = argparse.Namespace(epochs=4, batch=16, step_sleep=0.0, out=str(tmp_path))
    model, sampler, loader, opt, sched = _build(args)
    h = LoopHarness(model, opt, sched)
    fwd = Forward(h, model, set(fail_at))
    h.run(lambda: adopted_ddp.train(h, model, fwd, sampler, loader, opt, sched, args),
          restore_to)
    return json.loads((tmp_path / "results" / "rank0.json").read_text()), h


def _kept(h: LoopHarness) -> dict[int, float]:
    """The batch each step trained on last (a restored step is trained again)."""
    return dict(h.forwards)


@pytest.mark.parametrize("fail_at,back", [
    ({6}, 1),      # mid-epoch, restore the step before
    ({8}, 1),      # the first step of an epoch: restore the previous epoch's last
    ({9}, 3),      # two steps back across an epoch boundary (an older snapshot)
    ({0}, 1),      # during step 0: back to the state at creation (-1)
    ({3, 11}, 1),  # two faults
])
def test_a_fault_and_restore_ends_bit_identical(tmp_path, one_process_group, fail_at, back):
    ref, h_ref = _train(tmp_path / "ref")
    got, h = _train(tmp_path / "got", fail_at, lambda k: k - back)
    assert got == ref
    assert _kept(h) == _kept(h_ref) and len(_kept(h)) == 16
    assert h.loop.step == 16 and h.loop.position.epoch == 4


def test_a_fresh_process_takes_over_from_a_survivors_snapshot(tmp_path, one_process_group):
    ref, h_ref = _train(tmp_path / "ref")
    survivor, _ = _train(tmp_path / "survivor", {10}, lambda k: k - 1)
    # A spare: its own objects, built the same way, given the survivor's step 9 ...
    args = argparse.Namespace(epochs=4, batch=16, step_sleep=0.0, out=str(tmp_path / "spare"))
    old_model, old_sampler, old_loader, old_opt, old_sched = _build(args)
    donor = LoopHarness(old_model, old_opt, old_sched)
    donor_fwd = Forward(donor, old_model, {10})
    with pytest.raises(Fault):  # ... which trains until its step 10 fails
        donor.loop.enter(-1)
        adopted_ddp.train(donor, old_model, donor_fwd, old_sampler, old_loader, old_opt,
                          old_sched, args)
    model, sampler, loader, opt, sched = _build(args)
    spare = LoopHarness(model, opt, sched)
    spare.restore(9, donor.saved[9])
    adopted_ddp.train(spare, model, Forward(spare, model, set()), sampler, loader, opt, sched,
                      args)
    spare.loop.finish()
    assert json.loads((tmp_path / "spare" / "results" / "rank0.json").read_text()) == ref
    assert {k: v for k, v in _kept(spare).items()} == {k: v for k, v in _kept(h_ref).items()
                                                      if k >= 10}


def test_an_epochs_last_step_ends_with_the_code_after_its_batches():
    """A per-epoch scheduler step after the batches is part of the epoch's last step: its
    snapshot holds it and the next epoch's position, so a restore never repeats it."""
    ended: list[tuple[int, dict]] = []
    counter = {"after_epoch": 0}
    loop = StepLoop(lambda s: None, lambda: None,
                    lambda s: ended.append((s, {**loop.position.state_dict(), **counter})),
                    lambda given=None: (0, 1))
    loop.enter(-1)
    for _ in loop.epochs(2):
        for _ in loop.steps([1, 2]):
            pass
        counter["after_epoch"] += 1
    loop.finish()
    assert ended == [(0, {"epoch": 0, "batch": 1, "after_epoch": 0}),
                     (1, {"epoch": 1, "batch": 0, "after_epoch": 1}),
                     (2, {"epoch": 1, "batch": 1, "after_epoch": 1}),
                     (3, {"epoch": 2, "batch": 0, "after_epoch": 2})]


def test_any_other_loader_is_fast_forwarded_by_dropping_batches_done():
    seen: list[tuple[int, str]] = []
    loop = StepLoop(lambda s: None, lambda: None, lambda s: None, lambda given=None: (0, 1))
    loop.position.load_state_dict({"epoch": 1, "batch": 2})
    loop.enter(5)
    for epoch in loop.epochs(2):
        for batch in loop.steps(["a", "b", "c", "d"]):
            seen.append((loop.step, f"{epoch}{batch}"))
    assert seen == [(6, "1c"), (7, "1d")]


def test_steps_twice_in_one_epoch_is_an_error():
    loop = StepLoop(lambda s: None, lambda: None, lambda s: None, lambda given=None: (0, 1))
    loop.enter(-1)
    for _ in loop.epochs(1):
        list(loop.steps([1]))
        with pytest.raises(HpctError, match="runs once per epoch"):
            list(loop.steps([1]))


# ---- every name adoption.md uses is documented -------------------------------------------

_IMPORT = re.compile(r"from (hpct_slurm[\w.]*) import ([\w, ]+)")
_ASSIGN = re.compile(r"\b([a-z_]\w*) = ([A-Za-z_][\w.]*\(.*)")
_USE = re.compile(r"(?<![\w.])([A-Za-z_]\w*)\.([A-Za-z_]\w*)")


def _snippets(markdown: str) -> list[tuple[bool, str]]:
    """(is it shell, text) of every fenced code block and inline code span, in order."""
    return [(m.group(1) == "", m.group(2)) if m.group(2) is not None else (False, m.group(3))
            for m in re.finditer(r"```([a-z]*)\n(.*?)```|`([^`\n]+)`", markdown, re.S)]


def _call_chain(expr: str) -> list[str]:
    """`A.b(x, c(y)).d(z)` -> ["A", "b", "d"]: the names, calls' arguments skipped."""
    names, depth, word = [], 0, ""
    for ch in expr:
        if depth:
            depth += {"(": 1, ")": -1}.get(ch, 0)
        elif ch == "(":
            depth = 1
        elif ch.isalnum() or ch == "_":
            word += ch
        elif ch == "." and word:
            names.append(word)
            word = ""
        else:
            break
    return names + [word] if word else names


def _returns(fn: Any) -> Any:
    """What `fn` is annotated to return (None when it cannot be resolved here)."""
    ann = getattr(fn, "__annotations__", {}).get("return")
    for _ in range(2):  # `-> "X"` under `from __future__ import annotations` is "'X'"
        if isinstance(ann, str):
            try:
                ann = eval(ann, getattr(fn, "__globals__", {}))  # noqa: S307 - our annotations
            except NameError:
                return None
    return ann


def _documented(owner: type, attr: str) -> bool:
    """`owner.attr` has a docstring of its own, or (an instance attribute) is named in the
    class docstring, or is a field of a documented dataclass."""
    import dataclasses
    import inspect

    static = inspect.getattr_static(owner, attr, None)
    if static is None:
        fields = {f.name for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(
            owner) else set()
        return bool(owner.__doc__) and (re.search(rf"`{attr}`|\b{attr}\b", owner.__doc__)
                                        is not None or attr in fields)
    if isinstance(static, (staticmethod, classmethod)):
        static = static.__func__
    if callable(static) or isinstance(static, property):
        return bool(static.__doc__ and static.__doc__.strip())
    return True  # a class-level value: documented where the class is


def test_every_hpct_name_adoption_md_uses_has_a_docstring():
    import importlib
    import inspect

    imported: dict[str, Any] = {}
    kinds: dict[str, type] = {}   # variable -> the hpct_slurm class of its value
    undocumented, unknown = [], []
    for shell, snippet in _snippets(DOC.read_text()):
        for module, names in _IMPORT.findall(snippet):
            mod = importlib.import_module(module)
            for name, _, alias in (n.strip().partition(" as ") for n in names.split(",")
                                   if n.strip()):
                imported[alias.strip() or name.strip()] = getattr(mod, name.strip())
        kinds.setdefault("job", imported.get("Job") or importlib.import_module(
            "hpct_slurm.recovery").Job)
        for var, rhs in _ASSIGN.findall(snippet):
            chain = _call_chain(rhs)
            obj = imported.get(chain[0]) if chain else None
            for attr in chain[1:]:
                obj = _returns(getattr(obj, attr)) if obj is not None else None
            if inspect.isfunction(obj):
                obj = _returns(obj)
            if inspect.isclass(obj) and obj.__module__.startswith("hpct_slurm"):
                kinds[var] = obj
        for name, attr in _USE.findall(snippet):
            if shell and name.islower():
                continue  # `job.sbatch` in a command line is a file name
            owner = kinds.get(name) or (imported.get(name) if inspect.isclass(
                imported.get(name)) else None)
            if owner is None:
                continue
            if not hasattr(owner, attr) and not _documented(owner, attr):
                unknown.append(f"{name}.{attr}")
            elif not _documented(owner, attr):
                undocumented.append(f"{owner.__name__}.{attr}")
    for name, obj in imported.items():
        if (inspect.isclass(obj) or callable(obj)) and not (obj.__doc__ or "").strip():
            undocumented.append(name)
    assert {"Job", "DistributedSampler", "ResumableSampler"} <= set(imported) | {
        c.__name__ for c in kinds.values()}
    assert not unknown, f"adoption.md uses names that do not exist: {sorted(set(unknown))}"
    assert not undocumented, f"no docstring: {sorted(set(undocumented))}"


def test_rendezvous_secret_makes_the_file_tier_1_reads(tmp_path, capsys):
    """`hpct-slurm rendezvous secret PATH`, as adoption.md's tier 1 shows it."""
    import os
    import stat

    from hpct_slurm.cli import main
    from hpct_slurm.rendezvous.store import load_secret

    path = tmp_path / "job-secret"
    assert main(["rendezvous", "secret", str(path)]) == 0
    assert capsys.readouterr().out == f"{path}\n"
    text = path.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}\n", text)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_secret(path) == bytes.fromhex(text.strip())
    assert main(["rendezvous", "secret", str(path)]) == 2  # never overwrites
    assert "already exists" in capsys.readouterr().err
