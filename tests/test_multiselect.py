"""A new stream's protocol is chosen in one round trip (p2p/multiselect.py), with what py-libp2p's listener says.

The round trips are counted, not timed: a client that writes and then reads has waited one round trip for
the reply, so the turns from writing to reading are the round trips it took.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.protocol_muxer.exceptions import MultiselectClientError
from libp2p.protocol_muxer.multiselect_client import MultiselectClient
from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator
from libp2p.utils import encode_delim

from p2p.host import build_host
from p2p.multiselect import (
    OptimisticRefused,
    OptimisticStream,
    PipelinedMultiselectClient,
    open_optimistic,
    speaks,
)

LISTEN = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
OURS, OLD, UNKNOWN = TProtocol("/test/2.0.0"), TProtocol("/test/1.0.0"), TProtocol("/test/unknown")


class Listener:
    """The far side of a stream as py-libp2p's listener speaks it, logging each write ("w") and read ("r")."""

    def __init__(self, supported: set[str]) -> None:
        self.supported = supported
        self.events: list[str] = []
        self.inbox = bytearray()  # what the client wrote, not yet answered
        self.outbox = bytearray()  # the replies, read by the client

    async def write(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        self.events.append("w")
        self.inbox += data
        while (message := self._take()) is not None:  # answer each complete message, in order
            reply = message if message == "/multistream/1.0.0" or message in self.supported else "na"
            self.outbox += encode_delim(reply.encode())

    def _take(self) -> str | None:
        if not self.inbox or self.inbox[0] >= 0x80 or len(self.inbox) < 1 + self.inbox[0]:
            return None
        n = self.inbox[0]
        message = bytes(self.inbox[1 : 1 + n]).decode().rstrip("\n")
        del self.inbox[: 1 + n]
        return message

    async def read(self, n: int = -1) -> bytes:
        await trio.lowlevel.checkpoint()
        self.events.append("r")
        take = len(self.outbox) if n < 0 else min(n, len(self.outbox))
        data = bytes(self.outbox[:take])
        del self.outbox[:take]
        return data

    async def close(self) -> None:
        pass

    def round_trips(self) -> int:
        return sum(1 for a, b in zip(self.events, self.events[1:], strict=False) if (a, b) == ("w", "r"))


async def select(client: MultiselectClient, protocols: list[TProtocol], supported: set[str]) -> tuple[str, int]:
    far = Listener(supported)
    chosen = await client.select_one_of(protocols, MultiselectCommunicator(far), 5)
    return chosen, far.round_trips()


async def test_a_new_stream_chooses_its_protocol_in_one_round_trip_where_py_libp2p_takes_two() -> None:
    assert await select(PipelinedMultiselectClient(), [OURS, OLD], {OURS, OLD}) == (OURS, 1)
    assert await select(MultiselectClient(), [OURS, OLD], {OURS, OLD}) == (OURS, 2)


async def test_a_listener_without_the_first_protocol_is_asked_the_next_one_after_its_na() -> None:
    assert await select(PipelinedMultiselectClient(), [OURS, OLD], {OLD}) == (OLD, 2)
    with pytest.raises(MultiselectClientError, match="not supported"):
        await select(PipelinedMultiselectClient(), [UNKNOWN, OLD], {OURS})


async def test_a_reply_that_is_neither_the_protocol_nor_na_is_an_error() -> None:
    class Confused(Listener):
        async def write(self, data: bytes) -> None:
            await super().write(data)
            if len(self.outbox) > 20:
                self.outbox = bytearray(encode_delim(b"/multistream/1.0.0") + encode_delim(b"/something/else"))

    with pytest.raises(MultiselectClientError, match="unrecognized response"):
        await PipelinedMultiselectClient().select_one_of([OURS], MultiselectCommunicator(Confused({OURS})), 5)


@asynccontextmanager
async def echo_pair(protocol: TProtocol) -> AsyncIterator[tuple[Any, Any]]:
    """Two connected hosts built here; the second echoes 5 bytes on `protocol`."""
    async with AsyncExitStack() as stack:
        a, b = build_host(create_new_key_pair()), build_host(create_new_key_pair())
        for h in (a, b):
            await stack.enter_async_context(h.run(LISTEN))
        await a.connect(info_from_p2p_addr(b.get_addrs()[0]))

        async def echo(stream) -> None:  # type: ignore[no-untyped-def]
            await stream.write(await stream.read(5))
            await stream.close()

        b.set_stream_handler(protocol, echo)
        yield a, b


async def test_hosts_built_here_open_streams_to_each_other_with_it() -> None:
    async with echo_pair(OLD) as (a, b):
        assert isinstance(a.multiselect_client, PipelinedMultiselectClient)
        with trio.fail_after(20):
            stream = await a.new_stream(b.get_id(), [OURS, OLD])  # b has only the older version
            assert stream.get_protocol() == OLD
            await stream.write(b"hello")
            assert await stream.read(5) == b"hello"
            with pytest.raises(Exception) as failed:  # noqa: PT011 (py-libp2p wraps the client's error)
                await a.new_stream(b.get_id(), [UNKNOWN])
            causes, e = [], failed.value
            while e is not None:
                causes.append(str(e))
                e = e.__cause__ or e.__context__
            assert any("not supported" in c for c in causes), causes


# --- open_optimistic: the first message written with the proposal --------------------------------------------


async def test_an_optimistic_stream_carries_its_request_with_the_proposal_and_the_listener_hands_it_over() -> None:
    """Real py-libp2p hosts: the listener reads the header, the proposal and then gives the handler our
    request, written before any reply came; the first read confirms the protocol and returns the answer."""
    async with echo_pair(OURS) as (a, b):
        with trio.fail_after(20):
            stream = await open_optimistic(a, b.get_id(), OURS)
            assert not stream.confirmed and not speaks(stream, OURS)
            await stream.write(b"hello")  # before any reply: no round trip of its own
            assert await stream.read(5) == b"hello"
            assert stream.confirmed and speaks(stream, OURS) and stream.get_protocol() == OURS
            await stream.close()
            # A listener without the protocol answers "na": the first read says so, and the listener serves on.
            refused = await open_optimistic(a, b.get_id(), UNKNOWN)
            await refused.write(b"hello")
            with pytest.raises(OptimisticRefused, match="na"):
                await refused.read(5)
            assert not speaks(refused, UNKNOWN)
            await refused.reset()
            again = await a.new_stream(b.get_id(), [OURS])
            await again.write(b"again")
            assert await again.read(5) == b"again"


class _Replies:
    """A stream whose peer's replies are given bytes (what a hostile or confused listener sends)."""

    def __init__(self, data: bytes) -> None:
        self.data = bytearray(data)
        self.asked = 0

    async def read(self, n: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        take = len(self.data) if n is None or n < 0 else min(n, len(self.data))
        self.asked += take
        out = bytes(self.data[:take])
        del self.data[:take]
        return out


@pytest.mark.parametrize(("replies", "says"), [
    (encode_delim(b"/multistream/9.9.9") + encode_delim(OURS.encode()), "protocol ID mismatch"),
    (encode_delim(b"/multistream/1.0.0") + encode_delim(b"/something/else"), "answered"),
    (b"\xff\xff\xff\xff\x0f" + b"x" * 64, "MessageTooLarge"),  # claims 4 GiB: refused before it is read
    (encode_delim(b"/multistream/1.0.0") + b"\x09/test", "IncompleteReadError"),  # cut short: the stream ended
    (encode_delim(b"/multistream/1.0.0") + b"\x04abcd", "not delimited"),
])
async def test_an_optimistic_streams_replies_are_bounded_and_checked_before_anything_is_read(
        replies: bytes, says: str) -> None:
    far = _Replies(replies)
    stream = OptimisticStream(far, OURS)
    with pytest.raises(OptimisticRefused, match=says):
        await stream.read(5)
    assert not stream.confirmed and far.asked <= len(replies)
