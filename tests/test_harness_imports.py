"""`demo` and `bench` do not import each other (issue 14): what both need to run a job on a local
cluster and read its record is the shared harness, hpct_slurm/localcluster/jobs.py, which the
real-cluster tests use too. Checked on the source (AST), so no import runs."""
from __future__ import annotations

import ast
from pathlib import Path

import hpct_slurm
from hpct_slurm.localcluster import jobs

PACKAGE = Path(hpct_slurm.__file__).parent
TESTS = Path(__file__).parent
DEMO = ("hpct_slurm.demo", "hpct_slurm.demo_cli")
BENCH = ("hpct_slurm.bench",)


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Every module `path` imports, absolute, and every dotted string it names (`python -m
    hpct_slurm.x`, importlib): `from a import b` counts as both a and a.b, since b may be a
    submodule."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module_name(path).split(".") if PACKAGE in path.parents else []
    if package and path.name != "__init__.py":
        package = package[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join([*base, *(node.module.split(".") if node.module else [])])
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.update(w.rstrip(".,:;'\"`)") for w in node.value.split()
                       if w.startswith("hpct_slurm."))
    return out


def of(names: set[str], prefixes: tuple[str, ...]) -> set[str]:
    return {n for n in names if any(n == p or n.startswith(p + ".") for p in prefixes)}


def test_the_scanner_resolves_relative_imports_and_module_strings() -> None:
    assert of(imports(PACKAGE / "demo.py"), ("hpct_slurm.localcluster.jobs",))
    assert "hpct_slurm.localcluster.jobs" in imports(PACKAGE / "bench" / "recovery.py")
    assert "hpct_slurm.examples.restart_all" in imports(PACKAGE / "examples" / "restart_all.py")


def test_bench_does_not_import_the_demo() -> None:
    bad = {f"{p.relative_to(PACKAGE.parent)}: {sorted(of(imports(p), DEMO))}"
           for p in sorted((PACKAGE / "bench").rglob("*.py")) if of(imports(p), DEMO)}
    assert not bad, f"bench imports the demo (use hpct_slurm.localcluster.jobs): {bad}"


def test_the_demo_does_not_import_bench() -> None:
    bad = {f"{p.name}: {sorted(of(imports(p), BENCH))}" for p in
           (PACKAGE / "demo.py", PACKAGE / "demo_cli.py") if of(imports(p), BENCH)}
    assert not bad, f"the demo imports bench (use hpct_slurm.localcluster.jobs): {bad}"


def test_the_harness_imports_neither() -> None:
    assert not of(imports(Path(jobs.__file__)), DEMO + BENCH)


def test_tests_take_the_job_helpers_from_the_harness() -> None:
    """A test may import the demo to test the demo, not to borrow the harness's helpers."""
    shared = {n for n in vars(jobs) if not n.startswith("_")}
    bad = []
    for path in sorted(TESTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module in DEMO:
                bad += [f"{path.name}: {a.name}" for a in node.names if a.name in shared]
    assert not bad, f"import these from hpct_slurm.localcluster.jobs: {bad}"
