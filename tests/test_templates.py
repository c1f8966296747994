"""The shipped sbatch templates: the copies users read in sbatch/ are the ones the package ships,
`hpct-slurm template` prints them, and every one keeps the options recovery depends on."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from hpct_slurm.cli import main

REPO = Path(__file__).resolve().parent.parent
SBATCH = REPO / "sbatch"
TEMPLATES = REPO / "hpct_slurm" / "templates"
NAMES = sorted(p.name for p in TEMPLATES.glob("*.sbatch"))


def _directives(text: str) -> list[str]:
    """The options of the `#SBATCH` lines, each without its trailing comment."""
    return [line.split()[1] for line in text.splitlines()
            if line.startswith("#SBATCH") and len(line.split()) > 1]


def test_sbatch_dir_and_package_templates_are_the_same_files():
    assert NAMES == ["pool.sbatch", "train.sbatch"]
    assert sorted(p.name for p in SBATCH.glob("*.sbatch")) == NAMES
    for name in NAMES:
        assert (SBATCH / name).read_bytes() == (TEMPLATES / name).read_bytes(), name


@pytest.mark.parametrize("name", NAMES)
def test_template_cli_prints_the_template(name, capsys):
    assert main(["template", name.removesuffix(".sbatch")]) == 0
    out, err = capsys.readouterr()
    assert out == (TEMPLATES / name).read_text() and err == ""


def test_template_cli_defaults_to_train(capsys):
    assert main(["template"]) == 0
    assert capsys.readouterr().out == (TEMPLATES / "train.sbatch").read_text()


def test_unknown_template_exits_2_with_one_line(capsys):
    assert main(["template", "nosuch"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("HPCT: ") and "'nosuch'" in err and "pool, train" in err


@pytest.mark.parametrize("name", NAMES)
def test_template_keeps_what_recovery_needs(name):
    text = (TEMPLATES / name).read_text()
    options = _directives(text)
    assert "--no-kill" in options and "--requeue" in options, options
    assert "--exclusive" in options, options
    # B: signals only the batch shell, so the controller must be that shell (exec), or the
    # SIGTERM before the time limit never reaches it.
    assert "--signal=B:TERM@60" in options, options
    assert 'exec "$HPCT_BIN" controller' in text


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("name", NAMES)
def test_template_is_valid_bash(name):
    proc = subprocess.run(["bash", "-n", str(TEMPLATES / name)], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("name", NAMES)
def test_template_without_hpct_slurm_on_path_fails_with_one_clear_line(name):
    proc = subprocess.run(["bash", str(TEMPLATES / name)], capture_output=True, text=True,
                          timeout=30, env={"PATH": "/usr/bin:/bin", "HPCT_BIN": "no-such-hpct"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "'no-such-hpct' is not on this job's PATH (/usr/bin:/bin)" in proc.stderr
    assert "export HPCT_BIN=" in proc.stderr
