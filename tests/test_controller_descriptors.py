"""Issue 45, item 2: the controller out of descriptors, with its event log a file (as in a real
job, where each record opens it).

The real Controller on the test's event loop with test_controller_fast.py's stand-ins (fake
Slurm, fake steps, ranks speaking the real protocol over loopback). This process's descriptor
table is filled up to its soft limit, lowered for the test: a stranger's connection then
waits in the controller's backlog (accept: EMFILE) while a rank falls silent (the watchdog's
`fault.detected` cannot open the log). The watchdog task died of that write and was never
restarted: a second silent rank went undetected; asyncio's own accept logged 28-37k
"out of system resource" records in 6 s.
"""
from __future__ import annotations

import asyncio
import errno
import json
import socket

from _descriptors import out_of_descriptors
from test_controller_fast import FakeCluster


def _records(c: FakeCluster) -> list[dict]:
    path = c.options.run_dir / "controller.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_out_of_descriptors_the_controller_keeps_accepting_and_its_watchdog_detecting(
        tmp_path):
    async def scenario():
        c = FakeCluster(tmp_path, ["localhost", "a1", "a2", "s1"], spares=1)
        # The round a1's loss starts waits on `scontrol show node` (fencing) until the
        # descriptors are back: the stand-ins (a step's secret file, the fake slurmd's own
        # asyncio server) would fail without them, and they are not what this test is about.
        c.show_node_delay_s = 1.5
        async with c:
            await c.started()
            await c.train(["localhost", "a1", "a2"], 2)
            stranger = socket.socket()  # its descriptor now: none will be left to make it
            stranger.setblocking(False)
            with out_of_descriptors():
                # the controller's accept fails with EMFILE ...
                assert stranger.connect_ex(c.ctl.address) in (0, errno.EINPROGRESS)
                # ... and so does the watchdog's record of a silent rank
                c.rank("a1").beating = False
                await c.until(lambda: "a1" in c.ctl.pending_faults or "a1" in c.ctl.dead_nodes,
                              "a1 found silent", timeout=6)
                await asyncio.sleep(0.2)
            # descriptors are back: the stranger is accepted (the controller's hello reaches it)
            loop = asyncio.get_running_loop()
            assert await asyncio.wait_for(loop.sock_recv(stranger, 64), 5)
            stranger.close()
            # and the watchdog still runs: a second rank falls silent and is found
            c.rank("a2").beating = False
            await c.until(lambda: any(r["event"] == "fault.detected" and r["node"] == "a2"
                                      and r["reason"].startswith("no heartbeat")
                                      for r in _records(c)),
                          "a2's silence in the log", timeout=6)
            records = _records(c)
            failed = [r for r in records if r["event"] == "controller.accept_failed"]
            assert len(failed) == 1 and "errno 24" in failed[0]["error"], failed
            assert [r["node"] for r in records if r["event"] == "fault.detected"][0] == "a1"
            late = [r for r in records if r["event"] == "event_log.delayed"]
            assert late and late[0]["dropped"] == 0 and late[0]["written_late"] >= 2
    asyncio.run(asyncio.wait_for(scenario(), 40))
