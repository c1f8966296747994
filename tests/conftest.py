"""Shared fixtures. `cluster` is a real local Slurm cluster (munged, slurmctld, 5 slurmd in
network namespaces), started once per test session and healed before every test using it.

scripts/test.sh runs two pytest-xdist workers, each a session with a cluster of its own: two
clusters under different roots share no namespace, address, port or munge socket
(localcluster/layout.py), and a real-cluster test mostly waits (on Slurm's verdicts, heartbeats
and timeouts), so two of them run side by side on this project's 2 cores (the suite: 23.7 min
in one process, 13.5 min in two)."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from hpct_slurm.localcluster import LocalCluster

CLUSTER_NODES = 5  # 4 active + 1 spare, the demo's shape


@pytest.fixture(autouse=True)
def _environment_as_it_was():
    """Every test ends with the process environment it started with. pg.init exports the
    backends' settings into os.environ (as a rank must: torch reads them there), so a test
    forming a loopback group in this process left GLOO_SOCKET_IFNAME=lo behind; every later
    real-cluster job inherited it through sbatch, its ranks' gloo bound loopback inside their
    nodes' network namespaces and never formed."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


def pytest_collection_modifyitems(config, items):
    """The `gpu` tier runs wherever torch sees a CUDA device and is skipped, saying why,
    everywhere else (CI has none): the one kind of test this suite ever skips."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu tier: torch sees no CUDA device on this machine "
                                   "(scripts/gpu-check.sh runs it where one is)")
    for item in gpu:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def _session_cluster():
    if os.geteuid() != 0 or shutil.which("slurmctld") is None:
        pytest.fail("the real-cluster tests need root and Slurm installed: run the README "
                    "setup command first (they are never skipped)")
    root = Path(tempfile.mkdtemp(prefix="hpct-test-cluster-"))
    cluster = LocalCluster(root, nodes=CLUSTER_NODES)
    try:
        cluster.up()
        yield cluster
    finally:
        cluster.down()
        # the daemons' logs outlive the session's cluster, for a developer reading a failure
        last = Path(tempfile.gettempdir()) / ("hpct-test-cluster-last-log"
                                              + os.environ.get("PYTEST_XDIST_WORKER", ""))
        shutil.rmtree(last, ignore_errors=True)
        shutil.copytree(root / "log", last, dirs_exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def cluster(_session_cluster: LocalCluster) -> LocalCluster:
    _session_cluster.heal()
    return _session_cluster


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed real-cluster test carries Slurm's own view of it (the queue, the nodes and
    slurmctld's last log lines): CI keeps only the output, and the cluster is gone after."""
    outcome = yield
    report = outcome.get_result()
    cluster = item.funcargs.get("cluster") if hasattr(item, "funcargs") else None
    if report.when != "call" or not report.failed or not isinstance(cluster, LocalCluster):
        return
    try:
        parts = [cluster.client().status_text()]
    except Exception as e:  # noqa: BLE001 - a diagnostic must not hide the failure
        parts = [f"Slurm's status: {e}"]
    log = cluster.layout.log("slurmctld")
    try:
        parts.append("slurmctld.log (last 60 lines):\n"
                     + "".join(log.read_text(errors="replace").splitlines(True)[-60:]))
    except OSError as e:
        parts.append(f"{log}: {e}")
    report.sections.append(("Slurm at the failure", "\n".join(parts)))
