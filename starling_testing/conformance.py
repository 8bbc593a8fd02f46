"""A conformance check for :class:`p2p.wire.FrameChannel` implementations.

The averaging exchange runs over whichever frame channel the data path gives it: the encrypted side
channel (:class:`p2p.datapath.SecureChannel`) or the fallback over a libp2p stream
(:class:`p2p.wire.PlainFrameChannel`). It relies on the contract that :class:`~p2p.wire.FrameChannel`'s
docstring states, and this module checks it, one property per check, on fresh connected pairs from a
factory, so that a new channel can be held to the same contract::

    def plain_pair(max_frame_size: int) -> tuple[FrameChannel, FrameChannel]:
        a, b = trio.testing.memory_stream_pair()
        return (PlainFrameChannel(TrioByteStream(a), max_frame_size=max_frame_size),
                PlainFrameChannel(TrioByteStream(b), max_frame_size=max_frame_size))

    @pytest.mark.parametrize("check", FRAME_CHANNEL_CHECKS, ids=lambda c: c.__name__)
    async def test_plain_frame_channel_conforms(check):
        await check(plain_pair)

or ``await check_frame_channel(plain_pair)`` for all of them. A failed check raises AssertionError (or the
unexpected exception).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from p2p.wire import FrameChannel, ProtocolError, Reason

__all__ = ["FRAME_CHANNEL_CHECKS", "Check", "PairFactory", "check_frame_channel"]

#: Makes two connected channels (what one sends, the other receives) with this largest frame payload.
PairFactory = Callable[[int], tuple[FrameChannel, FrameChannel]]

MAX_FRAME = 1 << 16
TIMEOUT_S = 20.0


def _payload(n: int, seed: int) -> bytes:
    return bytes((seed + i * 7) % 251 for i in range(n))


async def _close(*channels: FrameChannel) -> None:
    for ch in channels:
        with trio.CancelScope(shield=True):
            await ch.aclose()


async def implements_the_protocol(make_pair: PairFactory) -> None:
    """Both ends are :class:`FrameChannel`s with the frame limit asked for, their counters at zero."""
    a, b = make_pair(MAX_FRAME)
    try:
        for ch in (a, b):
            assert isinstance(ch, FrameChannel), f"{type(ch).__name__} lacks part of FrameChannel"
            assert ch.max_frame_size == MAX_FRAME
            assert ch.bytes_sent == ch.bytes_received == 0
    finally:
        await _close(a, b)


async def frames_arrive_whole_and_in_order(make_pair: PairFactory) -> None:
    """Frames of 1 byte to ``max_frame_size`` bytes, given as bytes, bytearray or memoryview, arrive whole
    and in order, through ``recv`` and through ``recv_into`` a larger buffer."""
    a, b = make_pair(MAX_FRAME)
    try:
        frames = [b"x", _payload(1000, 1), _payload(MAX_FRAME, 2), _payload(77, 3), _payload(MAX_FRAME - 1, 4)]
        kinds: list[Callable[[bytes], object]] = [bytes, bytearray, memoryview, bytes, memoryview]
        buf = bytearray(MAX_FRAME + 10)
        with trio.fail_after(TIMEOUT_S):
            async with trio.open_nursery() as nursery:

                async def send_all() -> None:
                    for frame, kind in zip(frames, kinds, strict=True):
                        await a.send(kind(frame))  # type: ignore[arg-type]

                nursery.start_soon(send_all)
                for i, frame in enumerate(frames):
                    if i % 2:
                        n = await b.recv_into(buf)
                        assert n == len(frame) and buf[:n] == frame, f"frame {i} differs"
                    else:
                        assert await b.recv() == frame, f"frame {i} differs"
    finally:
        await _close(a, b)


async def both_ways_at_once(make_pair: PairFactory) -> None:
    """One task per direction sending while the other side receives (the exchange streams both ways at
    once): 8 MiB each way, more than any socket buffer holds, so a channel that cannot do both at once
    deadlocks here instead of in an exchange."""
    a, b = make_pair(MAX_FRAME)
    count = (8 << 20) // MAX_FRAME
    got: dict[str, int] = {}
    try:
        with trio.fail_after(TIMEOUT_S * 3):
            async with trio.open_nursery() as nursery:

                async def send(ch: FrameChannel, seed: int) -> None:
                    for i in range(count):
                        await ch.send(_payload(MAX_FRAME, seed + i) if i < 2 else bytes([seed % 256]) * MAX_FRAME)

                async def recv(ch: FrameChannel, seed: int, name: str) -> None:
                    buf = bytearray(MAX_FRAME)
                    for i in range(count):
                        n = await ch.recv_into(buf)
                        expect = _payload(MAX_FRAME, seed + i) if i < 2 else bytes([seed % 256]) * MAX_FRAME
                        assert n == MAX_FRAME and buf == expect, f"{name}: frame {i} differs"
                    got[name] = count

                nursery.start_soon(send, a, 10)
                nursery.start_soon(send, b, 20)
                nursery.start_soon(recv, b, 10, "a->b")
                nursery.start_soon(recv, a, 20, "b->a")
        assert got == {"a->b": count, "b->a": count}
    finally:
        await _close(a, b)


async def close_send_is_a_half_close(make_pair: PairFactory) -> None:
    """After ``close_send`` the peer's ``recv``/``recv_into`` return ``b""``/``0`` (again on every call),
    the closed side can still receive, and sending on it raises ``trio.ClosedResourceError``."""
    a, b = make_pair(MAX_FRAME)
    try:
        with trio.fail_after(TIMEOUT_S):
            await a.send(b"last")
            await a.close_send()
            assert await b.recv() == b"last"
            assert await b.recv() == b""
            assert await b.recv_into(bytearray(8)) == 0
            assert await b.recv() == b""
            await b.send(b"reply")
            assert await a.recv() == b"reply"
            try:
                await a.send(b"more")
            except trio.ClosedResourceError:
                pass
            else:
                raise AssertionError("send after close_send did not raise trio.ClosedResourceError")
    finally:
        await _close(a, b)


async def aclose_is_a_clean_end_for_the_peer(make_pair: PairFactory) -> None:
    """``aclose`` tells the peer: its next ``recv`` returns ``b""`` (a clean end, not an error)."""
    a, b = make_pair(MAX_FRAME)
    try:
        with trio.fail_after(TIMEOUT_S):
            await a.send(b"bye")
            await a.aclose()
            assert await b.recv() == b"bye"
            assert await b.recv() == b""
    finally:
        await _close(a, b)


async def send_refuses_empty_and_oversized_frames(make_pair: PairFactory) -> None:
    """``send`` of 0 or ``max_frame_size + 1`` bytes raises ValueError and sends nothing (the next
    frame still arrives)."""
    a, b = make_pair(MAX_FRAME)
    try:
        with trio.fail_after(TIMEOUT_S):
            for bad in (b"", b"x" * (MAX_FRAME + 1)):
                try:
                    await a.send(bad)
                except ValueError:
                    pass
                else:
                    raise AssertionError(f"send of {len(bad)} bytes did not raise ValueError")
            await a.send(b"ok")
            assert await b.recv() == b"ok"
    finally:
        await _close(a, b)


async def recv_into_refuses_a_frame_larger_than_the_buffer(make_pair: PairFactory) -> None:
    """A frame larger than the buffer given to ``recv_into`` is refused (ProtocolError BAD_SIZE), not
    truncated into it."""
    a, b = make_pair(MAX_FRAME)
    try:
        with trio.fail_after(TIMEOUT_S):
            await a.send(b"y" * 100)
            buf = bytearray(10)
            try:
                await b.recv_into(buf)
            except ProtocolError as e:
                assert e.reason is Reason.BAD_SIZE, e
            else:
                raise AssertionError("a 100-byte frame was received into a 10-byte buffer")
    finally:
        await _close(a, b)


async def byte_counters_agree(make_pair: PairFactory) -> None:
    """``bytes_sent`` of one side equals ``bytes_received`` of the other once everything has arrived, and
    counts framing on top of the payload."""
    a, b = make_pair(MAX_FRAME)
    try:
        with trio.fail_after(TIMEOUT_S):
            payload = 0
            for n in (1, 500, MAX_FRAME):
                await a.send(b"z" * n)
                payload += n
                assert len(await b.recv()) == n
            await a.close_send()
            assert await b.recv() == b""
            assert a.bytes_sent == b.bytes_received, (a.bytes_sent, b.bytes_received)
            assert a.bytes_sent > payload
    finally:
        await _close(a, b)


Check = Callable[[PairFactory], Awaitable[None]]

#: Every check, in a fixed order (parametrize a test over them to see which property fails).
FRAME_CHANNEL_CHECKS: list[Check] = [
    implements_the_protocol,
    frames_arrive_whole_and_in_order,
    both_ways_at_once,
    close_send_is_a_half_close,
    aclose_is_a_clean_end_for_the_peer,
    send_refuses_empty_and_oversized_frames,
    recv_into_refuses_a_frame_larger_than_the_buffer,
    byte_counters_agree,
]


async def check_frame_channel(make_pair: PairFactory) -> None:
    """Run every check of :data:`FRAME_CHANNEL_CHECKS` on fresh pairs from ``make_pair``."""
    for check in FRAME_CHANNEL_CHECKS:
        await check(make_pair)
