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
"""

from __future__ import annotations

from collections.abc import Sequence

import trio
from libp2p.abc import IMultiselectCommunicator
from libp2p.custom_types import TProtocol
from libp2p.io.exceptions import IOException
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

__all__ = ["PipelinedMultiselectClient"]


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
