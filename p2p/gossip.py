"""Gossipsub over py-libp2p without its per-message peer record.

py-libp2p 0.8.1 attaches this host's signed peer record (an envelope of its addresses, about 200 bytes,
signed) to *every* pubsub RPC it writes: the hello, each published or forwarded message, each IDONTWANT.
go-libp2p sends it once per stream. Starling's member records are a few hundred bytes, so the envelope
was 41% of the gossip a quiet daemon sent (5 network-only daemons on loopback: 3.9 of 9.4 kB/s per
host). A receiver stores the record when an RPC carries one (``maybe_consume_signed_record``) and does
nothing when it does not. The library's hello (the first RPC on each stream, written by
``Pubsub._handle_new_peer`` straight to the stream, not through ``write_msg``) always carries the record,
so leaving it off every RPC written through ``write_msg`` keeps what the peer learns: once per stream.
"""

from __future__ import annotations

from typing import Any

__all__ = ["send_peer_record_once"]


def send_peer_record_once(pubsub: Any) -> None:
    """Narrow, instance-level patch of ``pubsub.write_msg`` (the call every RPC after the hello goes
    through): the signed peer record is left off, the hello having carried it on this stream."""
    write_msg = pubsub.write_msg

    async def write_msg_once(stream: Any, rpc_msg: Any) -> bool:
        rpc_msg.ClearField("senderRecord")  # a shared RPC object (one publish, many peers): same for all
        return bool(await write_msg(stream, rpc_msg))

    pubsub.write_msg = write_msg_once
