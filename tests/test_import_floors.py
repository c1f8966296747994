"""Import floors (issue 28): each of these modules loads when it is the first one a fresh
interpreter imports, and a rank-side module does not reach up into the controller's package.

An import circle shows only in a fresh interpreter: whichever module of the circle comes in
first decides whether the other finds it half-made, and in the test run something else has
usually imported both already. So each import runs in a subprocess of its own.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import hpct_slurm

PACKAGE = Path(hpct_slurm.__file__).parent
FIRST = ["hpct_slurm.relay.node", "hpct_slurm.rendezvous.store", "hpct_slurm.recovery.striped",
         "hpct_slurm.recovery.transfer", "hpct_slurm.recovery.client"]


def _fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("module", FIRST)
def test_imports_first_in_a_fresh_interpreter(module):
    run = _fresh(f"import {module}")
    assert run.returncode == 0, run.stderr[-3000:]


def test_the_coordination_client_imports_nothing_of_the_controller():
    run = _fresh("import sys\nimport hpct_slurm.recovery.client\n"
                 "print(sorted(m for m in sys.modules if m == 'hpct_slurm.controller'\n"
                 "             or m.startswith('hpct_slurm.controller.')))")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[]"


def _imported_from(path: Path) -> set[str]:
    """The relative modules `path` imports names from, anywhere in it (function bodies too)."""
    return {node.module or "" for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.ImportFrom) and node.level == 1}


def test_striped_and_transfer_do_not_import_each_other_both_ways():
    # transfer serves striped pulls (serve_part); the connection both open is peer_socket's.
    assert "transfer" not in _imported_from(PACKAGE / "recovery" / "striped.py")
    assert "striped" in _imported_from(PACKAGE / "recovery" / "transfer.py")
