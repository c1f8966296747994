"""Shared fixtures. `cluster` is a real local Slurm cluster (munged, slurmctld, 5 slurmd in
network namespaces), started once per test session and healed before every test using it."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from hpct_slurm.localcluster import LocalCluster

CLUSTER_NODES = 5  # 4 active + 1 spare, the demo's shape


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
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def cluster(_session_cluster: LocalCluster) -> LocalCluster:
    _session_cluster.heal()
    return _session_cluster
