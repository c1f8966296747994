"""The control-message protocol: round trips, and every kind of bad frame is a clear ProtocolError."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import socket
import stat
import struct

import blake3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpct_slurm import protocol as P
from hpct_slurm.errors import HpctError

SECRET = bytes(range(32))
JOB = "4242"

ints = st.integers(min_value=-(2**62), max_value=2**62)
nat = st.integers(min_value=0, max_value=2**31)
text = st.text(max_size=40)
addr = st.tuples(text, st.integers(min_value=0, max_value=65535))

MESSAGES = st.one_of(
    st.builds(P.Register, job_id=text, node=text, local_rank=nat,
              role=st.sampled_from(["active", "spare"]), pid=nat, host_addr=text, transfer_port=nat),
    st.builds(P.Heartbeat, rank=nat, generation=nat, step=ints, state=text),
    st.builds(P.Stop, generation=nat, reason=text, lost_addrs=st.lists(text, max_size=3)),
    st.builds(P.Assign, generation=nat, rank=nat, world_size=nat, members=st.lists(text, max_size=5),
              tasks_per_node=nat, restore_step=ints,
              sources=st.dictionaries(nat, st.lists(addr, max_size=3), max_size=4)),
    st.builds(P.Resume, generation=nat, step=ints),
    st.builds(P.StepDone, rank=nat, generation=nat, step=ints),
    st.builds(P.Ack, ok=st.booleans(), detail=text),
    st.builds(P.Goodbye, reason=text),
    st.builds(P.FetchState, rank=nat, step=ints, slot=st.sampled_from(["own", "replica", "any"])),
    st.builds(P.StateBlob, rank=nat, step=ints, nbytes=nat, layout_nbytes=nat),
    st.builds(P.Holdings, rank=ints, generation=nat, mode=st.sampled_from(["jit", "replicated"]),
              rank_state=st.booleans(), own=st.lists(ints, max_size=3),
              rank_own=st.lists(ints, max_size=3),
              replicas=st.dictionaries(nat, st.lists(ints, max_size=3), max_size=3), error=text),
    st.builds(P.RelayHello, job_id=text, node=text, role=st.sampled_from(["active", "spare"]),
              pid=nat),
    st.builds(P.Left, reason=text),
    # a node relay's frame: messages whose fields are JSON values already (a tuple inside an
    # item would come back a list, like any message's nested tuples)
    st.builds(P.Batch.of, st.lists(st.tuples(nat, st.one_of(
        st.builds(P.Heartbeat, rank=nat, generation=nat, step=ints, state=text),
        st.builds(P.StepDone, rank=nat, generation=nat, step=ints),
        st.builds(P.Goodbye, reason=text))), max_size=4)),
)


def test_every_message_type_is_covered_by_the_strategy():
    seen = set()

    @given(MESSAGES)
    @settings(max_examples=1500, derandomize=True)  # 15 types: 200 draws missed one
    def collect(msg):
        seen.add(msg.TYPE)

    collect()
    assert seen == set(P.MESSAGE_TYPES)


@given(MESSAGES, st.binary(max_size=300), st.integers(min_value=0, max_value=2**63))
@settings(deadline=None)  # a loaded shared machine is no failure
def test_round_trip(msg, body, seq):
    env = P.decode_frame(P.encode(msg, SECRET, seq, JOB, body), SECRET, JOB)
    assert env.msg == msg and env.seq == seq and env.job_id == JOB and bytes(env.body) == body


@given(MESSAGES, st.data())
@settings(deadline=None)  # a loaded shared machine is no failure
def test_any_flipped_byte_is_rejected(msg, data):
    frame = bytearray(P.encode(msg, SECRET, 7, JOB, b"payload"))
    i = data.draw(st.integers(min_value=0, max_value=len(frame) - 1))
    frame[i] ^= data.draw(st.integers(min_value=1, max_value=255))
    with pytest.raises(P.ProtocolError):
        P.decode(bytes(frame), SECRET, JOB)


def test_wrong_secret_and_wrong_job_are_rejected():
    frame = P.encode(P.Stop(3, "node died"), SECRET, 1, JOB)
    with pytest.raises(P.ProtocolError, match="bad MAC"):
        P.decode(frame, b"x" * 32, JOB)
    with pytest.raises(P.ProtocolError, match="expected job '9999'"):
        P.decode(frame, SECRET, "9999")


@given(st.binary(max_size=200))
@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
def test_garbage_is_a_protocol_error_never_a_crash(junk):
    with pytest.raises(P.ProtocolError):
        P.decode(junk, SECRET, JOB)


@given(MESSAGES, st.data())
@settings(deadline=None)  # a loaded shared machine is no failure
def test_truncated_frames_are_rejected(msg, data):
    frame = P.encode(msg, SECRET, 1, JOB, b"abc")
    cut = data.draw(st.integers(min_value=0, max_value=len(frame) - 1))
    with pytest.raises(P.ProtocolError):
        P.decode(frame[:cut], SECRET, JOB)


def _forge(header: dict, body: bytes = b"", secret: bytes = SECRET) -> bytes:
    """A correctly MACed frame with an arbitrary header: checks validation, not authentication."""
    raw = json.dumps(header).encode()
    mac = hmac.new(secret, b"hpct2" + raw, hashlib.sha256).digest()
    return struct.pack(">I", len(raw)) + raw + mac + body


def _hdr(type_: str, fields: dict, **over) -> dict:
    return {"v": P.VERSION, "type": type_, "job": JOB, "seq": 1, "parts": [], "fields": fields, **over}


@pytest.mark.parametrize("header,reason", [
    (_hdr("explode", {}), "unknown message type 'explode'"),
    (_hdr("stop", {"generation": 1}), "missing field 'reason'"),
    (_hdr("stop", {"generation": "1", "reason": "x"}), "stop.generation must be an int"),
    (_hdr("stop", {"generation": True, "reason": "x"}), "stop.generation must be an int"),
    (_hdr("stop", {"generation": 1, "reason": "x", "evil": 1}), "unknown fields"),
    (_hdr("register", {"job_id": "j", "node": "n", "local_rank": 0, "role": "boss", "pid": 1,
                       "host_addr": "h", "transfer_port": 1}), "must be one of"),
    (_hdr("assign", {"generation": 1, "rank": 0, "world_size": 2, "members": ["a"],
                     "tasks_per_node": 1, "restore_step": 0, "sources": {"x": []}}), "is not an int"),
    (_hdr("assign", {"generation": 1, "rank": 0, "world_size": 2, "members": ["a"],
                     "tasks_per_node": 1, "restore_step": 0, "sources": {"0": [["h"]]}}), "2-item list"),
    (_hdr("assign", {"generation": 1, "rank": 0, "world_size": 2, "members": ["a"],
                     "tasks_per_node": 1, "restore_step": 0, "peers": {"1": ["h", "7"]}}),
     "assign.peers.*must be an int, got '7'"),
    (_hdr("stop", {"generation": 1, "reason": "x"}, v=1), "version"),
    # version 2 carried SHA-256 part digests: a peer of that release is told so by version
    (_hdr("stop", {"generation": 1, "reason": "x"}, v=2), "protocol version 2 is not 3"),
    (_hdr("stop", {"generation": 1, "reason": "x"}, parts=[[3, "ab"]]), "not \\[nbytes, digest hex\\]"),
    (_hdr("stop", {"generation": 1, "reason": "x"}, parts={"a": 1}), "'parts' must be a list"),
    (_hdr("stop", {"generation": 1, "reason": "x"}, seq=-1), "seq"),
    (_hdr("stop", {"generation": 1, "reason": "x"}, job=5), "'job' must be a string"),
    (_hdr("stop", [1, 2]), "'fields' must be an object"),
])
def test_ill_formed_headers_name_the_problem(header, reason):
    with pytest.raises(P.ProtocolError, match=reason):
        P.decode(_forge(header), SECRET)


def test_size_limits():
    too_long = struct.pack(">I", P.HEADER_MAX + 1) + b"x" * 10
    with pytest.raises(P.ProtocolError, match="outside 1"):
        P.decode(too_long, SECRET)
    frame = P.encode(P.Goodbye("bye"), SECRET, 1, JOB, b"x" * 100)
    with pytest.raises(P.ProtocolError, match="over the 50-byte limit"):
        P.decode(frame, SECRET, JOB, max_body=50)
    with pytest.raises(P.ProtocolError, match="over the"):
        P.encode(P.Goodbye("x" * (P.HEADER_MAX + 1)), SECRET, 1, JOB)
    with pytest.raises(P.ProtocolError, match="not a protocol message"):
        P.encode(object(), SECRET, 1, JOB)  # type: ignore[arg-type]


def test_not_json_header():
    raw = b"\xff{not json"
    mac = hmac.new(SECRET, b"hpct2" + raw, hashlib.sha256).digest()
    with pytest.raises(P.ProtocolError, match="not JSON"):
        P.decode(struct.pack(">I", len(raw)) + raw + mac, SECRET)


def _reference_digest(data: bytes) -> bytes:
    """The documented tree, written out independently of the implementation."""
    leaves = [blake3.blake3(b"\x00" + data[i:i + P.CHUNK]).digest()
              for i in range(0, len(data), P.CHUNK)]
    return blake3.blake3(b"\x01" + struct.pack(">QI", len(data), P.CHUNK)
                         + b"".join(leaves)).digest()


def test_part_digest_follows_the_documented_tree_serial_parallel_and_streamed():
    data = os.urandom(2 * P.CHUNK + 777)
    want = _reference_digest(data)
    assert P.part_digest(data) == want and P.part_digest(data, parallel=False) == want
    for inline in (False, True):  # leaves on the hash pool, or in this thread as they come
        streamed = P.PartHasher(len(data), inline=inline)
        for off in range(0, len(data), P.CHUNK):
            streamed.add(memoryview(data)[off:off + P.CHUNK])
        assert streamed.digest() == want
    assert P.part_digest(b"") == _reference_digest(b"") != P.part_digest(b"\0")
    # one more or one less byte of zeros changes the digest (the length is bound)
    assert P.part_digest(bytes(P.CHUNK)) != P.part_digest(bytes(P.CHUNK + 1))
    cancel = __import__("threading").Event()
    cancel.set()
    assert P.part_digest(data, parallel=False, cancel=cancel) is None


def test_an_inline_hasher_never_hands_a_leaf_to_the_pool(monkeypatch):
    import hpct_slurm.protocol.digest as D

    data = os.urandom(2 * P.CHUNK)
    monkeypatch.setattr(D, "hash_pool", lambda: pytest.fail("an inline hasher used the pool"))
    inline = P.PartHasher(len(data), inline=True)
    inline.add(memoryview(data)[:P.CHUNK])
    inline.add(memoryview(data)[P.CHUNK:])
    assert inline.digest() == _reference_digest(data)


def test_a_substituted_body_under_an_authentic_header_is_rejected():
    """The MAC covers only the header: the body is bound by the digest the header carries."""
    frame = bytearray(P.encode(P.Goodbye("x"), SECRET, 3, JOB, [b"layout", b"payload!"]))
    frame[-3] ^= 0x01  # same length, different body, header and MAC untouched
    with pytest.raises(P.DigestMismatch, match="body part 1 .* does not match its digest"):
        P.decode(bytes(frame), SECRET, JOB)
    env = P.decode_frame(P.encode(P.Goodbye("x"), SECRET, 3, JOB, [b"layout", b"payload!"]),
                         SECRET, JOB)
    assert env.digests == (P.part_digest(b"layout"), P.part_digest(b"payload!"))


def _tampered(data: bytes, how: str) -> bytes:
    """`data` (3 full leaves and a partial one) changed as a faulty or hostile sender would."""
    b = bytearray(data)
    if how.startswith("flip"):  # one byte in leaf i, somewhere inside it
        i = int(how[len("flip"):])
        b[i * P.CHUNK + (7919 * (i + 1)) % min(P.CHUNK, len(b) - i * P.CHUNK)] ^= 0x01
    elif how == "swap":  # leaves 0 and 1 trade places: every leaf digest still occurs once
        b[:P.CHUNK], b[P.CHUNK:2 * P.CHUNK] = data[P.CHUNK:2 * P.CHUNK], data[:P.CHUNK]
    elif how == "shorter":
        del b[-1]
    elif how == "longer":
        b += b"\0"
    elif how == "leaf_shorter":  # the cut falls on a leaf boundary: the leaves left are intact
        del b[3 * P.CHUNK:]
    return bytes(b)


TAMPERING = ["flip0", "flip1", "flip2", "flip3", "swap", "shorter", "longer", "leaf_shorter"]
_DATA = os.urandom(3 * P.CHUNK + 1000)


@pytest.mark.parametrize("how", TAMPERING)
def test_a_changed_body_under_the_original_digest_is_rejected_whole_and_streamed(how):
    """An authentic header carrying the original data's digest (a sender whose memory changed
    after its digest was sealed, or one lying about its body): whether a byte of any leaf
    flipped, two leaves swapped, or the body is a byte or a whole partial leaf shorter or
    longer (so the header's size is the wrong length for the digest), both receivers refuse."""
    want = P.part_digest(_DATA)
    bad = _tampered(_DATA, how)
    assert bad != _DATA and P.part_digest(bad) != want
    frame = P.encode(P.Goodbye(how), SECRET, 1, JOB, bad, digests=[want])
    with pytest.raises(P.DigestMismatch, match="body part 0"):
        P.decode(frame, SECRET, JOB, max_body=len(bad))
    a, b = socket.socketpair()
    with a, b:
        import threading
        t = threading.Thread(target=a.sendall, args=(frame,))
        t.start()
        with pytest.raises(P.DigestMismatch):
            P.recv_msg(b, SECRET, JOB, timeout=10, max_body=len(bad), context=b"")
        t.join()


def test_a_body_cut_short_in_flight_is_rejected_streamed():
    """The header (and its size) is the sender's; the connection ends a byte early."""
    frame = P.encode(P.Goodbye("x"), SECRET, 1, JOB, _DATA)
    a, b = socket.socketpair()
    with a, b:
        import threading
        def send_and_end():
            a.sendall(frame[:-1])
            a.shutdown(socket.SHUT_WR)

        t = threading.Thread(target=send_and_end)
        t.start()
        with pytest.raises(P.ProtocolError, match="truncated frame"):
            P.recv_msg(b, SECRET, JOB, timeout=10, max_body=len(_DATA), context=b"")
        t.join()


def test_range_digests_bind_leaf_order_and_length():
    leaves = P.leaf_digests(_DATA)
    n = len(_DATA)
    whole = P.range_digest(leaves, n, 0, n)
    assert whole == P.part_digest(_DATA)
    assert P.range_digest([leaves[1], leaves[0], *leaves[2:]], n, 0, n) != whole
    # the same leaves under another claimed length (a tail of zeros is not the same data)
    assert P.range_digest(leaves, n + 1, 0, n + 1) != whole


def test_known_digests_are_sent_not_recomputed_and_wrong_ones_caught():
    body = b"z" * 100
    good = P.encode(P.Goodbye("x"), SECRET, 1, JOB, body, digests=[P.part_digest(body)])
    assert P.decode_frame(good, SECRET, JOB).digests == (P.part_digest(body),)
    lying = P.encode(P.Goodbye("x"), SECRET, 1, JOB, body, digests=[P.part_digest(b"other")])
    with pytest.raises(P.DigestMismatch):
        P.decode(lying, SECRET, JOB)
    with pytest.raises(P.ProtocolError, match="1 digests given for 2 body parts"):
        P.encode(P.Goodbye("x"), SECRET, 1, JOB, [body, body], digests=[None])


def test_channel_rejects_replayed_sequence_numbers_and_other_connections_frames():
    nonce = os.urandom(P.NONCE_BYTES)
    tx, rx = P.Channel(SECRET, JOB, nonce, "client"), P.Channel(SECRET, JOB, nonce, "server")
    frame = tx.encode(P.Heartbeat(0, 1, 5, "train"))
    assert rx.decode(frame).msg == P.Heartbeat(0, 1, 5, "train")
    with pytest.raises(P.ProtocolError, match="replayed"):
        rx.decode(frame)
    later = P.Channel(SECRET, JOB, os.urandom(P.NONCE_BYTES), "server")
    with pytest.raises(P.ProtocolError, match="bad MAC"):
        later.decode(frame)
    with pytest.raises(P.ProtocolError, match="bad MAC"):  # reflected back at its sender
        tx.decode(frame)
    assert rx.decode(tx.encode(P.Goodbye("x"), b"body")).body == b"body"


# --- sockets ---------------------------------------------------------------------------------------

def test_socket_round_trip_with_large_body_into_caller_buffers():
    a, b = socket.socketpair()
    body = os.urandom(3 * P.CHUNK + 123)
    head, data = bytearray(10), bytearray(len(body) - 10)
    asked = []

    def sink(msg, sizes):
        asked.append(list(sizes))
        return [memoryview(head), memoryview(data)]

    with a, b:
        import threading
        t = threading.Thread(target=P.send_msg,
                             args=(a, P.StateBlob(1, 2, len(data), 10), SECRET, 5, JOB,
                                   [body[:10], memoryview(body)[10:]]),
                             kwargs={"context": b""})
        t.start()
        env = P.recv_msg(b, SECRET, JOB, timeout=10, max_body=len(body), body_sink=sink,
                         context=b"")
        t.join()
    assert env.msg == P.StateBlob(1, 2, len(data), 10) and asked == [[10, len(data)]]
    assert bytes(head) + bytes(data) == body
    assert env.digests[1] == _reference_digest(body[10:])


def test_socket_digest_mismatch_reads_the_whole_frame_and_keeps_the_stream_in_step():
    a, b = socket.socketpair()
    body = bytearray(os.urandom(2 * P.CHUNK + 5))
    frame = bytearray(P.encode(P.Goodbye("big"), SECRET, 1, JOB, bytes(body)))
    frame[-1] ^= 0xFF
    nxt = P.encode(P.Ack(True, "next"), SECRET, 2, JOB)
    with a, b:
        import threading
        t = threading.Thread(target=a.sendall, args=(bytes(frame) + nxt,))
        t.start()
        with pytest.raises(P.DigestMismatch) as info:
            P.recv_msg(b, SECRET, JOB, timeout=10, max_body=len(body), context=b"")
        assert info.value.msg == P.Goodbye("big")
        assert P.recv_msg(b, SECRET, JOB, timeout=10, context=b"").msg == P.Ack(True, "next")
        t.join()


def test_socket_bad_mac_is_refused_before_any_body_buffer_is_asked_for():
    a, b = socket.socketpair()
    frame = P.encode(P.StateBlob(0, 1, 4, 0), b"w" * 32, 1, JOB, [b"", b"data"])
    called = []
    with a, b:
        a.sendall(frame)
        with pytest.raises(P.ProtocolError, match="bad MAC"):
            P.recv_msg(b, SECRET, JOB, timeout=5, context=b"",
                       body_sink=lambda msg, sizes: called.append(sizes) or [])
    assert called == []


@given(st.binary(max_size=300))
@settings(max_examples=50, deadline=None)
def test_socket_garbage_then_close_raises_quickly(junk):
    a, b = socket.socketpair()
    with a, b:
        a.sendall(junk)
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(P.ProtocolError):
            P.recv_msg(b, SECRET, JOB, timeout=5, context=b"")


def test_socket_clean_close_and_timeout_are_distinguished():
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(P.ProtocolTimeout):
            P.recv_msg(b, SECRET, JOB, timeout=0.1, context=b"")
        a.close()
        with pytest.raises(P.ConnectionClosed):
            P.recv_msg(b, SECRET, JOB, timeout=5, context=b"")


def test_socket_truncated_body_is_reported():
    a, b = socket.socketpair()
    frame = P.encode(P.Goodbye("x"), SECRET, 1, JOB, b"y" * 1000)
    with a, b:
        a.sendall(frame[:500])
        a.close()
        with pytest.raises(P.ProtocolError, match="truncated frame"):
            P.recv_msg(b, SECRET, JOB, timeout=5, context=b"")


@given(MESSAGES)
@settings(max_examples=30, deadline=None)
def test_asyncio_round_trip(msg):
    async def main():
        got = []

        async def handle(reader, writer):
            got.append(await P.read_msg(reader, SECRET, JOB, context=b""))
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await P.write_msg(writer, msg, SECRET, 9, JOB, b"zz", context=b"")
        with pytest.raises(P.ConnectionClosed):
            await asyncio.wait_for(P.read_msg(reader, SECRET, JOB, context=b""), 5)
        writer.close()
        server.close()
        await server.wait_closed()
        return got[0]

    env = asyncio.run(main())
    assert env.msg == msg and env.seq == 9 and bytes(env.body) == b"zz"


def test_asyncio_truncated_frame():
    async def main():
        reader = asyncio.StreamReader()
        frame = P.encode(P.Stop(1, "r"), SECRET, 1, JOB)
        reader.feed_data(frame[:-5])
        reader.feed_eof()
        await P.read_msg(reader, SECRET, JOB, context=b"")

    with pytest.raises(P.ProtocolError, match="truncated frame"):
        asyncio.run(main())


# --- secret file -----------------------------------------------------------------------------------

def test_secret_file_is_private_and_round_trips(tmp_path):
    path = tmp_path / "secret"
    secret = P.new_secret_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(secret) == P.SECRET_BYTES and P.load_secret(path) == secret
    with pytest.raises(HpctError, match="already exists"):
        P.new_secret_file(path)


def test_load_secret_refuses_readable_or_bad_files(tmp_path):
    path = tmp_path / "secret"
    P.new_secret_file(path)
    os.chmod(path, 0o640)
    with pytest.raises(HpctError, match="mode 0640"):
        P.load_secret(path)
    bad = tmp_path / "bad"
    bad.write_text("not hex")
    os.chmod(bad, 0o600)
    with pytest.raises(HpctError, match="does not hold a hex secret"):
        P.load_secret(bad)
    with pytest.raises(HpctError, match="does not exist"):
        P.load_secret(tmp_path / "missing")


def test_assign_carries_the_peers_transfer_addresses():
    a = P.Assign(1, 2, 4, ["n1", "n2", "n3", "n4"], 1, 12, {0: [("10.0.0.1", 5)]}, [2], 4,
                 {0: ("10.0.0.1", 5), 3: ("10.0.0.4", 7)})
    assert P.decode(P.encode(a, SECRET, 1, JOB), SECRET, JOB) == a


# ---- a node relay's Batch (relay/node.py) ----------------------------------------------
def test_a_batch_carries_checked_messages_and_never_nests():
    pairs = [(0, P.Heartbeat(3, 1, 7, "ready")), (2, P.Holdings(5, 1, "jit", False, [6, 7], [],
                                                              {4: [7]}))]
    got = P.decode(P.encode(P.Batch.of(pairs), SECRET, 1, JOB), SECRET, JOB)
    assert got.messages() == pairs  # int keys and all, as if each came in a frame of its own
    for items, reason in (([[0, "batch", {"items": []}]], "a batch cannot be batched"),
                          ([[0, "relay_hello", {"job_id": JOB, "node": "n", "role": "active",
                                                "pid": 1}]], "a relay_hello cannot be batched"),
                          ([[-1, "goodbye", {"reason": "x"}]], "local rank -1 is negative"),
                          ([[0, "nope", {}]], "unknown message type 'nope'"),
                          ([[0, "heartbeat", {"rank": "x", "generation": 0, "step": 0,
                                              "state": "ready"}]], "heartbeat.rank must be an int")):
        with pytest.raises(P.ProtocolError, match=reason):
            P.decode(P.encode(P.Batch(items), SECRET, 1, JOB), SECRET, JOB).messages()


def test_a_batch_too_large_for_one_frame_is_split_in_order():
    nonce = bytes(P.NONCE_BYTES)
    peers = {r: (f"10.0.{r // 256}.{r % 256}", 40000 + r) for r in range(512)}
    pairs = [(lr, P.Assign(1, lr, 512, [], 8, 3, peers=peers)) for lr in range(8)]
    frames = P.Channel(SECRET, JOB, nonce, "server").encode_batch(pairs)
    assert len(frames) > 1  # 8 full-view Assigns of a 512-rank world do not fit one header
    rx = P.Channel(SECRET, JOB, nonce, "client")
    got = [p for f in frames for p in rx.decode(f).msg.messages()]
    assert [(lr, m.rank, m.peers == peers) for lr, m in got] == [(lr, lr, True) for lr in range(8)]
    small = P.Channel(SECRET, JOB, nonce, "server").encode_batch(pairs[:1])
    assert len(small) == 1
    huge = {r: (f"host-{r:06d}.example", r) for r in range(4000)}
    with pytest.raises(P.HeaderTooLarge):  # one message that fits no frame is not split
        P.Channel(SECRET, JOB, nonce, "server").encode_batch([(0, P.Assign(1, 0, 1, [], 1, 0,
                                                                            peers=huge))])


def test_a_batch_item_of_the_wrong_shape_is_named():
    for item in ([0, "goodbye"], [0, "goodbye", {"reason": "x"}, 1], ["0", "goodbye", {}],
                 [True, "goodbye", {}], {"0": 1}):
        batch = P.decode(P.encode(P.Batch([item]), SECRET, 1, JOB), SECRET, JOB)
        with pytest.raises(P.ProtocolError, match=r"batch.items\[0\] must be \[local rank, "
                                                  r"type, fields\]"):
            batch.messages()
