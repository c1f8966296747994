"""Choose how to reach Slurm: pyslurm where it truly matches the running Slurm, else the CLI.

pyslurm is compiled against one Slurm release and its version says which (`25.11.x` is for
Slurm 25.11). A mismatched build either fails to import or talks a wrong RPC layout, so it is
used only when it imports AND its major.minor equals the running Slurm's.

No pyslurm release on PyPI matches Slurm 22.05 (Debian 12's Slurm; PyPI has builds for 25.11
and for 17.x/18.x), so on the machines this project tests on `select_backend` always returns the
CLI client, and the pyslurm reads below are not exercised by the test suite.
"""
from __future__ import annotations

import importlib
from typing import Mapping, Sequence

from ..errors import HpctError
from .client import BackendChoice, NodeInfo, SlurmClient, parse_node_state

PREFERENCES = ("auto", "cli", "pyslurm")


def _major_minor(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def choose_backend(prefer: str, slurm_version: str | None,
                   pyslurm_version: str | None) -> BackendChoice:
    """Pure decision: `pyslurm_version` is None when pyslurm does not import."""
    if prefer not in PREFERENCES:
        raise HpctError(f"Slurm backend {prefer!r} is not one of {', '.join(PREFERENCES)}")
    if prefer == "cli":
        return BackendChoice("cli", "CLI backend requested")
    if pyslurm_version is None:
        why = "pyslurm does not import"
    elif slurm_version is None:
        why = "the running Slurm version is unknown"
    elif _major_minor(pyslurm_version) != _major_minor(slurm_version):
        why = f"pyslurm {pyslurm_version} is built for another Slurm than {slurm_version}"
    else:
        return BackendChoice("pyslurm", f"pyslurm {pyslurm_version} matches Slurm "
                                        f"{slurm_version}")
    if prefer == "pyslurm":
        raise HpctError(f"pyslurm backend requested but {why}; use the CLI backend")
    return BackendChoice("cli", f"CLI backend: {why}")


class PyslurmClient(SlurmClient):
    """The CLI client with node reads done through pyslurm's API (pyslurm >= 23.2).

    pyslurm talks to slurmctld from this process: it honours this process's SLURM_CONF and
    network namespace, not the client's `env` and `wrap` (which still apply to the commands)."""

    def __init__(self, pyslurm_module, **kwargs):
        super().__init__(**kwargs)
        self._pyslurm = pyslurm_module

    @staticmethod
    def _node_info(node) -> NodeInfo:
        # pyslurm's `state` is slurm_node_state_string_complete(), the same `IDLE+DRAIN`
        # text scontrol prints, so both backends share one state parser.
        state, flags = parse_node_state(node.state)
        return NodeInfo(name=node.name, state=state, flags=flags, reason=node.reason or None,
                        addr=node.address or None, hostname=node.hostname or None,
                        features=tuple(node.available_features or ()),
                        active_features=tuple(node.active_features or ()),
                        comment=getattr(node, "comment", None) or None)

    def show_node(self, name: str) -> NodeInfo:
        return self._node_info(self._pyslurm.Node.load(name))

    def nodes(self) -> list[NodeInfo]:
        return [self._node_info(n) for n in self._pyslurm.Nodes.load().values()]


def select_backend(prefer: str = "auto", env: Mapping[str, str] | None = None,
                   wrap: Sequence[str] | None = None, timeout: float = 30.0) -> SlurmClient:
    """A client for this machine's Slurm; `client.backend.reason` says which and why."""
    pyslurm, pyslurm_version, slurm_version = None, None, None
    if prefer != "cli":
        try:
            pyslurm = importlib.import_module("pyslurm")
            pyslurm_version = str(getattr(pyslurm, "__version__", "") or "unknown")
        except ImportError:
            pass
        try:
            slurm_version = SlurmClient(env=env, wrap=wrap, timeout=timeout).version()
        except HpctError:
            pass
    choice = choose_backend(prefer, slurm_version, pyslurm_version)
    if choice.name == "pyslurm":
        return PyslurmClient(pyslurm, env=env, wrap=wrap, timeout=timeout, backend=choice)
    return SlurmClient(env=env, wrap=wrap, timeout=timeout, backend=choice)
