"""Length-prefixed msgpack frames, sans-io: the one owner of the length prefix, the size limit and the errors.

Every Starling conversation is a sequence of ``u32 big-endian length || msgpack map`` frames: the protocols
on libp2p streams (p2p/wire.py, under trio) and the daemon-worker control channel (node/bridge/ipc.py, whose
worker end blocks on a plain socket between training steps). What a frame is, how large it may be and which
bytes are refused is decided here once, so that both conversations refuse the same things the same way and
raise the same :class:`ProtocolError`.

Why a module apart from wire.py: this one does no I/O and imports neither trio nor libp2p, so the worker
process (which runs no event loop) frames its messages with it too. Callers feed bytes in
(:class:`FrameSplitter`) or read a prefix themselves (:func:`announced_length`); what to do with a decoded
map (validate it into a dataclass) is theirs.
"""

from __future__ import annotations

import enum
import struct
from typing import Any, TypeAlias

import msgpack

__all__ = [
    "DEFAULT_MAX_MSG_BYTES",
    "LENGTH",
    "Buffer",
    "FrameSplitter",
    "ProtocolError",
    "Reason",
    "announced_length",
    "decode_msg",
    "pack_map",
    "unpack",
]

#: What byte-oriented APIs accept (``collections.abc.Buffer`` needs Python 3.12).
Buffer: TypeAlias = bytes | bytearray | memoryview

#: Default ceiling for one control message on a libp2p stream. Control messages are small (a header with a
#: tensor layout of a few thousand entries at most); bulk bytes never travel as messages.
DEFAULT_MAX_MSG_BYTES = 1 << 20

#: The length prefix of every frame: u32, big-endian.
LENGTH = struct.Struct(">I")


class Reason(enum.StrEnum):
    """Why a conversation with a peer failed; stable strings suitable for metrics labels."""

    CLOSED = "closed"  # the stream ended cleanly where a message or frame was expected
    TRUNCATED = "truncated"  # the stream ended in the middle of a message or frame
    TOO_LARGE = "too_large"  # a length prefix exceeded the receiver's limit
    MALFORMED = "malformed"  # bytes that are not a valid message (bad msgpack, not a map, ...)
    BAD_KIND = "bad_kind"  # a valid message, but not one of the kinds expected here
    BAD_VERSION = "bad_version"  # a schema version this node does not speak
    BAD_FIELD = "bad_field"  # missing, unknown, mistyped or out-of-range field
    BAD_SIZE = "bad_size"  # a bulk chunk whose size differs from what the header announced
    AUTH = "auth"  # authentication failed: tampered, replayed, reordered or foreign frame
    BROKEN = "broken"  # the transport failed underneath (reset, connection lost)


class ProtocolError(Exception):
    """A peer sent something we refuse, or the stream to it broke; the stream is unusable after this."""

    def __init__(self, reason: Reason, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)


def pack_map(obj: Any, *, max_bytes: int) -> bytes:
    """One frame of ``obj`` (a msgpack-ready map); refuses to build what a receiver with the same limit
    would refuse to read (ValueError: it is the sender's bug, not the peer's)."""
    payload = msgpack.packb(obj, use_bin_type=True)
    if len(payload) > max_bytes:
        raise ValueError(f"message of {len(payload)} bytes exceeds the {max_bytes}-byte limit")
    return LENGTH.pack(len(payload)) + payload


def announced_length(header: Buffer, *, max_bytes: int) -> int:
    """The payload size a frame's prefix announces, refused (TOO_LARGE) above ``max_bytes`` before
    anything is read or allocated for it."""
    (length,) = LENGTH.unpack(header)
    if length > max_bytes:
        raise ProtocolError(Reason.TOO_LARGE, f"frame of {length} bytes announced, exceeds the {max_bytes}-byte limit")
    return int(length)


def unpack(data: Buffer, *, max_items: int, max_str: int, max_bin: int) -> Any:
    """msgpack-decode a peer's bytes strictly (text as str, string keys only, no extension types) with
    msgpack's own allocation limits: at most `max_items` entries in an array or map, `max_str` characters
    in a string, `max_bin` bytes in a binary. What msgpack refuses is a MALFORMED `ProtocolError` (the
    msgpack error is its ``__cause__``)."""
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=max_str,
            max_bin_len=max_bin,
            max_array_len=max_items,
            max_map_len=max_items,
            max_ext_len=0,  # no extension types (timestamps included) in Starling messages
        )
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        # msgpack reports malformed input through ValueError subclasses (ExtraData, FormatError,
        # StackError, UnicodeDecodeError...), TypeError for unhashable keys and OverflowError for
        # integers Python cannot hold; none of these is our bug, all are the peer's.
        raise ProtocolError(Reason.MALFORMED, f"undecodable msgpack: {type(exc).__name__}") from exc


def decode_msg(payload: Buffer, *, max_bytes: int = DEFAULT_MAX_MSG_BYTES) -> dict[str, Any]:
    """Decode one msgpack payload (without length prefix) into a map, strictly and with size limits."""
    size = memoryview(payload).nbytes
    if size > max_bytes:
        raise ProtocolError(Reason.TOO_LARGE, f"{size} bytes, limit {max_bytes}")
    obj = unpack(payload, max_items=size, max_str=size, max_bin=size)
    if not isinstance(obj, dict):
        raise ProtocolError(Reason.MALFORMED, f"expected a map, got {type(obj).__name__}")
    return obj


class FrameSplitter:
    """Accumulates bytes as they arrive and splits off complete frames' maps, each at most ``max_bytes``.

    For a reader that gets bytes in pieces of its own choosing (a blocking socket polled between training
    steps, a trio stream's ``receive_some``): a prefix over the limit is refused as soon as its four bytes are
    in, before the body is waited for.
    """

    def __init__(self, *, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._buf = bytearray()

    def feed(self, data: Buffer) -> None:
        self._buf += data

    def next_map(self) -> dict[str, Any] | None:
        """The next complete frame's map, or None until one has arrived."""
        if len(self._buf) < LENGTH.size:
            return None
        size = announced_length(self._buf[: LENGTH.size], max_bytes=self.max_bytes)
        end = LENGTH.size + size
        if len(self._buf) < end:
            return None
        body = bytes(self._buf[LENGTH.size : end])
        del self._buf[:end]
        return decode_msg(body, max_bytes=self.max_bytes)
