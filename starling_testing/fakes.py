"""Test doubles for the transport: byte streams that serve scripted input, a py-libp2p stream, a host.

One definition each, used by the unit tests and by the fuzzer (starling_testing.fuzz), so that what a test
proves about a protocol holds for the fuzzed one too:

* :class:`ScriptedStream`, a :class:`p2p.wire.ByteStream` serving fixed bytes in short reads, then EOF;
* :class:`FakeNetStream`, a py-libp2p ``INetStream`` (``StreamEOF`` at the end, or ``StreamReset``);
* :class:`FakeHost`, the few host methods the averager, the dial-back service and the connection manager
  use, with no network behind them;
* :class:`RefusingProber`, a dial-back prober whose every dial is refused.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import trio
from libp2p.crypto.keys import KeyPair
from libp2p.network.stream.exceptions import StreamEOF, StreamReset
from libp2p.peer.id import ID

__all__ = ["FakeHost", "FakeNetStream", "RefusingProber", "ScriptedStream"]

#: Default largest read: an odd size, so that framing code meets reads that end inside a header or a frame.
CHUNK = 1021


class ScriptedStream:
    """A :class:`p2p.wire.ByteStream` that serves ``data`` in reads of at most ``chunk`` bytes, then EOF
    (``b""``); records the sizes asked for (``requested``), how far it was read (``pos``) and what is
    written to it (``written``). Every call is a trio checkpoint, as on a real stream."""

    def __init__(self, data: bytes, *, chunk: int = CHUNK) -> None:
        self.data = data
        self.pos = 0
        self.chunk = chunk
        self.requested: list[int] = []
        self.written = bytearray()

    async def read(self, max_bytes: int) -> bytes:
        await trio.lowlevel.checkpoint()
        self.requested.append(max_bytes)
        piece = self.data[self.pos : self.pos + min(max_bytes, self.chunk)]
        self.pos += len(piece)
        return piece

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint()
        self.written += data

    async def aclose(self) -> None:
        pass


class FakeNetStream:
    """Stands in for a py-libp2p ``INetStream`` from ``peer``.

    Serves ``data`` (bytes, in reads of at most ``chunk`` bytes; or a list of chunks, each served by reads
    that do not cross into the next, like yamux keeping the rest of a frame buffered), then raises
    ``StreamEOF``, or ``StreamReset`` with ``reset_at_end``. Writes must be real ``bytes`` (yamux
    concatenates them; an adapter must not hand it a memoryview): each is kept in ``writes`` and all of
    them in ``written``. Remembers whether it was closed (``closed``) or reset (``was_reset``).
    """

    def __init__(
        self,
        data: bytes | Sequence[bytes] = b"",
        peer: ID | None = None,
        *,
        chunk: int = CHUNK,
        reset_at_end: bool = False,
        remote: tuple[str, int] = ("127.0.0.1", 41000),
    ) -> None:
        self.pieces = [bytes(data)] if isinstance(data, bytes | bytearray) else [bytes(p) for p in data]
        self.data = b"".join(self.pieces)
        self.pos = 0  # bytes served so far
        self.chunk = chunk
        self.reset_at_end = reset_at_end
        self.remote = remote
        self.writes: list[bytes] = []
        self.written = bytearray()
        self.closed = False
        self.was_reset = False
        self.muxed_conn = SimpleNamespace(peer_id=peer)

    async def read(self, n: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        while self.pieces and not self.pieces[0]:
            self.pieces.pop(0)
        if not self.pieces:
            if self.reset_at_end:
                raise StreamReset("reset at the end of the scripted input")
            raise StreamEOF("end of the scripted input")
        head = self.pieces[0]
        piece = head[: min(n or self.chunk, self.chunk)]
        self.pieces[0] = head[len(piece) :]
        self.pos += len(piece)
        return piece

    async def write(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        if type(data) is not bytes:
            raise TypeError(f"a libp2p stream takes bytes, got {type(data).__name__}")
        self.writes.append(data)
        self.written += data

    async def close(self) -> None:
        self.closed = True

    async def reset(self) -> None:
        self.was_reset = True

    def get_remote_address(self) -> tuple[str, int]:
        return self.remote


class FakeHost:
    """The few host methods the averager, the dial-back service and the connection manager use, with no
    network behind them.

    ``key``: its identity (else a fixed test ID); ``streams``: makes the stream that ``new_stream``
    returns; ``peers``: the connected peers and their IPs (``disconnect`` drops one and lists it in
    ``disconnected``); ``handlers``: the stream handler set for each protocol id, for a test to hand
    inbound streams to as the host would.
    """

    def __init__(
        self,
        key: KeyPair | None = None,
        streams: Callable[[], Any] | None = None,
        *,
        peers: dict[ID, str] | None = None,
    ) -> None:
        self._id = ID.from_pubkey(key.public_key) if key is not None else ID(b"\x00\x05local")
        self._streams = streams
        self.peers = dict(peers or {})
        self.disconnected: list[ID] = []
        self.handlers: dict[str, Any] = {}

    def get_id(self) -> ID:
        return self._id

    def get_connected_peers(self) -> list[ID]:
        return list(self.peers)

    def set_stream_handler(self, protocol_id: str, handler: Any) -> None:
        self.handlers[protocol_id] = handler

    async def new_stream(self, peer: ID, protocols: Sequence[str]) -> Any:
        assert self._streams is not None, "this FakeHost opens no streams (give it `streams`)"
        return self._streams()

    async def disconnect(self, peer_id: ID) -> None:
        self.disconnected.append(peer_id)
        self.peers.pop(peer_id, None)


class RefusingProber:
    """A dial-back prober whose every dial is refused (the helper's outcome is then REFUSED)."""

    @asynccontextmanager
    async def run(self, listen_addrs: Sequence[Any]) -> AsyncIterator[None]:
        yield

    async def connect(self, info: Any) -> None:
        await trio.lowlevel.checkpoint()
        raise ConnectionRefusedError(111, "refused by the fake prober")

    async def disconnect(self, peer: ID) -> None:
        pass
