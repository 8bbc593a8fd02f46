"""multistream-select for new streams in one round trip instead of two.

Why: py-libp2p's `MultiselectClient` writes the multistream header, waits for its echo, and only then
proposes the protocol and waits again: two round trips before a stream carries a byte of its own. On a
loopback that is nothing; at 100-300 ms of RTT it is most of a SWIM ping's or an averaging request's cost
(issue #50 counted 6 RTT in an exchange, 2 of them here). The spec lets a client send the header and its
first proposal together (go-libp2p and rust-libp2p do), and every listener reads them one message at a
time (py-libp2p's `Multiselect.negotiate` reads each with an exact, length-prefixed read), so nothing else
changes: the replies are the same two messages, read in order. Only the first proposal rides along; where
the listener answers it with "na", the rest are proposed one by one as before.

Only new streams use it (`build_host` sets it as the host's `multiselect_client`); the connection upgrade's
own negotiations (security, muxer) keep py-libp2p's client.

`open_optimistic` goes one round trip further for a peer known to speak the protocol: the caller's first
message follows the proposal without waiting for it to be confirmed (`OptimisticStream`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import trio
from libp2p.abc import IMultiselectCommunicator
from libp2p.custom_types import TProtocol
from libp2p.exceptions import ParseError
from libp2p.io.exceptions import IOException, MessageTooLarge
from libp2p.protocol_muxer.exceptions import (
    MultiselectClientError,
    MultiselectCommunicatorError,
    ProtocolNotSupportedError,
)
from libp2p.protocol_muxer.multiselect_client import (
    DEFAULT_NEGOTIATE_TIMEOUT,
    MULTISELECT_PROTOCOL_ID,
    PROTOCOL_NOT_FOUND_MSG,
    MultiselectClient,
    is_valid_handshake,
)
from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator
from libp2p.utils import encode_delim
from libp2p.utils.varint import read_varint_prefixed_bytes_limited

__all__ = ["OptimisticRefused", "OptimisticStream", "PipelinedMultiselectClient", "open_optimistic", "open_stream",
           "speaks"]


class PipelinedMultiselectClient(MultiselectClient):
    """A `MultiselectClient` whose `select_one_of` sends the header and the first proposal in one write."""

    async def select_one_of(
        self,
        protocols: Sequence[TProtocol],
        communicator: IMultiselectCommunicator,
        negotiate_timeout: int = DEFAULT_NEGOTIATE_TIMEOUT,
    ) -> TProtocol:
        if not protocols or not isinstance(communicator, MultiselectCommunicator):
            return await super().select_one_of(protocols, communicator, negotiate_timeout)
        first, rest = protocols[0], protocols[1:]
        with trio.move_on_after(negotiate_timeout):
            try:
                await communicator.read_writer.write(
                    encode_delim(MULTISELECT_PROTOCOL_ID.encode()) + encode_delim((first or "").encode())
                )
            except (IOException, AssertionError, ValueError) as error:  # as MultiselectCommunicator.write
                raise MultiselectClientError(f"handshake write failed: {error}") from error
            header = await _read(communicator, "handshake")
            if not is_valid_handshake(header):
                raise MultiselectClientError(
                    f"multiselect protocol ID mismatch: expected {MULTISELECT_PROTOCOL_ID}, got {header!r}"
                )
            reply = await _read(communicator, "protocol")
            if reply == (first or ""):
                return first
            if reply != PROTOCOL_NOT_FOUND_MSG:
                raise MultiselectClientError(
                    f"unrecognized response: {reply!r}, expected {first!r} or {PROTOCOL_NOT_FOUND_MSG!r}"
                )
            refused = [f"protocol not supported: {first}"]
            for protocol in rest:
                try:
                    return await self.try_select(communicator, protocol)
                except ProtocolNotSupportedError as error:
                    refused.append(str(error))
            raise MultiselectClientError(
                f"protocols not supported: tried {list(protocols)}, last refusal: {refused[-1]}"
            )
        raise MultiselectClientError(
            f"response timed out after {negotiate_timeout}s, protocols tried: {list(protocols)}"
        )


async def _read(communicator: IMultiselectCommunicator, what: str) -> str:
    try:
        return await communicator.read()
    except MultiselectCommunicatorError as error:
        raise MultiselectClientError(f"{what} read failed: {error}") from error


# --- optimistic selection: no round trip of its own ----------------------------------------------------------

#: The longest multistream message an optimistic stream reads back (a protocol id and its newline): the peer's
#: replies are bounded before they are read, not by the deadline alone.
MAX_REPLY_BYTES = 1024


class OptimisticRefused(IOException):
    """The peer did not confirm the protocol an optimistic stream proposed (it answered "na", or not in
    multistream-select at all). An `IOException`, so the stream's readers see a broken stream, as they would
    for a reset; the caller negotiates the usual way next time."""


class OptimisticStream:
    """A new stream whose protocol was proposed and is trusted before the peer confirmed it: the caller
    writes its first message at once, and the first read checks the peer's two replies (the multistream
    header and the protocol) before anything else is read.

    Why: with `PipelinedMultiselectClient` a stream still costs one round trip before its first message;
    for a request that is answered at once (an averaging exchange's), that is a third of the exchange's
    fixed cost at 100-300 ms of RTT (issue #50). The listener reads the header, the proposal and then the
    handler's bytes one exact read at a time (py-libp2p's `Multiselect.negotiate`), so the request waits in
    the stream's buffer for the handler. Only for a peer known to speak the protocol (it confirmed it on
    an earlier stream): where it does not, the listener answers "na" and then reads our request as a
    proposal and drops the stream; the first read here raises `OptimisticRefused`.

    Everything but `read` and `write` is the underlying stream's (`get_protocol`, `muxed_conn`, `close`,
    `reset`...)."""

    def __init__(self, stream: Any, protocol: TProtocol) -> None:
        self._stream = stream
        self._protocol = protocol
        self.confirmed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    async def write(self, data: bytes) -> None:
        await self._stream.write(data)

    async def read(self, n: int | None = None) -> bytes:
        if not self.confirmed:
            await self._confirm()
        return await self._stream.read(n)

    async def _confirm(self) -> None:
        header = await _read_reply(self._stream)
        if not is_valid_handshake(header):
            raise OptimisticRefused(f"multiselect protocol ID mismatch: expected {MULTISELECT_PROTOCOL_ID}, "
                                    f"got {header[:64]!r}")
        reply = await _read_reply(self._stream)
        if reply != self._protocol:
            raise OptimisticRefused(f"the peer answered {reply[:64]!r} to {self._protocol}")
        self.confirmed = True


async def open_optimistic(host: Any, peer_id: Any, protocol: TProtocol) -> OptimisticStream:
    """A new stream to `peer_id` over an existing or new connection, `protocol` proposed with the multistream
    header in one write and not waited for (`OptimisticStream`)."""
    stream = await host.get_network().new_stream(peer_id)
    try:
        await stream.write(encode_delim(MULTISELECT_PROTOCOL_ID.encode()) + encode_delim(protocol.encode()))
    except BaseException:
        with trio.CancelScope(shield=True):
            with contextlib.suppress(Exception):
                await stream.reset()
        raise
    stream.set_protocol(protocol)
    return OptimisticStream(stream, protocol)


async def open_stream(host: Any, peer_id: Any, protocols: Sequence[TProtocol], *, optimistic: bool) -> Any:
    """A new stream to `peer_id`: optimistic in the first of `protocols` (`open_optimistic`) for a peer known to
    speak it, else negotiated among them (the host's `new_stream`)."""
    if optimistic:
        return await open_optimistic(host, peer_id, protocols[0])
    return await host.new_stream(peer_id, list(protocols))


def speaks(stream: Any, protocol: TProtocol) -> bool:
    """Whether `stream`'s peer is known to speak `protocol`: it confirmed it (an optimistic stream) or it was
    negotiated (any other)."""
    if isinstance(stream, OptimisticStream):
        return stream.confirmed
    try:
        return bool(stream.get_protocol() == protocol)
    except Exception:  # a stream that never finished its negotiation
        return False


async def _read_reply(stream: Any) -> str:
    try:
        data = await read_varint_prefixed_bytes_limited(stream, MAX_REPLY_BYTES)
    except (ParseError, IOException, MessageTooLarge) as error:
        raise OptimisticRefused(f"multistream reply: {type(error).__name__} {error}") from error
    if not data.endswith(b"\n"):
        raise OptimisticRefused(f"multistream reply not delimited by a newline: {data[:64]!r}")
    return data[:-1].decode(errors="replace")
