"""Choose how to reach Slurm: pyslurm where it truly matches the running Slurm, else the CLI.

pyslurm is compiled against one Slurm release and its version says which (`25.11.x` is for
Slurm 25.11). A mismatched build either fails to import or talks a wrong RPC layout, so it is
used only when it imports AND its major.minor equals the running Slurm's.

No pyslurm release on PyPI matches Slurm 22.05 (Debian 12's Slurm; PyPI has builds for 25.11
and for 17.x/18.x), so on the machines this project tests on `select_backend` always returns the
CLI client, and the pyslurm reads below are not exercised by the test suite.

`import pyslurm` is never the first thing done with it: the import calls Slurm's slurm_init(),
which *exits the process* (a fatal, no exception) when no slurm.conf is reachable, so an import
in a controller, a hook or a test worker could end it. `probe_pyslurm` imports it in a child
process first, with this process's environment and sys.path; only when that child printed a
version does this process import it.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
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
                   pyslurm_version: str | None, unusable: str | None = None) -> BackendChoice:
    """Pure decision: `pyslurm_version` is None when pyslurm does not import (`unusable` then
    says why, when known)."""
    if prefer not in PREFERENCES:
        raise HpctError(f"Slurm backend {prefer!r} is not one of {', '.join(PREFERENCES)}")
    if prefer == "cli":
        return BackendChoice("cli", "CLI backend requested")
    if pyslurm_version is None:
        why = unusable or "pyslurm does not import"
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


_PROBE = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); import pyslurm; "
          "print('hpct-pyslurm-version', getattr(pyslurm, '__version__', '') or 'unknown')")


def probe_pyslurm(timeout: float = 30.0) -> tuple[str | None, str]:
    """(pyslurm's version, or None, and why) from importing it in a child process with this
    process's environment and sys.path: what an import here would do, without the risk of
    slurm_init() ending this process. Nothing is imported here."""
    if "pyslurm" in sys.modules:  # imported already, so it did not end the process
        mod = sys.modules["pyslurm"]
        return str(getattr(mod, "__version__", "") or "unknown"), "imported already"
    try:
        if importlib.util.find_spec("pyslurm") is None:
            return None, "pyslurm is not installed"
    except (ImportError, ValueError) as e:
        return None, f"pyslurm cannot be found: {e}"
    try:
        p = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(sys.path)],
                           capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, f"importing pyslurm did not finish within {timeout:g} s"
    except OSError as e:
        return None, f"the pyslurm probe could not run: {e}"
    for line in p.stdout.splitlines():
        if p.returncode == 0 and line.startswith("hpct-pyslurm-version "):
            return line.split(" ", 1)[1].strip(), "imports"
    last = (p.stderr.strip().splitlines() or [""])[-1][:300]
    return None, (f"importing pyslurm ended the process (exit {p.returncode})"
                  + (f": {last}" if last else ""))


def select_backend(prefer: str = "auto", env: Mapping[str, str] | None = None,
                   wrap: Sequence[str] | None = None, timeout: float = 30.0) -> SlurmClient:
    """A client for this machine's Slurm; `client.backend.reason` says which and why.

    pyslurm is imported into this process only after `probe_pyslurm` imported it in a child,
    and only for a client of this process's own Slurm: pyslurm reads this process's SLURM_CONF
    and network namespace, so a client given another SLURM_CONF or a `wrap` stays on the CLI."""
    pyslurm, pyslurm_version, slurm_version = None, None, None
    why_not = None
    if prefer != "cli":
        own_conf = os.environ.get("SLURM_CONF")
        if wrap:
            why_not = "pyslurm cannot follow the client's wrap " + repr(" ".join(wrap))
        elif env is not None and "SLURM_CONF" in env and env["SLURM_CONF"] != own_conf:
            why_not = (f"pyslurm would read this process's Slurm config, not SLURM_CONF="
                       f"{env['SLURM_CONF']}")
        else:
            pyslurm_version, probed = probe_pyslurm(timeout)
            if pyslurm_version is None:
                why_not = probed
        try:
            slurm_version = SlurmClient(env=env, wrap=wrap, timeout=timeout).version()
        except HpctError:
            pass
    if why_not is not None:
        pyslurm_version = None
    choice = choose_backend(prefer, slurm_version, pyslurm_version, why_not)
    if choice.name == "pyslurm":
        try:
            pyslurm = importlib.import_module("pyslurm")
        except ImportError as e:  # the probe imported it: only a race gets here
            choice = choose_backend(prefer, slurm_version, None, f"pyslurm does not import: {e}")
            return SlurmClient(env=env, wrap=wrap, timeout=timeout, backend=choice)
        return PyslurmClient(pyslurm, env=env, wrap=wrap, timeout=timeout, backend=choice)
    return SlurmClient(env=env, wrap=wrap, timeout=timeout, backend=choice)
