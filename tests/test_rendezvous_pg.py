"""Form a gloo group over the rootless store, lose a rank to SIGKILL, re-form with a warm spare.

Each process plays one node (one task per node, all on loopback), runs that node's shard
server, and takes commands from the test, which plays the controller. Each worker has its own
pipe: a process SIGKILLed while holding a shared multiprocessing.Queue's lock would silence
every other writer.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import socket
import subprocess
import threading
import traceback
from multiprocessing.connection import Connection, wait

import pytest

JOB_NODES = ["n0", "n1", "n2", "n3", "s0"]
TIMEOUT_S = 60


def _node_environ(job_id: int, node: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": ",".join(JOB_NODES),
            "SLURMD_NODENAME": node, "SLURM_STEP_NODELIST": node, "SLURM_PROCID": "0",
            "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "1",
            "SLURM_TASKS_PER_NODE": "1"}


def _worker(node: str, job_id: int, secret_file: str, lazy: str, conn: Connection) -> None:
    os.environ["HPCT_GLOO_LAZY_INIT"] = lazy  # read when the group's env is derived
    # Imported here so the spare is "warm" (torch loaded) before it is given a rank.
    import torch
    import torch.distributed as dist

    from hpct_slurm.rendezvous import pg
    from hpct_slurm.rendezvous.derive import derive
    from hpct_slurm.rendezvous.store import load_secret, make_store, serve_shard
    from hpct_slurm.slurm.env import SlurmEnv

    torch.set_num_threads(1)
    env = SlurmEnv.from_environ(_node_environ(job_id, node))
    secret = load_secret(secret_file)
    conn.send((node, "ready", None))
    while True:
        cmd, *args = conn.recv()
        if cmd == "exit":
            pg.teardown()
            conn.send((node, "exited", None))
            return
        try:
            if cmd == "form":
                generation, members = args
                info = derive(env, generation, members, tasks_per_node=1,
                              resolve=lambda name: "127.0.0.1")
                shard = serve_shard(info, secret) if info.local_rank == 0 else None
                store = make_store("rootless", info, secret)
                pg.init(info, store, "gloo", shard=shard)
                conn.send((node, "formed", (info.rank, info.world_size, dist.get_rank())))
            elif cmd == "allreduce":
                # Node-specific values: the sum shows which nodes took part.
                t = torch.full((1000,), float(JOB_NODES.index(node) + 1))
                dist.all_reduce(t)
                conn.send((node, "sum", float(t[0])))
            elif cmd == "other_collectives":
                # What a job does besides its gradient allreduce: an HSDP mesh's sub-group
                # (made after init, through the group's store), a barrier, a broadcast; with
                # lazy pairs each first use connects new pairs through the store.
                sub = dist.new_group([0, 1])
                t = torch.full((4,), float(dist.get_rank() + 1))
                if dist.get_rank() in (0, 1):
                    dist.all_reduce(t, group=sub)
                dist.barrier()
                b = torch.full((4,), float(dist.get_rank()))
                dist.broadcast(b, src=dist.get_world_size() - 1)
                conn.send((node, "others", (float(t[0]), float(b[0]),
                                            os.environ["TORCH_GLOO_LAZY_INIT"])))
            elif cmd == "allreduce_until_failure":
                failure = None
                steps = 0
                while failure is None:
                    t = torch.full((1000,), float(dist.get_rank() + 1))
                    try:
                        dist.all_reduce(t)
                    except RuntimeError as exc:
                        failure = type(exc).__name__
                    else:
                        steps += 1
                        if steps == 20:
                            conn.send((node, "looping", None))
                # Outside the except block, as pg.teardown() requires.
                pg.teardown()
                conn.send((node, "torn_down", (failure, steps)))
        except Exception:
            conn.send((node, "error", traceback.format_exc()))


def _start_nodes(tmp_path, worker, nodes: list[str]) -> tuple[dict, dict]:
    """One spawned process per node running `worker(node, job_id, secret_file, conn)`, with
    a pipe each: the test's ends and the processes."""
    from hpct_slurm.rendezvous.store import write_secret

    secret_file = tmp_path / "secret"
    write_secret(secret_file)
    job_id = random.randrange(1000, 1_000_000)
    ctx = mp.get_context("spawn")
    pipes = {n: ctx.Pipe() for n in nodes}
    procs = {n: ctx.Process(target=worker, daemon=True,
                            args=(n, job_id, str(secret_file), pipes[n][1])) for n in nodes}
    for p in procs.values():
        p.start()
    return {n: pipes[n][0] for n in nodes}, procs


def _collect(conns: dict[str, Connection], nodes: list[str], what: str) -> dict[str, object]:
    got: dict[str, object] = {}
    while len(got) < len(nodes):
        ready = wait([conns[n] for n in nodes if n not in got], timeout=TIMEOUT_S)
        if not ready:
            pytest.fail(f"timed out waiting for {what} from {sorted(set(nodes) - set(got))}")
        for c in ready:
            node, kind, value = c.recv()
            if kind == "error":
                pytest.fail(f"{node} failed:\n{value}")
            assert kind == what, (node, kind, value)
            got[node] = value
    return got


@pytest.mark.parametrize("lazy", ["1", "0"], ids=["lazy_pairs", "full_mesh"])
def test_kill_one_rank_and_reform_with_warm_spare(tmp_path, lazy):
    from hpct_slurm.rendezvous.store import write_secret

    secret_file = tmp_path / "secret"
    write_secret(secret_file)
    job_id = random.randrange(1000, 1_000_000)
    ctx = mp.get_context("spawn")
    pipes = {n: ctx.Pipe() for n in JOB_NODES}
    conns = {n: pipes[n][0] for n in JOB_NODES}
    procs = {n: ctx.Process(target=_worker, args=(n, job_id, str(secret_file), lazy, pipes[n][1]),
                            daemon=True) for n in JOB_NODES}
    for p in procs.values():
        p.start()
    try:
        _collect(conns, JOB_NODES, "ready")

        gen0 = ["n0", "n1", "n2", "n3"]
        for n in gen0:
            conns[n].send(("form", 0, gen0))
        formed = _collect(conns, gen0, "formed")
        assert formed == {n: (i, 4, i) for i, n in enumerate(gen0)}
        for n in gen0:
            conns[n].send(("allreduce",))
        assert _collect(conns, gen0, "sum") == {n: 1.0 + 2 + 3 + 4 for n in gen0}

        for n in gen0:
            conns[n].send(("allreduce_until_failure",))
        _collect(conns, gen0, "looping")
        os.kill(procs["n2"].pid, signal.SIGKILL)
        procs["n2"].join(timeout=TIMEOUT_S)
        survivors = ["n0", "n1", "n3"]
        torn = _collect(conns, survivors, "torn_down")
        assert all(failure == "RuntimeError" and steps >= 20
                   for failure, steps in torn.values()), torn

        gen1 = ["n0", "n1", "s0", "n3"]
        for n in gen1:
            conns[n].send(("form", 1, gen1))
        formed = _collect(conns, gen1, "formed")
        assert formed == {n: (i, 4, i) for i, n in enumerate(gen1)}
        for n in gen1:
            conns[n].send(("allreduce",))
        assert _collect(conns, gen1, "sum") == {n: 1.0 + 2 + 5 + 4 for n in gen1}
        for n in gen1:
            conns[n].send(("other_collectives",))
        others = _collect(conns, gen1, "others")
        assert others == {"n0": (3.0, 3.0, lazy), "n1": (3.0, 3.0, lazy),
                          "s0": (3.0, 3.0, lazy), "n3": (4.0, 3.0, lazy)}, others

        for n in gen1:
            conns[n].send(("exit",))
        _collect(conns, gen1, "exited")
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


COLLECTIVE_S = 5.0
# A survivor stuck on its first connect to the dead peer waited 5 x the init timeout (600 s);
# pg.init now bounds it by the collective timeout. Generous for a loaded machine, far below
# the old wait.
SURVIVOR_BOUND_S = 40


def _listening_ports() -> set[int]:
    """This process's listening IPv4 TCP ports (its shard server's and gloo's)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    with open("/proc/self/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return {int(r[1].split(":")[1], 16) for r in rows if r[3] == "0A" and r[9] in inodes}


def _first_connect_worker(node: str, job_id: int, secret_file: str, conn: Connection) -> None:
    os.environ["HPCT_GLOO_LAZY_INIT"] = "1"
    import datetime
    import faulthandler
    import time

    import torch
    import torch.distributed as dist

    from hpct_slurm.rendezvous import pg
    from hpct_slurm.rendezvous.derive import derive
    from hpct_slurm.rendezvous.store import load_secret, make_store, serve_shard
    from hpct_slurm.slurm.env import SlurmEnv

    torch.set_num_threads(1)
    nodes = JOB_NODES[:4]
    env = SlurmEnv.from_environ(_node_environ(job_id, node))
    info = derive(env, 0, nodes, tasks_per_node=1, resolve=lambda name: "127.0.0.1",
                  init_timeout_s=600, collective_timeout_s=COLLECTIVE_S)
    secret = load_secret(secret_file)
    shard = serve_shard(info, secret)
    store = make_store("rootless", info, secret)
    pg.init(info, store, "gloo", shard=shard,
            init_timeout=datetime.timedelta(seconds=600),
            collective_timeout=datetime.timedelta(seconds=COLLECTIVE_S))
    dist.all_reduce(torch.ones(1000))  # connects the ring's pairs only
    gloo_ports = _listening_ports() - {shard.address[1]}
    conn.send((node, "formed", (os.environ["TORCH_GLOO_LAZY_INIT"], sorted(gloo_ports))))
    _, root = conn.recv()  # the victim is dead: the root's pair to it never connected
    faulthandler.dump_traceback_later(SURVIVOR_BOUND_S - 5, exit=False)  # a hang's stack
    failure = None
    try:
        dist.broadcast(torch.ones(1000), src=root)
    except RuntimeError as exc:
        failure = str(exc).splitlines()[0][-120:]
    t0 = time.monotonic()
    pg.teardown()
    conn.send((node, "torn_down", (failure, time.monotonic() - t0)))
    faulthandler.cancel_dump_traceback_later()


def test_lazy_first_connect_to_a_dead_peer_fails_within_the_collective_timeout(tmp_path):
    """Lazy pairs, 4 ranks: after a ring allreduce, ranks 0 and 2 (and 1 and 3) have no pair
    yet. One of 0/2 is SIGKILLed; the other broadcasts, and must connect to it first. gloo
    makes the side with the lower port (in network byte order) listen, and a listening side
    waited out 5 x the init timeout (50 min) for a dead peer: the root chosen here is the
    listening one. It must fail, and every survivor get through its teardown, long before."""
    import socket
    import time

    nodes = JOB_NODES[:4]
    conns, procs = _start_nodes(tmp_path, _first_connect_worker, nodes)
    try:
        formed = _collect(conns, nodes, "formed")
        assert all(lazy == "1" and len(ports) == 1 for lazy, ports in formed.values()), formed
        # gloo's tcp Device::isInitiator: the side whose port compares lower listens
        order = sorted(["n0", "n2"], key=lambda n: socket.htons(formed[n][1][0]))
        root, victim = order[0], order[1]
        os.kill(procs[victim].pid, signal.SIGKILL)
        procs[victim].join(timeout=TIMEOUT_S)
        survivors = [n for n in nodes if n != victim]
        t0 = time.monotonic()
        for n in survivors:
            conns[n].send(("go", nodes.index(root)))
        got: dict[str, object] = {}
        while len(got) < len(survivors):
            left = SURVIVOR_BOUND_S - (time.monotonic() - t0)
            ready = wait([conns[n] for n in survivors if n not in got], timeout=max(left, 0))
            if not ready:
                pytest.fail(f"{sorted(set(survivors) - set(got))} still stuck "
                            f"{SURVIVOR_BOUND_S} s after the peer died (got {got})")
            for c in ready:
                node, kind, value = c.recv()
                assert kind == "torn_down", (node, kind, value)
                got[node] = value
        # the root listened for the dead peer and gave up (not a refused connect)
        assert "Connect timeout" in (got[root][0] or ""), got
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


def _slurm_task(environ: dict[str, str], conn: Connection) -> None:
    """One task of a plain `srun -n2` on one node, as the lead's Slurm test runs it."""
    os.environ.update(environ)
    try:
        import torch
        import torch.distributed as dist

        from hpct_slurm.errors import HpctError
        from hpct_slurm.rendezvous import init_from_slurm, pg

        info = init_from_slurm(generation=0, backend="gloo")
        t = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(t)
        guarded = False
        try:
            raise RuntimeError("a collective failed")
        except RuntimeError:
            try:
                pg.teardown()
            except HpctError:
                guarded = True
        still_formed = dist.is_initialized()
        pg.teardown()
        conn.send((info.rank, info.world_size, os.environ["RANK"], float(t[0]), guarded,
                   still_formed, dist.is_initialized()))
    except Exception:
        conn.send(traceback.format_exc())


def test_init_from_slurm_two_tasks_on_one_node(tmp_path):
    from hpct_slurm.rendezvous.store import write_secret

    secret_file = tmp_path / "secret"
    write_secret(secret_file)
    base = {"SLURM_JOB_ID": str(random.randrange(1000, 1_000_000)),
            "SLURM_JOB_NODELIST": "localhost", "SLURMD_NODENAME": "localhost",
            "SLURM_STEP_NODELIST": "localhost", "SLURM_NODEID": "0", "SLURM_NTASKS": "2",
            "SLURM_TASKS_PER_NODE": "2", "HPCT_SECRET_FILE": str(secret_file)}
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_slurm_task, daemon=True, args=(
        dict(base, SLURM_PROCID=str(i), SLURM_LOCALID=str(i)), pipes[i][1])) for i in range(2)]
    for p in procs:
        p.start()
    try:
        results = []
        for parent, _ in pipes:
            assert parent.poll(TIMEOUT_S), "task did not report"
            results.append(parent.recv())
        assert all(isinstance(r, tuple) for r in results), results
        # rank, world, exported RANK, allreduce sum, teardown refused inside except,
        # group kept by that refusal, group gone after the real teardown
        assert results == [(i, 2, str(i), 3.0, True, True, False) for i in range(2)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


# the collective timeout of the dead-member formation test: its survivors wait 5 x this
FORM_COLLECTIVE_S = 2.0
# a network namespace (under /run/netns) the formation's workers enter first, where set
NETNS_ENV = "HPCT_TEST_NETNS"
NFT = "/usr/sbin/nft"


def _enter_test_netns() -> None:
    name = os.environ.get(NETNS_ENV)
    if not name:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET, before any socket is made
            raise OSError(ctypes.get_errno(), f"setns into {name}")
    finally:
        os.close(fd)


def _dies_after_its_address_worker(node: str, job_id: int, secret_file: str,
                                   conn: Connection) -> None:
    """Full mesh (no lazy pairs), 3 ranks: every rank reads every address (gloo's exchange,
    through the store), then the test kills one before any pair connects: the window of
    issue 30's flaky requeue, where survivors sat 5 x the init timeout in connectFullMesh."""
    _enter_test_netns()
    os.environ["HPCT_GLOO_LAZY_INIT"] = "0"
    import datetime
    import time

    from hpct_slurm.rendezvous import gather, pg
    from hpct_slurm.rendezvous.derive import derive
    from hpct_slurm.rendezvous.store import load_secret, make_store, serve_shard
    from hpct_slurm.slurm.env import SlurmEnv

    nodes = JOB_NODES[:3]
    info = derive(SlurmEnv.from_environ(_node_environ(job_id, node)), 0, nodes,
                  tasks_per_node=1, resolve=lambda name: "127.0.0.1", init_timeout_s=600,
                  collective_timeout_s=FORM_COLLECTIVE_S)
    secret = load_secret(secret_file)
    shard = serve_shard(info, secret)
    store = make_store("rootless", info, secret)
    fetch = gather.FormationStore._fetch

    def fetch_then_hold(self, *args):
        out = fetch(self, *args)
        conn.send((node, "fetched", sorted(_listening_ports() - {shard.address[1]})))
        if conn.recv() == "connect, then stop":  # the test has killed the victim: connect
            # the STOP the controller would send a moment later, on the thread that gets it
            timers.append(threading.Timer(0.5, lambda: woken.append(pg.wake_connecting())))
            timers[-1].start()
        return out

    woken: list[tuple[int, int]] = []
    timers: list[threading.Timer] = []
    gather.FormationStore._fetch = fetch_then_hold
    conn.send((node, "ready", None))
    conn.recv()
    t0 = time.monotonic()
    failure = None
    try:
        pg.init(info, store, "gloo", shard=shard,
                init_timeout=datetime.timedelta(seconds=600),
                collective_timeout=datetime.timedelta(seconds=FORM_COLLECTIVE_S))
    except RuntimeError as exc:
        failure = str(exc).splitlines()[0]
    seconds = time.monotonic() - t0
    # init can end while the wake call that ended it is still returning (it woke the pair,
    # then went on to look for connects to reset): wait for its count before reporting it
    for timer in timers:
        timer.join(timeout=30)
    pg.teardown()
    conn.send((node, "failed", (failure, seconds, woken)))


def _exchanged(conns: dict[str, Connection], nodes: list[str]) -> dict[str, object]:
    """Start the formation of `_dies_after_its_address_worker`s and hold it once every rank
    has read every address; each one's gloo listener port."""
    _collect(conns, nodes, "ready")
    for n in nodes:
        conns[n].send("go")
    ports = _collect(conns, nodes, "fetched")
    assert all(len(p) == 1 for p in ports.values()), ports
    return ports


@pytest.mark.parametrize("stop", [False, True], ids=["no-stop", "stop-wakes-pairs"])
def test_a_member_dead_after_the_address_exchange_fails_the_formation_within_the_collective_timeout(
        tmp_path, stop):
    """Without a STOP the survivors wait out gloo's connect timeout; with one (issue 30: a
    STOP must end the formation wherever it is), pg.wake_connecting ends it at once."""
    nodes = JOB_NODES[:3]
    conns, procs = _start_nodes(tmp_path, _dies_after_its_address_worker, nodes)
    try:
        ports = _exchanged(conns, nodes)
        # gloo's tcp Device::isInitiator: the side whose port compares lower listens. The
        # victim is the one both others listen for (a refused connect would fail fast).
        import socket
        victim = max(nodes, key=lambda n: socket.htons(ports[n][0]))
        os.kill(procs[victim].pid, signal.SIGKILL)
        procs[victim].join(timeout=TIMEOUT_S)
        survivors = [n for n in nodes if n != victim]
        for n in survivors:
            conns[n].send("connect, then stop" if stop else "connect")
        got = _collect(conns, survivors, "failed")
        if stop:
            # 0.5 s after the connect began the STOP woke every pair: each survivor's pair
            # for the dead member took its own wake-up call, and init ended (formed on a
            # closed socket or failed, either way at once); the caller then sees the STOP.
            # (and no connect of theirs was in flight to reset: they listen for the victim)
            assert all(woken == [(len(nodes) - 1, 0)] for _, _, woken in got.values()), got
            assert not any("Connect timeout" in (f or "") for f, _, _ in got.values()), got
            assert all(seconds < 0.5 + 3 for _, seconds, _ in got.values()), got
            return
        # Each survivor listened for the dead member and gave up after 5 x its pair's timeout
        # (the collective timeout). Before the fix: 5 x the init timeout (here 600 s: the
        # pipe wait above fails first).
        assert all("Connect timeout" in (f or "") for f, _, _ in got.values()), got
        assert all(seconds < 5 * FORM_COLLECTIVE_S + 10 for _, seconds, _ in got.values()), got
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


@pytest.fixture
def netns(monkeypatch):
    """A network namespace of this test's own (loopback only), which the workers enter."""
    name = f"hpct-synwake-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=30)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True,
                       capture_output=True, timeout=30)
        monkeypatch.setenv(NETNS_ENV, name)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def test_a_pair_whose_connects_the_network_drops_fails_the_formation_at_the_stop(
        tmp_path, netns):
    """Every member alive, the network dropping new connections to one rank's gloo listener
    (test_fence_cluster's broken pair, on loopback): the ranks that connect to it sit in
    gloo's connect loop, which the listener-side wake cannot reach, for 5 x the pair timeout.
    The STOP now resets each connect attempt in flight (gloo's first and its 3 retries), so
    their init ends at once."""
    nodes = JOB_NODES[:3]
    conns, procs = _start_nodes(tmp_path, _dies_after_its_address_worker, nodes)
    try:
        ports = _exchanged(conns, nodes)
        # gloo's tcp Device::isInitiator: the side whose port compares lower listens; the
        # other two both connect to this one
        target = min(nodes, key=lambda n: socket.htons(ports[n][0]))
        rules = ("add table inet hpcttest\n"
                 "add chain inet hpcttest input { type filter hook input priority 0; "
                 "policy accept; }\n"
                 f"add rule inet hpcttest input tcp dport {ports[target][0]} ct state new "
                 "drop\n")
        subprocess.run(["ip", "netns", "exec", netns, NFT, "-f", "-"], input=rules,
                       text=True, check=True, capture_output=True, timeout=30)
        for n in nodes:
            conns[n].send("connect, then stop")
        got = _collect(conns, nodes, "failed")
        resets = 0
        for node in nodes:
            failure, seconds, woken = got[node]
            if node == target:
                # (its own wake to its listener is dropped by the same rule: every rank here
                # has one address; the fence test's rule names the peer's): its listening
                # pairs wait out their timeout, 5 x 2 s
                assert "Connect timeout" in (failure or ""), got
                continue
            # a connector: ended at once, by its own reset or its peer's failure (which may
            # come before its wake returned: woken then empty); without the reset, 5 x 2 s
            assert failure and "Connect timeout" not in failure and seconds < 0.5 + 3, got
            resets += sum(r for _, r in woken)
        # the first attempt and gloo's 3 retries, each reset, on at least one connector
        assert 1 <= resets <= 8, got
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
