"""Gossipsub over py-libp2p without its per-message peer record.

py-libp2p 0.8.1 attaches this host's signed peer record (an envelope of its addresses, about 200 bytes,
signed) to *every* pubsub RPC it writes: the hello, each published or forwarded message, each IDONTWANT.
go-libp2p sends it once per stream. Starling's member records are a few hundred bytes, so the envelope
was 41% of the gossip a quiet daemon sent (5 network-only daemons on loopback: 3.9 of 9.4 kB/s per
host). A receiver stores the record when an RPC carries one (``maybe_consume_signed_record``) and does
nothing when it does not. The library's hello (the first RPC on each stream, written by
``Pubsub._handle_new_peer`` straight to the stream, not through ``write_msg``) always carries the record,
so leaving it off every RPC written through ``write_msg`` keeps what the peer learns: once per stream.

And IDONTWANT (gossipsub v1.2) only for messages of at least ``IDONTWANT_MIN_BYTES``, as go-libp2p
(``IDontWantMessageThreshold``, 1 KiB). py-libp2p 0.8.1 sends one for every message it receives, to every
mesh peer: a control RPC of its own per peer per message, each costing a muxer frame and, before the
patch below, a fresh look at the host's addresses for the peer record it then drops (about 2 ms). For a
member record of a few hundred bytes the IDONTWANT is about as large as the duplicate it may save, and
usually arrives after the peer forwarded it: with 16 daemons, emitting them was 23% of an idle daemon's
CPU (bench/scale.py --profile).
"""

from __future__ import annotations

from typing import Any

__all__ = ["IDONTWANT_MIN_BYTES", "idontwant_for_large_messages_only", "send_peer_record_once"]

#: The smallest message an IDONTWANT is sent for (go-libp2p's default threshold).
IDONTWANT_MIN_BYTES = 1024


def send_peer_record_once(pubsub: Any) -> None:
    """Narrow, instance-level patch of ``pubsub.write_msg`` (the call every RPC after the hello goes
    through): the signed peer record is left off, the hello having carried it on this stream."""
    write_msg = pubsub.write_msg

    async def write_msg_once(stream: Any, rpc_msg: Any) -> bool:
        rpc_msg.ClearField("senderRecord")  # a shared RPC object (one publish, many peers): same for all
        return bool(await write_msg(stream, rpc_msg))

    pubsub.write_msg = write_msg_once


def idontwant_for_large_messages_only(router: Any, min_bytes: int = IDONTWANT_MIN_BYTES) -> None:
    """Narrow, instance-level patch of a GossipSub router: no IDONTWANT for a message under ``min_bytes``.

    The router calls ``_emit_idontwant_for_message(msg_id, topics)`` right after putting the message in
    its message cache, so the size is looked up there; a message not found (another ID function) gets its
    IDONTWANT as before.
    """
    emit = router._emit_idontwant_for_message

    async def emit_for_large(msg_id: bytes, topic_ids: Any) -> None:
        message = router.mcache.get(msg_id)
        if message is not None and message.ByteSize() < min_bytes:
            return
        await emit(msg_id, topic_ids)

    router._emit_idontwant_for_message = emit_for_large
