"""p2p.datapath: key agreement, the encrypted side channel, and the session listener."""

from __future__ import annotations

import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
import trio

from p2p import datapath
from p2p.datapath import (
    MAGIC,
    DataPathListener,
    KeyAgreement,
    Role,
    SecureChannel,
    SessionKeys,
    connect_datapath,
    new_session_id,
    preconnect,
)
from p2p.wire import (
    PlainFrameChannel,
    ProtocolError,
    Reason,
    TrioByteStream,
    read_exactly,
)
from protocols.codec import (
    ChunkPlan,
    get_codec,
    recv_tensor,
    recv_tensor_blocking,
    send_tensor,
    send_tensor_blocking,
)
from starling_testing.conformance import FRAME_CHANNEL_CHECKS, Check

PROTO = "/starling/avg/1.0.0"
TIMEOUT = 10


def randn(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n, dtype=np.float32)


def agree(
    *,
    initiator_view: tuple[bytes, bytes, str] = (b"peer-a", b"peer-b", PROTO),
    responder_view: tuple[bytes, bytes, str] = (b"peer-b", b"peer-a", PROTO),
) -> tuple[SessionKeys, SessionKeys]:
    """Both halves of a key agreement; each view is (local id, remote id, protocol id)."""
    a, b = KeyAgreement(), KeyAgreement()
    sid = new_session_id()
    ki = a.derive(
        role=Role.INITIATOR,
        peer_public_key=b.public_key,
        session_id=sid,
        local_peer_id=initiator_view[0],
        remote_peer_id=initiator_view[1],
        protocol_id=initiator_view[2],
    )
    kr = b.derive(
        role=Role.RESPONDER,
        peer_public_key=a.public_key,
        session_id=sid,
        local_peer_id=responder_view[0],
        remote_peer_id=responder_view[1],
        protocol_id=responder_view[2],
    )
    return ki, kr


@asynccontextmanager
async def serving(**kwargs: object) -> AsyncIterator[tuple[DataPathListener, tuple[str, int]]]:
    listener = DataPathListener("127.0.0.1", 0, **kwargs)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        port = await nursery.start(listener.serve)
        yield listener, ("127.0.0.1", port)
        nursery.cancel_scope.cancel()


async def connect_both(
    listener: DataPathListener, addr: tuple[str, int], ki: SessionKeys, kr: SessionKeys
) -> tuple[SecureChannel, SecureChannel]:
    async with listener.expect(kr, timeout=TIMEOUT) as pending:
        initiator = await connect_datapath(addr, ki, timeout=TIMEOUT)
        responder = await pending.wait()
    return initiator, responder


def socket_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    return trio.SocketStream(a), trio.SocketStream(b)


class Tap:
    """A man in the middle: the sender's frames land here, the test decides what reaches the receiver."""

    def __init__(self, *, max_frame_size: int = 1 << 16) -> None:
        ki, kr = agree()
        sender_end, self._inbox = socket_pair()
        self._outbox, receiver_end = socket_pair()
        self.sender = SecureChannel(sender_end, ki, max_frame_size=max_frame_size)
        self.receiver = SecureChannel(receiver_end, kr, max_frame_size=max_frame_size)

    async def capture(self) -> bytes:
        """The next raw frame the sender wrote (header and ciphertext)."""
        stream = TrioByteStream(self._inbox)
        header = await read_exactly(stream, 5, limit=5)
        (size,) = struct.unpack(">I", header[:4])
        return header + await read_exactly(stream, size, limit=1 << 20)

    async def deliver(self, raw: bytes) -> None:
        await self._outbox.send_all(raw)

    async def cut(self) -> None:
        await self._outbox.aclose()


async def expect_protocol_error(
    reason: Reason, fn: Callable[..., Awaitable[object]], *args: object, **kwargs: object
) -> ProtocolError:
    with trio.fail_after(TIMEOUT):
        with pytest.raises(ProtocolError) as exc:
            await fn(*args, **kwargs)
    assert exc.value.reason is reason, exc.value
    return exc.value


async def assert_closed_by_peer(stream: trio.SocketStream) -> None:
    """The listener hung up: EOF, or a reset when it closed with our bytes still unread."""
    with trio.fail_after(TIMEOUT):
        try:
            assert await stream.receive_some(100) == b""
        except trio.BrokenResourceError:
            pass
    await stream.aclose()


# ---------------------------------------------------------------------------------------------
# Key agreement
# ---------------------------------------------------------------------------------------------


def test_each_side_receives_with_the_key_the_other_sends_with() -> None:
    ki, kr = agree()
    assert ki.send_key == kr.recv_key and ki.recv_key == kr.send_key
    assert ki.send_key != ki.recv_key and ki.session_id == kr.session_id


@pytest.mark.parametrize(
    "responder_view",
    [
        (b"peer-b", b"peer-x", PROTO),  # responder believes it talks to someone else
        (b"peer-x", b"peer-a", PROTO),  # keys agreed for another local identity
        (b"peer-b", b"peer-a", "/starling/snapshot/1.0.0"),  # another protocol
    ],
)
def test_keys_are_bound_to_both_peer_ids_and_the_protocol(responder_view: tuple[bytes, bytes, str]) -> None:
    ki, kr = agree(responder_view=responder_view)
    assert ki.send_key != kr.recv_key and ki.recv_key != kr.send_key


def test_keys_differ_between_sessions() -> None:
    assert agree()[0].send_key != agree()[0].send_key


def test_an_ephemeral_key_cannot_be_used_twice() -> None:
    a, b = KeyAgreement(), KeyAgreement()
    kwargs = dict(
        peer_public_key=b.public_key,
        session_id=new_session_id(),
        local_peer_id=b"a",
        remote_peer_id=b"b",
        protocol_id=PROTO,
    )
    a.derive(role=Role.INITIATOR, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        a.derive(role=Role.INITIATOR, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("public_key", [bytes(32), b"\x01" + bytes(31), b"short"])
def test_low_order_or_malformed_peer_keys_are_refused(public_key: bytes) -> None:
    with pytest.raises(ProtocolError):
        KeyAgreement().derive(
            role=Role.RESPONDER,
            peer_public_key=public_key,
            session_id=new_session_id(),
            local_peer_id=b"a",
            remote_peer_id=b"b",
            protocol_id=PROTO,
        )


# ---------------------------------------------------------------------------------------------
# Transfers over loopback
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("initiator_threads", [False, True], ids=["event-loop", "initiator-in-threads"])
async def test_two_parties_swap_megabytes_of_fp32_bit_exact_over_loopback(initiator_threads: bool) -> None:
    """Both directions at once; with ``initiator_threads`` one side runs them in threads on blocking
    calls (the bulk path of an exchange) and the other on the event loop: the wire is the same."""
    ki, kr = agree()
    x, y = randn(1_500_000, 1), randn(1_250_000, 2)  # 6 MB and 5 MB, in both directions at once
    got_x, got_y = np.empty_like(x), np.empty_like(y)
    codec = get_codec("fp32")
    plan_x, plan_y = ChunkPlan.for_frame_size(x.size, codec), ChunkPlan.for_frame_size(y.size, codec)
    async with serving() as (listener, addr):
        initiator, responder = await connect_both(listener, addr, ki, kr)
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                if initiator_threads:
                    nursery.start_soon(
                        initiator.run_in_threads,
                        lambda io: send_tensor_blocking(io.send, x, plan_x),
                        lambda io: recv_tensor_blocking(io.recv_into, got_y, plan_y),
                    )
                else:
                    nursery.start_soon(send_tensor, initiator, x, plan_x)
                    nursery.start_soon(recv_tensor, initiator, got_y, plan_y)
                nursery.start_soon(send_tensor, responder, y, plan_y)
                nursery.start_soon(recv_tensor, responder, got_x, plan_x)
            await responder.send(b"after the bulk")  # small frames on the event loop work on afterwards
            assert await initiator.recv() == b"after the bulk"
        assert initiator.bytes_sent == responder.bytes_received and responder.bytes_sent == initiator.bytes_received
        await initiator.aclose()
        assert await responder.recv() == b""
        await responder.aclose()
    assert np.array_equal(got_x.view(np.int32), x.view(np.int32))
    assert np.array_equal(got_y.view(np.int32), y.view(np.int32))


@pytest.mark.parametrize("path", ["datapath", "stream"])
async def test_an_exchange_measures_both_deltas_norms_and_the_phi_distance_and_leaves_the_exact_sums(path: str) -> None:
    """The bounds (node/averaging/robust.py) need our Delta's norm, the partner's and the distance between the two
    phis, all measured chunk by chunk as the partner's chunks are folded into the sums, on the side
    channel and on the stream fallback; a judge that clips nothing leaves the exact sums."""
    from protocols.avg import Clip, Received, Tensors, make_plan, run_transfer

    n = 700_001  # three chunks of 1 MiB, the last one short
    sides = []
    for seed in (1, 2):
        rng = np.random.default_rng(seed)
        phi, delta = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32) * seed
        sides.append(Tensors(phi, delta, np.empty(n, dtype=np.float32), np.empty(n, dtype=np.float32)))
    plan = make_plan(n, "fp32", 64)
    seen: list[Received] = [Received(), Received()]

    def capture(i: int) -> Callable[[Received], Clip]:
        def judge(received: Received) -> Clip:
            seen[i] = received
            return Clip()
        return judge

    async def run(channels: tuple[object, object]) -> None:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for i in (0, 1):
                    nursery.start_soon(run_transfer, channels[i], sides[i], plan, path, capture(i))

    if path == "datapath":
        ki, kr = agree()
        async with serving() as (listener, addr):
            initiator, responder = await connect_both(listener, addr, ki, kr)
            await run((initiator, responder))
            await initiator.aclose()
            await responder.aclose()
    else:
        a, b = socket_pair()
        await run((PlainFrameChannel(TrioByteStream(a)), PlainFrameChannel(TrioByteStream(b))))
    true_norms = [float(np.linalg.norm(t.delta.astype(np.float64))) for t in sides]
    true_distance = float(np.linalg.norm(sides[0].phi.astype(np.float64) - sides[1].phi.astype(np.float64)))
    for i, received in enumerate(seen):
        own, theirs = received.delta_norms
        assert own == pytest.approx(true_norms[i], rel=1e-5) and theirs == pytest.approx(true_norms[1 - i], rel=1e-5)
        assert received.phi_distance == pytest.approx(true_distance, rel=1e-5)
    for t in sides:
        assert np.array_equal(t.phi_out, sides[0].phi + sides[1].phi)
        assert np.array_equal(t.delta_out, sides[0].delta + sides[1].delta)


@pytest.mark.parametrize("wire", ["bf16", "int8"])
async def test_over_a_lossy_wire_both_sides_hold_the_same_sums_in_their_own_memory(wire: str) -> None:
    """Each side adds its own values as they crossed the wire to the partner's, so the two sums are
    bit-identical; outputs that are CPU torch tensors (not numpy arrays) receive them in place."""
    import torch

    from protocols.avg import Tensors, make_plan, run_transfer

    n = 600_001
    numpy_side = Tensors(randn(n, 1), randn(n, 2) * 0.01, np.zeros(n, np.float32), np.zeros(n, np.float32))
    torch_side = Tensors(*(torch.from_numpy(v) for v in (randn(n, 3), randn(n, 4) * 0.01)), torch.zeros(n), torch.zeros(n))
    sides = [numpy_side, torch_side]
    plan = make_plan(n, wire, 4096)

    def crossed(values: object) -> np.ndarray:
        out = np.empty(n, dtype=np.float32)
        for start, stop in plan:
            plan.codec.decode_into(plan.codec.encode(np.asarray(values)[start:stop]), out[start:stop])
        return out

    a, b = socket_pair()
    channels = (PlainFrameChannel(TrioByteStream(a)), PlainFrameChannel(TrioByteStream(b)))
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for channel, side in zip(channels, sides, strict=True):
                nursery.start_soon(run_transfer, channel, side, plan, "stream")
    phi_sum = crossed(numpy_side.phi) + crossed(torch_side.phi)
    delta_sum = crossed(numpy_side.delta) + crossed(torch_side.delta)
    for side in sides:
        assert np.array_equal(np.asarray(side.phi_out).view(np.int32), phi_sum.view(np.int32))
        assert np.array_equal(np.asarray(side.delta_out).view(np.int32), delta_sum.view(np.int32))


@pytest.mark.skipif(not hasattr(socket, "TCP_NOTSENT_LOWAT"), reason="this OS has no TCP_NOTSENT_LOWAT")
async def test_a_threaded_bulk_transfer_lifts_trios_unsent_data_limit_and_puts_it_back() -> None:
    """trio caps a connection's unsent data at 16 KiB (``TCP_NOTSENT_LOWAT``); during a bulk transfer that
    made the sending thread refill the socket every few milliseconds and cost 5-10 % over a shaped link
    (bench/nat.py). The transfer runs without the cap; the event loop's later small frames get it back."""
    ki, kr = agree()
    seen: list[int] = []

    def limit(sock: socket.socket) -> int:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)

    async with serving() as (listener, addr):
        initiator, responder = await connect_both(listener, addr, ki, kr)
        before = limit(initiator.stream.socket)
        with trio.fail_after(TIMEOUT):
            await initiator.run_in_threads(lambda io: seen.append(limit(io._sock)), lambda io: 0)
        assert before > 0 and seen == [0]
        assert limit(initiator.stream.socket) == before
        await initiator.aclose()
        await responder.aclose()


def _available_congestion() -> set[str]:
    try:
        return set(Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text().split())
    except OSError:
        return set()


@pytest.mark.skipif("bbr" not in _available_congestion(), reason="this kernel offers no bbr congestion control")
async def test_both_ends_of_a_side_channel_pace_their_bulk_with_bbr() -> None:
    """A loss-based congestion control (CUBIC, most hosts' default) turns 1% loss at 300 ms into a few hundred
    kbit/s whatever the link (bench/congestion.py); the side channel asks its socket for BBR."""
    ki, kr = agree()
    async with serving() as (listener, addr):
        initiator, responder = await connect_both(listener, addr, ki, kr)
        for channel in (initiator, responder):
            assert channel.congestion == "bbr"
            assert channel.stream.socket.getsockopt(socket.IPPROTO_TCP, datapath._TCP_CONGESTION, 16).rstrip(b"\0") == b"bbr"
        await initiator.aclose()
        await responder.aclose()


def test_a_congestion_control_the_kernel_does_not_offer_leaves_the_hosts_default() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as sock:
        before = sock.getsockopt(socket.IPPROTO_TCP, datapath._TCP_CONGESTION, 16).rstrip(b"\0").decode()
        assert datapath.prefer_congestion(sock, b"no-such-algorithm") == before
    assert datapath.prefer_congestion(object()) is None  # no TCP socket at all: nothing to say


async def test_int8_transfer_accumulates_into_an_fp32_sum() -> None:
    ki, kr = agree()
    x, base = randn(300_000, 1), randn(300_000, 2)
    codec = get_codec("int8")
    plan = ChunkPlan.for_frame_size(x.size, codec)
    acc = base.copy()
    async with serving() as (listener, addr):
        initiator, responder = await connect_both(listener, addr, ki, kr)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_tensor, initiator, x, plan)
            await recv_tensor(responder, acc, plan, accumulate=True)
        await initiator.aclose()
        await responder.aclose()
    expected = base.copy()
    for start, stop in plan:
        codec.decode_into(codec.encode(x[start:stop]), expected[start:stop], accumulate=True)
    assert np.array_equal(acc, expected)


async def test_sender_stopping_mid_tensor_gives_the_receiver_a_clean_error() -> None:
    ki, kr = agree()
    x = randn(600_000)
    plan = ChunkPlan.for_frame_size(x.size, get_codec("bf16"))
    async with serving() as (listener, addr):
        initiator, responder = await connect_both(listener, addr, ki, kr)

        async def send_one_chunk_then_stop() -> None:
            await initiator.send(get_codec("bf16").encode(x[: plan.chunk_elems]))
            await initiator.aclose()  # an authenticated close, but only one chunk in

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_one_chunk_then_stop)
            await expect_protocol_error(Reason.TRUNCATED, recv_tensor, responder, np.empty_like(x), plan)
        await responder.aclose()


async def test_a_deadline_stops_a_threaded_transfer_blocked_on_a_silent_partner() -> None:
    ki, kr = agree()
    out = np.zeros(500_000, dtype=np.float32)
    plan = ChunkPlan.for_frame_size(out.size, get_codec("fp32"))
    async with serving() as (listener, addr):
        initiator, responder = await connect_both(listener, addr, ki, kr)
        with trio.fail_after(TIMEOUT):  # the threads block in recv; only the deadline can end them
            with trio.move_on_after(0.5) as scope:
                await initiator.run_in_threads(lambda io: 0, lambda io: recv_tensor_blocking(io.recv_into, out, plan))
        assert scope.cancelled_caught  # reported as the deadline, not as the socket it shut down
        await expect_protocol_error(Reason.BROKEN, initiator.send, b"x")  # the channel is spent
        await expect_protocol_error(Reason.TRUNCATED, responder.recv)  # and the partner sees the cut
        await responder.aclose()


async def test_a_tampered_frame_fails_authentication_in_a_threaded_receive() -> None:
    tap = Tap()
    await tap.sender.send(b"x" * 64)
    raw = bytearray(await tap.capture())
    raw[12] ^= 0x01
    await tap.deliver(bytes(raw))
    buf = bytearray(64)
    await expect_protocol_error(Reason.AUTH, tap.receiver.run_in_threads, lambda io: 0, lambda io: io.recv_into(buf))


def secure_pair(max_frame_size: int) -> tuple[SecureChannel, SecureChannel]:
    ki, kr = agree()
    a, b = socket_pair()
    return SecureChannel(a, ki, max_frame_size=max_frame_size), SecureChannel(b, kr, max_frame_size=max_frame_size)


@pytest.mark.parametrize("check", FRAME_CHANNEL_CHECKS, ids=lambda c: c.__name__)
async def test_the_secure_channel_meets_the_frame_channel_contract(check: Check) -> None:
    await check(secure_pair)


# ---------------------------------------------------------------------------------------------
# Framing attacks
# ---------------------------------------------------------------------------------------------


async def test_frames_pass_through_an_honest_tap() -> None:
    tap = Tap()
    await tap.sender.send(b"hello")
    await tap.deliver(await tap.capture())
    assert await tap.receiver.recv() == b"hello"


@pytest.mark.parametrize("offset", [3, 4, 5, 12, -1], ids=["length", "kind", "ciphertext", "payload", "tag"])
async def test_a_flipped_bit_anywhere_fails_authentication(offset: int) -> None:
    tap = Tap()
    await tap.sender.send(b"x" * 64)
    raw = bytearray(await tap.capture())
    raw[offset] ^= 0x01
    await tap.deliver(bytes(raw))
    if offset == 3:  # a longer announced length: the receiver waits for bytes that never come
        await tap.cut()
    with trio.fail_after(TIMEOUT):
        with pytest.raises(ProtocolError) as exc:
            await tap.receiver.recv()
    assert exc.value.reason in (Reason.AUTH, Reason.TRUNCATED, Reason.MALFORMED)
    if offset != 3:
        assert exc.value.reason is not Reason.TRUNCATED


async def test_a_replayed_frame_fails_authentication() -> None:
    tap = Tap()
    await tap.sender.send(b"pay me once")
    raw = await tap.capture()
    await tap.deliver(raw)
    assert await tap.receiver.recv() == b"pay me once"
    await tap.deliver(raw)
    await expect_protocol_error(Reason.AUTH, tap.receiver.recv)


async def test_reordered_frames_fail_authentication() -> None:
    tap = Tap()
    await tap.sender.send(b"first")
    await tap.sender.send(b"second")
    first, second = await tap.capture(), await tap.capture()
    await tap.deliver(second + first)
    await expect_protocol_error(Reason.AUTH, tap.receiver.recv)


async def test_a_dropped_frame_fails_authentication_of_the_next() -> None:
    tap = Tap()
    await tap.sender.send(b"first")
    await tap.sender.send(b"second")
    await tap.capture()
    await tap.deliver(await tap.capture())
    await expect_protocol_error(Reason.AUTH, tap.receiver.recv)


async def test_frames_reflected_back_to_their_sender_fail_authentication() -> None:
    ki, kr = agree()
    a_end, b_end = socket_pair()
    sender = SecureChannel(a_end, ki)
    mirror = SecureChannel(b_end, ki)  # same keys, same role: it tries to read the sender's own frames
    await sender.send(b"echo")
    await expect_protocol_error(Reason.AUTH, mirror.recv)


async def test_a_cut_connection_is_truncation_not_a_clean_close() -> None:
    tap = Tap()
    await tap.sender.send(b"partial")
    raw = await tap.capture()
    await tap.deliver(raw[:-3])
    await tap.cut()
    await expect_protocol_error(Reason.TRUNCATED, tap.receiver.recv)


async def test_a_forged_close_frame_fails_authentication() -> None:
    tap = Tap()
    await tap.deliver(struct.pack(">IB", 16, 1) + bytes(16))
    await expect_protocol_error(Reason.AUTH, tap.receiver.recv)


async def test_an_oversized_frame_is_refused_from_its_header_alone() -> None:
    tap = Tap(max_frame_size=1024)
    await tap.deliver(struct.pack(">IB", 1 << 30, 0))  # and no payload: must not wait for it
    await expect_protocol_error(Reason.TOO_LARGE, tap.receiver.recv)


async def test_a_frame_larger_than_the_callers_buffer_is_refused_before_reading() -> None:
    tap = Tap()
    await tap.sender.send(b"y" * 100)
    await tap.deliver(await tap.capture())
    await expect_protocol_error(Reason.BAD_SIZE, tap.receiver.recv_into, bytearray(10))


async def test_a_channel_is_unusable_after_an_error() -> None:
    tap = Tap()
    await tap.deliver(struct.pack(">IB", 20, 0) + bytes(20))
    await expect_protocol_error(Reason.AUTH, tap.receiver.recv)
    await expect_protocol_error(Reason.BROKEN, tap.receiver.recv)


async def test_send_refuses_empty_and_oversized_payloads() -> None:
    tap = Tap(max_frame_size=8)
    for bad in (b"", b"x" * 9):
        with pytest.raises(ValueError):
            await tap.sender.send(bad)


# ---------------------------------------------------------------------------------------------
# Listener
# ---------------------------------------------------------------------------------------------


async def test_a_stranger_with_wrong_keys_does_not_consume_the_session() -> None:
    ki, kr = agree()
    forged = SessionKeys(kr.session_id, Role.INITIATOR, bytes(range(32)), bytes(range(1, 33)))
    async with serving() as (listener, addr):
        async with listener.expect(kr, timeout=TIMEOUT) as pending:
            await expect_protocol_error(Reason.TRUNCATED, connect_datapath, addr, forged, timeout=TIMEOUT)
            initiator = await connect_datapath(addr, ki, timeout=TIMEOUT)
            responder = await pending.wait()
        await initiator.send(b"still mine")
        assert await responder.recv() == b"still mine"
        assert listener.rejected == 1
        await initiator.aclose()
        await responder.aclose()


async def test_keys_agreed_for_another_peer_cannot_connect() -> None:
    ki, kr = agree(responder_view=(b"peer-b", b"mallory", PROTO))
    async with serving() as (listener, addr):
        async with listener.expect(kr, timeout=TIMEOUT):
            with trio.fail_after(TIMEOUT), pytest.raises(ProtocolError):
                await connect_datapath(addr, ki, timeout=TIMEOUT)


async def test_an_unknown_session_is_turned_away() -> None:
    ki, _ = agree()
    async with serving() as (listener, addr):
        await expect_protocol_error(Reason.TRUNCATED, connect_datapath, addr, ki, timeout=TIMEOUT)
        assert listener.rejected == 1


async def test_a_connection_without_the_magic_is_closed() -> None:
    async with serving() as (listener, addr):
        stream = await trio.open_tcp_stream(*addr)
        await stream.send_all(b"GET / HTTP/1.1\r\n\r\n" + bytes(8))
        await assert_closed_by_peer(stream)


async def test_a_silent_connection_is_dropped_after_the_handshake_timeout() -> None:
    async with serving(handshake_timeout=0.2) as (listener, addr):
        stream = await trio.open_tcp_stream(*addr)
        await stream.send_all(MAGIC[:3])
        await assert_closed_by_peer(stream)
        assert listener.rejected == 1


async def test_an_expectation_times_out_and_then_refuses_the_late_partner() -> None:
    ki, kr = agree()
    async with serving() as (listener, addr):
        async with listener.expect(kr, timeout=0.1) as pending:
            with pytest.raises(trio.TooSlowError):
                await pending.wait()
        await expect_protocol_error(Reason.TRUNCATED, connect_datapath, addr, ki, timeout=TIMEOUT)


async def test_a_session_id_cannot_be_registered_twice() -> None:
    _, kr = agree()
    listener = DataPathListener()
    listener.expect(kr, timeout=1)
    with pytest.raises(ValueError):
        listener.expect(kr, timeout=1)


async def test_a_channel_that_arrived_but_was_never_collected_is_closed() -> None:
    ki, kr = agree()
    async with serving() as (listener, addr):
        async with listener.expect(kr, timeout=TIMEOUT):
            initiator = await connect_datapath(addr, ki, timeout=TIMEOUT)
        # The responder never called wait(); leaving the block closed its end cleanly.
        with trio.fail_after(TIMEOUT):
            assert await initiator.recv() == b""
        await initiator.aclose()


async def test_roles_must_match_the_side() -> None:
    ki, kr = agree()
    with pytest.raises(ValueError):
        DataPathListener().expect(ki, timeout=1)
    with pytest.raises(ValueError):
        await connect_datapath(("127.0.0.1", 9), kr, timeout=1)


# ---------------------------------------------------------------------------------------------
# Over real libp2p hosts: keys agreed on a Noise stream, bytes on the side channel or the fallback
# ---------------------------------------------------------------------------------------------


async def test_keys_agreed_over_a_libp2p_stream_open_the_side_channel_and_the_fallback_works() -> None:
    import multiaddr
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.peerinfo import info_from_p2p_addr

    from p2p.host import build_host
    from p2p.wire import LibP2PByteStream, recv_msg, send_msg

    x = randn(200_000)
    codec = get_codec("bf16")
    plan = ChunkPlan.for_frame_size(x.size, codec, max_frame_size=65536)
    via_side_channel, via_fallback = np.empty_like(x), np.empty_like(x)
    listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
    host_a, host_b = build_host(create_new_key_pair()), build_host(create_new_key_pair())
    done = trio.Event()

    async with (
        serving() as (listener, addr),
        host_a.run(listen_addrs=listen),
        host_b.run(listen_addrs=listen),
    ):

        async def responder(net_stream: object) -> None:
            control = LibP2PByteStream(net_stream)
            request = await recv_msg(control)
            mine = KeyAgreement()
            keys = mine.derive(
                role=Role.RESPONDER,
                peer_public_key=request["pub"],
                session_id=(sid := new_session_id()),
                local_peer_id=host_b.get_id().to_bytes(),
                remote_peer_id=net_stream.muxed_conn.peer_id.to_bytes(),  # type: ignore[attr-defined]
                protocol_id=PROTO,
            )
            async with listener.expect(keys, timeout=TIMEOUT) as pending:
                await send_msg(control, {"pub": mine.public_key, "sid": sid, "port": listener.port})
                async with await pending.wait() as channel:
                    await recv_tensor(channel, via_side_channel, plan)
            fallback = PlainFrameChannel(control, max_frame_size=65536)
            await recv_tensor(fallback, via_fallback, plan)
            done.set()

        host_b.set_stream_handler(PROTO, responder)  # type: ignore[arg-type]
        await host_a.connect(info_from_p2p_addr(host_b.get_addrs()[0]))
        net_stream = await host_a.new_stream(host_b.get_id(), [PROTO])
        control = LibP2PByteStream(net_stream)
        mine = KeyAgreement()
        await send_msg(control, {"pub": mine.public_key})
        with trio.fail_after(TIMEOUT):
            reply = await recv_msg(control)
        keys = mine.derive(
            role=Role.INITIATOR,
            peer_public_key=reply["pub"],
            session_id=reply["sid"],
            local_peer_id=host_a.get_id().to_bytes(),
            remote_peer_id=host_b.get_id().to_bytes(),
            protocol_id=PROTO,
        )
        async with await connect_datapath(("127.0.0.1", reply["port"]), keys, timeout=TIMEOUT) as channel:
            await send_tensor(channel, x, plan)
        await send_tensor(PlainFrameChannel(control, max_frame_size=65536), x, plan)
        with trio.fail_after(TIMEOUT):
            await done.wait()
        await control.aclose()

    expected = np.empty_like(x)
    codec.decode_into(codec.encode(x), expected)
    assert np.array_equal(via_side_channel, expected) and np.array_equal(via_fallback, expected)


async def test_an_unreachable_data_path_is_a_protocol_error_so_callers_can_fall_back() -> None:
    ki, _ = agree()
    probe = trio.socket.socket()
    await probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # a port that was free a moment ago and has no listener now
    await expect_protocol_error(Reason.BROKEN, connect_datapath, ("127.0.0.1", port), ki, timeout=TIMEOUT)


# -- the initiator's round trips: HELLO without waiting, and a connection dialled early (issue #50) ----------


async def test_hello_can_go_without_waiting_for_the_ack_and_the_ack_is_read_before_any_bulk() -> None:
    """`await_ack=False` returns once HELLO is sent, so the partner can be told the path at once; the
    channel refuses to move bulk until `await_ack` has read the listener's proof of the keys."""
    ki, kr = agree()
    async with serving() as (listener, addr):
        async with listener.expect(kr, timeout=TIMEOUT) as pending:
            initiator = await connect_datapath(addr, ki, timeout=TIMEOUT, await_ack=False)
            with pytest.raises(RuntimeError, match="await_ack"):
                await initiator.send(b"too early")
            with pytest.raises(RuntimeError, match="await_ack"):
                await initiator.recv()
            responder = await pending.wait()
        await responder.send(b"bulk behind the ack")
        await initiator.await_ack(timeout=TIMEOUT)
        assert await initiator.recv() == b"bulk behind the ack"
        await initiator.await_ack(timeout=TIMEOUT)  # once read, a no-op
        await initiator.aclose()
        await responder.aclose()


async def test_a_listener_without_our_session_fails_the_ack_not_the_hello() -> None:
    ki, _ = agree()
    async with serving() as (listener, addr):
        initiator = await connect_datapath(addr, ki, timeout=TIMEOUT, await_ack=False)  # nothing checked yet
        with trio.fail_after(TIMEOUT), pytest.raises(ProtocolError):
            await initiator.await_ack(timeout=TIMEOUT)
        await trio.aclose_forcefully(initiator.stream)


async def test_a_connection_dialled_early_carries_the_session_when_the_answer_names_its_port() -> None:
    ki, kr = agree()
    async with serving() as (listener, addr):
        async with preconnect(addr, timeout=TIMEOUT) as early:
            assert await early.take(("127.0.0.1", addr[1] + 1)) is None  # another port: not this connection
            async with listener.expect(kr, timeout=TIMEOUT) as pending:
                dialled = await early.take(addr)
                assert dialled is not None and early.stream is None  # taken: the caller owns it
                initiator = await connect_datapath(addr, ki, timeout=TIMEOUT, stream=dialled)
                responder = await pending.wait()
        await initiator.send(b"over the early connection")
        assert await responder.recv() == b"over the early connection"
        await initiator.aclose()
        await responder.aclose()


async def test_an_early_connection_not_taken_is_closed_and_the_listener_turns_it_away() -> None:
    async with serving() as (listener, addr):
        async with preconnect(addr, timeout=TIMEOUT) as early:
            await early.done.wait()
            assert early.stream is not None
        assert early.stream is None
        with trio.fail_after(TIMEOUT):
            while listener.rejected < 1:
                await trio.sleep(0.01)


async def test_an_early_connection_held_too_long_is_not_used(autojump_clock: trio.testing.MockClock) -> None:
    """The listener drops a connection that names no session within its handshake timeout (10 s): one
    dialled early and held through a slow answer is closed, and the exchange dials afresh."""
    from p2p.datapath import PRECONNECT_FRESH_S, Preconnect

    a, b = socket_pair()
    early = Preconnect(("127.0.0.1", 1))
    early.stream, early.connected_at = a, trio.current_time()
    early.done.set()
    await trio.sleep(PRECONNECT_FRESH_S + 1)
    assert await early.take(("127.0.0.1", 1)) is None
    await assert_closed_by_peer(b)


async def test_a_dial_that_fails_leaves_nothing_to_take() -> None:
    with socket.socket() as s:  # a port nothing listens on: bound, not listening
        s.bind(("127.0.0.1", 0))
        addr = s.getsockname()
        async with preconnect(addr, timeout=TIMEOUT) as early:
            assert await early.take(addr) is None


async def test_the_callers_cancellation_passes_through_an_early_dial_under_way() -> None:
    """A cancellation of the caller's on its way out through the body comes out of the early dial's block
    (the averager must never go on as if its exchange had returned)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(0)  # a backlog that fills: further dials hang in SYN
        addr = s.getsockname()
        with trio.move_on_after(0.3) as outer:
            async with preconnect(addr, timeout=TIMEOUT):
                await trio.sleep(5)
            pytest.fail("the body's cancellation was swallowed")
        assert outer.cancelled_caught
