"""The fence (hooks/fence.py, issue 45): gloo's listener is unauthenticated, so the Prolog
installs nftables rules that admit to a node's ephemeral ports only the allocation's
addresses, and on loopback only root's and the job user's connections; the Epilog removes
exactly that job's rules. Here on real nftables, in network namespaces this test creates:
node A (the fenced node), a peer in the allocation, an outsider; seconds, no cluster."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpct_slurm.errors import HpctError
from hpct_slurm.events import EventLog, read_events
from hpct_slurm.hooks import fence as F
from hpct_slurm.hooks.context import JobContext

NFT = shutil.which("nft", path=F._PATH)
TAG = f"hf{os.getpid() % 100000}"
JOB_UID = 4242
needs_nft = pytest.mark.skipif(NFT is None or os.geteuid() != 0,
                               reason="needs root and nft (scripts/setup.sh installs nftables)")


# ---- pure: the script, the settings -----------------------------------------------------
def test_the_script_installs_a_job_and_keeps_the_others():
    text = F.script({7: (1000, ["10.0.0.1/32", "10.0.0.2/32"])},
                    [(32768, 60999), (20000, 28191), (28000, 32767)], keep={5})
    assert "add rule inet hpct_fence job_7_in ip saddr { 10.0.0.1/32, 10.0.0.2/32 } accept" in text
    job_7_out = [ln.split(" ", 5)[-1] for ln in text.splitlines()
                 if ln.startswith("add rule inet hpct_fence job_7_out ")]
    assert job_7_out == ["tcp flags & (syn | ack) == syn | ack ct mark != 1000 return",
                         "meta skuid 1000 ct mark set 1000 accept", "meta skuid 0 accept"]
    assert "job_5_in" in text and "flush chain inet hpct_fence job_5_in" not in text  # kept
    def rules(chain):
        return [ln.split(" ", 5)[-1] for ln in text.splitlines()
                if ln.startswith(f"add rule inet hpct_fence {chain} ")]
    for chain, side in (("input", "in"), ("output", "out")):  # each job's, then the refusal
        assert rules(chain)[-4:] == [
            "tcp dport != { 20000-60999 } accept", f"jump job_5_{side}", f"jump job_7_{side}",
            "counter reject with tcp reset"]
    # a listener's SYN-ACK on loopback goes to the owner check before anything accepts it
    assert rules("output")[:4] == [
        "oif != lo accept", "meta l4proto != tcp accept",
        "tcp flags & (syn | ack) == syn | ack tcp sport { 20000-60999 } jump answer",
        "ct state { established, related } accept"]
    assert rules("answer") == ["ct state untracked accept", "meta skuid 0 accept",
                               "ct mark 0 accept", "jump job_5_out", "jump job_7_out",
                               "counter reject with tcp reset"]


def test_the_last_jobs_removal_deletes_the_table():
    assert F.script({7: None}, [(32768, 60999)], keep=()).splitlines()[-1] == \
        "delete table inet hpct_fence"
    text = F.script({7: None}, [(32768, 60999), (20000, 28191)], keep={5})
    assert "tcp dport != { 20000-28191, 32768-60999 } accept" in text
    assert "delete chain inet hpct_fence job_7_in" in text and "delete table" not in text
    assert "jump job_7_in" not in text and "jump job_5_in" in text


def test_settings_and_slurm_answers_are_checked():
    assert F.parse_allow(" 10.1.0.0/16, 192.168.3.4 ,") == ("10.1.0.0/16", "192.168.3.4/32")
    with pytest.raises(HpctError, match=r"HPCT_FENCE_ALLOW entry '10.0.0.1; flush ruleset'"):
        F.parse_allow("10.0.0.1; flush ruleset")
    conf = "SlurmctldAddr = (null)\nSlurmctldHost[0] = ctl(10.9.0.1)\nSlurmctldHost[1] = b\n"
    assert F.controller_hosts(conf) == ["10.9.0.1", "b"]
    with pytest.raises(HpctError, match="not a port range"):
        F.port_range("60999 32768")


def test_a_fence_it_cannot_make_never_fails_the_prolog(tmp_path):
    log = EventLog(tmp_path / "hooks.jsonl")
    job = JobContext(job_id=9, uid=JOB_UID, gid=JOB_UID, node="n1", nodelist="n[1-2]")

    def unresolvable(name):
        raise HpctError(f"node name {name!r} does not resolve")
    fence = F.Fence("/nonexistent/nft")
    assert not F.install(job, job.nodelist, F.FenceConfig("nft"), log, lambda: [],
                         unresolvable, fence)
    assert not F.install(job, job.nodelist, F.FenceConfig("off"), log, lambda: [],
                         unresolvable, fence)  # off: nothing tried, nothing logged
    # names that resolve, but no nft where it was looked for
    assert not F.install(job, job.nodelist, F.FenceConfig("nft"), log, lambda: [],
                         lambda name: "10.0.0.1", fence)
    assert not F.remove(job, F.FenceConfig("nft"), log, fence)  # the Epilog neither
    skipped = list(read_events(tmp_path / "hooks.jsonl"))
    assert [e["event"] for e in skipped] == ["hook_fence_skipped"] * 3
    assert "'n1' does not resolve" in skipped[0]["error"]
    assert "/nonexistent/nft" in skipped[1]["error"] and "/nonexistent/nft" in skipped[2]["error"]


# ---- real: nftables in namespaces of this test ------------------------------------------
def _ns(name: str) -> list[str]:
    return ["nsenter", f"--net=/run/netns/{TAG}{name}", "--"]


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True)


@pytest.fixture
def nets():
    """Node A with two links: to a peer P (in the allocation, 10.78.2.2) and to an outsider
    O (10.78.1.2); listeners in A on an ephemeral port, on one of the rendezvous range
    (2000-2100 here: a TCPStore's) and on a fixed port outside both."""
    names = [f"{TAG}{n}" for n in ("a", "p", "o")]
    for n in names:
        _ip("netns", "add", n)
    try:
        for peer, net in (("o", 1), ("p", 2)):
            _ip("link", "add", f"{TAG}a{peer}", "netns", f"{TAG}a", "type", "veth", "peer",
                "name", f"{TAG}{peer}a", "netns", f"{TAG}{peer}")
            _ip("-n", f"{TAG}a", "addr", "add", f"10.78.{net}.1/24", "dev", f"{TAG}a{peer}")
            _ip("-n", f"{TAG}{peer}", "addr", "add", f"10.78.{net}.2/24", "dev", f"{TAG}{peer}a")
            _ip("-n", f"{TAG}a", "link", "set", f"{TAG}a{peer}", "up")
            _ip("-n", f"{TAG}{peer}", "link", "set", f"{TAG}{peer}a", "up")
        for n in names:
            _ip("-n", n, "link", "set", "lo", "up")
        server = subprocess.Popen(
            [*_ns("a"), sys.executable, "-c", _SERVE], stdout=subprocess.PIPE, text=True)
        ports = json.loads(server.stdout.readline())
        yield ports
        server.kill()
        server.wait()
    finally:
        for n in names:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


_SERVE = """
import json, socket, threading
def serve(s):
    while True:
        c, _ = s.accept(); c.close()
ports = {}
for name, port in (("ephemeral", 0), ("store", 2050), ("fixed", 2222)):
    s = socket.socket(); s.bind(("0.0.0.0", port)); s.listen(64)
    ports[name] = s.getsockname()[1]
    threading.Thread(target=serve, args=(s,), daemon=True).start()
print(json.dumps(ports), flush=True)
threading.Event().wait()
"""


def _connect(ns: str, addr: str, port: int, uid: int = 0, timeout: float = 5) -> str:
    who = [] if uid == 0 else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    code = (f"import socket\ntry:\n socket.create_connection(({addr!r}, {port}), {timeout})"
            f".close()"
            f"; print('ok')\nexcept OSError as e:\n print(type(e).__name__)")
    return subprocess.run([*_ns(ns), *who, sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=30).stdout.strip()


def _fence() -> F.Fence:
    def run(argv, stdin):
        return subprocess.run([*_ns("a"), *argv], input=stdin, capture_output=True,
                              text=True, timeout=20)
    return F.Fence(NFT, run=run, lock=Path(f"/tmp/{TAG}.lock"), also=[(2000, 2100)])


def _ruleset() -> str:
    return subprocess.run([*_ns("a"), NFT, "list", "ruleset"], capture_output=True,
                          text=True).stdout


@needs_nft
def test_the_fence_admits_the_allocation_and_refuses_strangers(nets, tmp_path):
    eph, fixed = nets["ephemeral"], nets["fixed"]
    # unfenced: everyone gets in (what issue 45 measured)
    assert _connect("o", "10.78.1.1", eph) == "ok"
    assert _connect("a", "127.0.0.1", eph, uid=65534) == "ok"

    log = EventLog(tmp_path / "hooks.jsonl")
    job = JobContext(job_id=31, uid=JOB_UID, gid=JOB_UID, node="nA", nodelist="nA,nP")
    where = {"nA": "10.78.2.1", "nP": "10.78.2.2", "ctld": "10.78.9.9"}
    assert F.install(job, job.nodelist, F.FenceConfig("nft"), log, lambda: ["ctld"],
                     where.__getitem__, _fence())
    assert _connect("p", "10.78.2.1", eph) == "ok"  # the allocation's peer
    assert _connect("o", "10.78.1.1", eph) == "ConnectionRefusedError"  # a stranger host
    assert _connect("o", "10.78.1.1", nets["store"]) == "ConnectionRefusedError"
    assert _connect("p", "10.78.2.1", nets["store"]) == "ok"
    assert _connect("a", "127.0.0.1", nets["store"], uid=65534) == "ConnectionRefusedError"
    assert _connect("o", "10.78.1.1", fixed) == "ok"  # fixed-port services untouched
    assert _connect("a", "127.0.0.1", eph, uid=JOB_UID) == "ok"  # the job's user
    assert _connect("a", "10.78.2.1", eph, uid=JOB_UID) == "ok"  # via its own address
    assert _connect("a", "127.0.0.1", eph, uid=65534) == "ConnectionRefusedError"
    assert _connect("a", "10.78.1.1", eph, uid=65534) == "ConnectionRefusedError"
    assert _connect("a", "127.0.0.1", eph) == "ok"  # root

    # a second job of another user on the node: its peer (the outsider's address) gets in,
    # the first job's admissions stand
    other = JobContext(job_id=32, uid=65534, gid=65534, node="nA", nodelist="nO")
    assert F.install(other, other.nodelist, F.FenceConfig("nft", allow="10.78.3.0/24"), log,
                     lambda: [], {"nO": "10.78.1.2"}.__getitem__, _fence())
    assert _connect("o", "10.78.1.1", eph) == "ok"
    assert _connect("a", "127.0.0.1", eph, uid=65534) == "ok"
    # job 32's node crashed (no Epilog): the next Prolog sweeps what Slurm no longer runs
    third = JobContext(job_id=33, uid=JOB_UID, gid=JOB_UID, node="nA", nodelist="nA")
    assert F.install(third, third.nodelist, F.FenceConfig("nft"), log, lambda: [],
                     where.__getitem__, _fence(), active=lambda: {31, 33})
    assert _connect("o", "10.78.1.1", eph) == "ConnectionRefusedError"
    assert _fence().jobs() == {31, 33}
    assert not F.remove(other, F.FenceConfig("nft"), log, _fence())  # swept already
    assert F.remove(third, F.FenceConfig("nft"), log, _fence())
    assert _connect("p", "10.78.2.1", eph) == "ok"

    assert F.remove(job, F.FenceConfig("nft"), log, _fence())
    assert _ruleset().strip() == ""  # no rule, no table left behind
    assert _connect("o", "10.78.1.1", eph) == "ok"
    assert not F.remove(job, F.FenceConfig("nft"), log, _fence())  # twice: nothing to do
    events = list(read_events(tmp_path / "hooks.jsonl"))
    installed = [e for e in events if e["event"] == "hook_fence_installed"]
    assert installed[0]["admitted"] == ["10.78.2.1/32", "10.78.2.2/32", "10.78.9.9/32"]
    assert installed[0]["uids"] == [0, JOB_UID] and installed[1]["jobs"] == [31, 32]
    assert installed[0]["ports"][0] == "2000-2100" and len(installed[0]["ports"]) == 2
    assert installed[2]["swept"] == [32] and installed[2]["jobs"] == [31, 33]
    removed = [e for e in events if e["event"] == "hook_fence_removed"]
    assert [(e["job_id"], e["found"], e["jobs"]) for e in removed] == [
        (32, False, [31, 33]), (33, True, [31]), (31, True, []), (31, False, [])]


@needs_nft
def test_a_site_notrack_rule_does_not_open_the_fence(nets, tmp_path):
    """Sites exempt fabric and storage ports from conntrack (`notrack`): such a packet's
    state is `untracked`, neither new nor established, and must meet the job's rules."""
    eph = nets["ephemeral"]
    subprocess.run([*_ns("a"), NFT, "-f", "-"], check=True, capture_output=True, text=True,
                   input="add table inet site\n"
                         "add chain inet site raw { type filter hook prerouting priority raw; }\n"
                         f"add rule inet site raw tcp dport {eph} notrack\n")
    log = EventLog(tmp_path / "hooks.jsonl")
    job = JobContext(job_id=41, uid=JOB_UID, gid=JOB_UID, node="nA", nodelist="nA,nP")
    where = {"nA": "10.78.2.1", "nP": "10.78.2.2"}
    assert F.install(job, job.nodelist, F.FenceConfig("nft"), log, lambda: [],
                     where.__getitem__, _fence())
    assert _connect("o", "10.78.1.1", eph) == "ConnectionRefusedError"
    assert _connect("p", "10.78.2.1", eph) == "ok"
    assert F.remove(job, F.FenceConfig("nft"), log, _fence())


_LISTEN = """
import socket
s = socket.socket(); s.bind(("0.0.0.0", 0)); s.listen(64)
print(s.getsockname()[1], flush=True)
while True:
    s.accept()[0].close()
"""


@needs_nft
def test_on_a_shared_node_a_users_ports_admit_that_user_and_root_only(nets, tmp_path):
    """Jobs of two users on one node: each user's listeners (gloo's, a TCPStore's) take
    local connections from that user and root only, not from the other job's user; root's
    listeners from both."""
    other = 65534
    listeners = {}
    try:
        for uid in (JOB_UID, other):
            listeners[uid] = subprocess.Popen(
                [*_ns("a"), "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                 sys.executable, "-c", _LISTEN], stdout=subprocess.PIPE, text=True, cwd="/")
        mine, theirs = (int(listeners[u].stdout.readline()) for u in (JOB_UID, other))
        log = EventLog(tmp_path / "hooks.jsonl")
        for job, uid in ((51, JOB_UID), (52, other)):
            ctx = JobContext(job_id=job, uid=uid, gid=uid, node="nA", nodelist="nA")
            assert F.install(ctx, ctx.nodelist, F.FenceConfig("nft"), log, lambda: [],
                             {"nA": "10.78.2.1"}.__getitem__, _fence())
        for addr in ("127.0.0.1", "10.78.2.1"):  # loopback, and the node's own address
            assert _connect("a", addr, mine, uid=JOB_UID) == "ok"
            assert _connect("a", addr, theirs, uid=other) == "ok"
            assert _connect("a", addr, mine, uid=other, timeout=2) == "TimeoutError"
            assert _connect("a", addr, theirs, uid=JOB_UID, timeout=2) == "TimeoutError"
            assert _connect("a", addr, mine) == "ok"  # root
            assert _connect("a", addr, nets["ephemeral"], uid=other) == "ok"  # root's
        assert F.remove(JobContext(job_id=52, uid=other, gid=other, node="nA"),
                        F.FenceConfig("nft"), log, _fence())
        assert _connect("a", "127.0.0.1", mine, uid=other) == "ConnectionRefusedError"
        assert _connect("a", "127.0.0.1", mine, uid=JOB_UID) == "ok"
        assert F.remove(JobContext(job_id=51, uid=JOB_UID, gid=JOB_UID, node="nA"),
                        F.FenceConfig("nft"), log, _fence())
    finally:
        for p in listeners.values():
            p.kill()
            p.wait()
