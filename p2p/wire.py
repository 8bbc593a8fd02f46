"""Wire framing shared by every Starling protocol.

Every control message is ``u32 big-endian length || msgpack map``. The framing itself -- the length
prefix, its limit checked *before* anything is allocated, the map decoded with msgpack's own size limits,
and :class:`ProtocolError` -- is :mod:`p2p.framing`'s (sans-io, shared with the daemon-worker channel in
node/bridge/ipc.py); this module adds the streams and the strict validation of a map into a dataclass
(required keys, types, ranges, message kind, version). Any deviation -- and any transport failure
underneath -- surfaces as that one exception type, whose :attr:`ProtocolError.reason` says what went
wrong. Callers therefore have one thing to catch, and one place to decide whether to count the failure
against the peer.

The module also defines the two stream abstractions the rest of the code is written against:

* :class:`ByteStream` -- an ordered byte pipe (``read``/``write``/``aclose``), with adapters for trio
  streams (:class:`TrioByteStream`) and py-libp2p streams (:class:`LibP2PByteStream`).
* :class:`FrameChannel` -- a pipe of bounded, delimited frames used for bulk tensor chunks. The fast
  path is the encrypted TCP side channel in :mod:`p2p.datapath`; :class:`PlainFrameChannel` is the
  fallback over any :class:`ByteStream` (e.g. a Noise-secured libp2p stream where no direct path exists).

Message dataclasses declare their kind and version as class variables and use :func:`spec` for
bounds::

    @dataclass(frozen=True)
    class Hello:
        KIND: ClassVar[str] = "hello"
        VERSION: ClassVar[int] = 1
        outer_step: int = spec(ge=0)
        manifest_hash: bytes = spec(min_len=32, max_len=32)
        note: str = spec(max_len=200, default="")

    await send_msg(stream, Hello(outer_step=3, manifest_hash=h))
    hello = await recv_as(stream, Hello, max_bytes=4096)
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import math
import struct
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

import trio

from p2p.framing import (
    DEFAULT_MAX_MSG_BYTES,
    LENGTH,
    Buffer,
    ProtocolError,
    Reason,
    announced_length,
    decode_msg,
    pack_map,
)

__all__ = [
    "DEFAULT_MAX_MSG_BYTES",
    "ByteStream",
    "FrameChannel",
    "LibP2PByteStream",
    "PlainFrameChannel",
    "ProtocolError",
    "Reason",
    "TrioByteStream",
    "decode_msg",
    "encode_msg",
    "close_quietly",
    "single_error",
    "from_map",
    "read_exactly",
    "recv_as",
    "recv_msg",
    "send_msg",
    "spec",
    "to_map",
]


#: Keys reserved in every message map for the message kind and the schema version.
KIND_KEY = "t"
VERSION_KEY = "v"


# --------------------------------------------------------------------------------------------------
# Byte streams
# --------------------------------------------------------------------------------------------------


@runtime_checkable
class ByteStream(Protocol):
    """An ordered, reliable byte pipe. ``read`` returns at most ``max_bytes`` and ``b""`` at EOF."""

    async def read(self, max_bytes: int) -> bytes: ...

    async def write(self, data: Buffer) -> None: ...

    async def aclose(self) -> None: ...


class TrioByteStream:
    """:class:`ByteStream` over a ``trio.abc.Stream`` (e.g. ``trio.SocketStream``, memory streams)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream

    async def read(self, max_bytes: int) -> bytes:
        try:
            return await self.stream.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ProtocolError(Reason.BROKEN, str(exc) or type(exc).__name__) from exc

    async def write(self, data: Buffer) -> None:
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ProtocolError(Reason.BROKEN, str(exc) or type(exc).__name__) from exc

    async def aclose(self) -> None:
        await self.stream.aclose()


class LibP2PByteStream:
    """:class:`ByteStream` over a py-libp2p ``INetStream``.

    py-libp2p signals EOF with ``StreamEOF`` rather than ``b""`` and has its own exception tree; both
    are normalised here so protocol code never imports libp2p exceptions. ``libp2p`` is imported lazily
    because importing it costs ~0.5 s and reconfigures logging, which pure-wire users should not pay.
    """

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    async def read(self, max_bytes: int) -> bytes:
        from libp2p.io.exceptions import IOException
        from libp2p.network.stream.exceptions import StreamEOF

        try:
            return await self.stream.read(max_bytes)
        except StreamEOF:
            return b""
        except IOException as exc:
            raise ProtocolError(Reason.BROKEN, f"libp2p stream: {type(exc).__name__} {exc}") from exc

    async def write(self, data: Buffer) -> None:
        from libp2p.io.exceptions import IOException

        try:
            # Yamux slices and concatenates the payload; give it real bytes, not a view.
            await self.stream.write(bytes(data))
        except IOException as exc:
            raise ProtocolError(Reason.BROKEN, f"libp2p stream: {type(exc).__name__} {exc}") from exc

    async def aclose(self) -> None:
        await self.stream.close()

    async def reset(self) -> None:
        """Abort the stream in both directions (use after a :class:`ProtocolError`)."""
        await self.stream.reset()


async def read_exactly(stream: ByteStream, n: int, *, limit: int) -> bytes:
    """Read exactly ``n`` bytes; refuse ``n > limit`` before allocating anything.

    Raises :class:`ProtocolError` with ``CLOSED`` if the stream ends before the first byte and
    ``TRUNCATED`` if it ends part-way.
    """
    if n < 0 or n > limit:
        raise ProtocolError(Reason.TOO_LARGE, f"{n} bytes announced, limit {limit}")
    if n == 0:
        return b""
    first = await stream.read(n)
    if len(first) > n:
        raise RuntimeError(f"{type(stream).__name__}.read({n}) returned {len(first)} bytes")
    if len(first) == n:
        return first  # the common case: no copy
    if not first:
        raise ProtocolError(Reason.CLOSED, f"stream ended, {n} bytes expected")
    buf = bytearray(first)
    while len(buf) < n:
        more = await stream.read(n - len(buf))
        if len(more) > n - len(buf):
            raise RuntimeError(f"{type(stream).__name__}.read() returned more than requested")
        if not more:
            raise ProtocolError(Reason.TRUNCATED, f"stream ended after {len(buf)} of {n} bytes")
        buf += more
    return bytes(buf)


# --------------------------------------------------------------------------------------------------
# Messages: encoding, decoding, validation
# --------------------------------------------------------------------------------------------------


def spec(
    *,
    ge: float | None = None,
    le: float | None = None,
    min_len: int | None = None,
    max_len: int | None = None,
    allow_nonfinite: bool = False,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with bounds that :func:`from_map` enforces on decoded input.

    ``ge``/``le`` bound numbers; ``min_len``/``max_len`` bound str, bytes, lists and maps; floats must
    be finite unless ``allow_nonfinite``. A field with a default may be absent from the wire.
    """
    meta = {
        "ge": ge,
        "le": le,
        "min_len": min_len,
        "max_len": max_len,
        "allow_nonfinite": allow_nonfinite,
    }
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"wire": meta})


def to_map(msg: Any) -> dict[str, Any]:
    """Turn a message dataclass (or a plain dict) into the msgpack-ready map that goes on the wire."""
    if isinstance(msg, Mapping):
        return {k: _to_wire(v) for k, v in msg.items()}
    if not (dataclasses.is_dataclass(msg) and not isinstance(msg, type)):
        raise TypeError(f"expected a dataclass instance or a mapping, got {type(msg).__name__}")
    out: dict[str, Any] = {}
    kind = getattr(type(msg), "KIND", None)
    version = getattr(type(msg), "VERSION", None)
    if kind is not None:
        out[KIND_KEY] = kind
    if version is not None:
        out[VERSION_KEY] = version
    for f in dataclasses.fields(msg):
        out[f.name] = _to_wire(getattr(msg, f.name))
    return out


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_map(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_to_wire(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


def encode_msg(msg: Any, *, max_bytes: int = DEFAULT_MAX_MSG_BYTES) -> bytes:
    """Length-prefixed msgpack bytes of ``msg``; refuses to build what a peer would refuse to read."""
    return pack_map(to_map(msg), max_bytes=max_bytes)


async def send_msg(stream: ByteStream, msg: Any, *, max_bytes: int = DEFAULT_MAX_MSG_BYTES) -> None:
    """Send one message (dataclass or dict) as ``u32 length || msgpack``."""
    await stream.write(encode_msg(msg, max_bytes=max_bytes))


async def recv_msg(stream: ByteStream, max_bytes: int = DEFAULT_MAX_MSG_BYTES) -> dict[str, Any]:
    """Receive one message map; the length prefix is checked against ``max_bytes`` before reading on."""
    header = await read_exactly(stream, LENGTH.size, limit=LENGTH.size)
    length = announced_length(header, max_bytes=max_bytes)
    try:
        payload = await read_exactly(stream, length, limit=max_bytes)
    except ProtocolError as exc:
        if exc.reason is Reason.CLOSED:  # the header arrived, so an empty body is a cut message
            raise ProtocolError(Reason.TRUNCATED, exc.detail) from exc
        raise
    return decode_msg(payload, max_bytes=max_bytes)


T = TypeVar("T")


async def recv_as(
    stream: ByteStream, cls: type[T] | tuple[type[T], ...], max_bytes: int = DEFAULT_MAX_MSG_BYTES
) -> T:
    """Receive one message and validate it into ``cls`` (or into whichever of several kinds it is)."""
    return from_map(cls, await recv_msg(stream, max_bytes))


def from_map(cls: type[T] | tuple[type[T], ...], data: Any) -> T:
    """Validate a decoded map into a message dataclass, strictly.

    Checks, in order: it is a map; its kind (``"t"``) is the class's ``KIND`` (with a tuple of
    classes, picks the one whose ``KIND`` matches); its version (``"v"``) is the class's
    ``VERSION``; no unknown keys; every required key present; every value of the annotated type and
    within its :func:`spec` bounds; the dataclass's own ``__post_init__`` accepts it. Anything else
    raises :class:`ProtocolError`.
    """
    if not isinstance(data, dict):
        raise ProtocolError(Reason.MALFORMED, f"expected a map, got {type(data).__name__}")
    if isinstance(cls, tuple):
        kind = data.get(KIND_KEY)
        for candidate in cls:
            if getattr(candidate, "KIND", None) == kind:
                return _from_map(candidate, data, "")
        expected = ", ".join(repr(getattr(c, "KIND", None)) for c in cls)
        raise ProtocolError(Reason.BAD_KIND, f"got kind {_short(kind)}, expected one of {expected}")
    return _from_map(cls, data, "")


@dataclasses.dataclass(frozen=True)
class _FieldInfo:
    name: str
    tp: Any
    required: bool
    bounds: dict[str, Any]


@functools.cache
def _schema(cls: type) -> tuple[_FieldInfo, ...]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    infos = []
    for f in dataclasses.fields(cls):
        if f.name in (KIND_KEY, VERSION_KEY):
            raise TypeError(f"{cls.__name__}.{f.name}: field name reserved for the wire envelope")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        infos.append(_FieldInfo(f.name, hints[f.name], required, dict(f.metadata.get("wire", {}))))
    return tuple(infos)


def _from_map(cls: type[T], data: dict[Any, Any], path: str) -> T:
    where = f" in {path}" if path else ""
    kind = getattr(cls, "KIND", None)
    version = getattr(cls, "VERSION", None)
    if kind is not None and data.get(KIND_KEY) != kind:
        raise ProtocolError(
            Reason.BAD_KIND, f"got kind {_short(data.get(KIND_KEY))}, expected {kind!r}{where}"
        )
    if version is not None:
        got = data.get(VERSION_KEY)
        if type(got) is not int or got != version:
            raise ProtocolError(
                Reason.BAD_VERSION, f"{cls.__name__} version {_short(got)}, this node speaks {version}{where}"
            )
    schema = _schema(cls)
    known = {info.name for info in schema}
    envelope = {KIND_KEY if kind is not None else None, VERSION_KEY if version is not None else None}
    unknown = [k for k in data if k not in known and k not in envelope]
    if unknown:
        raise ProtocolError(Reason.BAD_FIELD, f"unknown field {_short(unknown[0])}{where}")
    kwargs: dict[str, Any] = {}
    for info in schema:
        field_path = f"{path}.{info.name}" if path else info.name
        if info.name not in data:
            if info.required:
                raise ProtocolError(Reason.BAD_FIELD, f"missing field {field_path!r}")
            continue
        value = _coerce(data[info.name], info.tp, field_path)
        _check_bounds(value, info.bounds, field_path)
        kwargs[info.name] = value
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:  # the dataclass's own __post_init__ invariants
        raise ProtocolError(Reason.BAD_FIELD, f"{cls.__name__}{where}: {exc}") from exc


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against annotation ``tp``; returns it converted (tuples, enums, floats)."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        for arg in args:
            if arg is type(None) and value is None:
                return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ProtocolError:
                continue
        raise _type_error(path, tp, value)
    if origin is Literal:
        if any(type(value) is type(a) and value == a for a in args):
            return value
        raise ProtocolError(Reason.BAD_FIELD, f"{path}: {_short(value)} is not one of {list(args)}")
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise _type_error(path, tp, value)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise ProtocolError(Reason.BAD_FIELD, f"{path}: expected {len(args)} items, got {len(value)}")
            return tuple(
                _coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True))
            )
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise _type_error(path, tp, value)
        key_tp, val_tp = args if args else (Any, Any)
        return {
            _coerce(k, key_tp, f"{path}<key>"): _coerce(v, val_tp, f"{path}[{_short(k)}]")
            for k, v in value.items()
        }
    if isinstance(tp, type):
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise _type_error(path, tp, value)
            return _from_map(tp, value, path)
        if issubclass(tp, enum.Enum):
            try:
                return tp(value)
            except ValueError as exc:
                raise ProtocolError(
                    Reason.BAD_FIELD, f"{path}: {_short(value)} is not a valid {tp.__name__}"
                ) from exc
        if tp is bool:
            if type(value) is bool:
                return value
        elif tp is int:
            if type(value) is int:
                return value
        elif tp is float:
            if type(value) in (int, float):
                return float(value)
        elif tp in (str, bytes):
            if type(value) is tp:
                return value
        else:
            raise TypeError(f"{path}: annotation {tp!r} is not supported by the wire validator")
        raise _type_error(path, tp, value)
    raise TypeError(f"{path}: annotation {tp!r} is not supported by the wire validator")


def _check_bounds(value: Any, bounds: dict[str, Any], path: str) -> None:
    if isinstance(value, float) and not bounds.get("allow_nonfinite") and not math.isfinite(value):
        raise ProtocolError(Reason.BAD_FIELD, f"{path}: {value} is not finite")
    ge, le = bounds.get("ge"), bounds.get("le")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if ge is not None and not value >= ge:
            raise ProtocolError(Reason.BAD_FIELD, f"{path}: {value} < {ge}")
        if le is not None and not value <= le:
            raise ProtocolError(Reason.BAD_FIELD, f"{path}: {value} > {le}")
    min_len, max_len = bounds.get("min_len"), bounds.get("max_len")
    if isinstance(value, (str, bytes, list, tuple, dict)):
        if min_len is not None and len(value) < min_len:
            raise ProtocolError(Reason.BAD_FIELD, f"{path}: length {len(value)} < {min_len}")
        if max_len is not None and len(value) > max_len:
            raise ProtocolError(Reason.BAD_FIELD, f"{path}: length {len(value)} > {max_len}")


def _type_error(path: str, tp: Any, value: Any) -> ProtocolError:
    name = getattr(tp, "__name__", None) or str(tp)
    return ProtocolError(Reason.BAD_FIELD, f"{path}: expected {name}, got {type(value).__name__}")


def _short(value: Any, limit: int = 40) -> str:
    """repr() of peer-supplied data, clipped so hostile input cannot flood logs."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------------------------------
# Frame channels (bulk bytes)
# --------------------------------------------------------------------------------------------------

#: Frame header shared by both frame channels: ``u32 length || u8 kind``.
FRAME_HEADER = struct.Struct(">IB")
FRAME_DATA = 0
FRAME_CLOSE = 1
#: Default largest frame payload: big enough to amortise per-frame costs, small enough to keep a
#: receiver's buffers and latency small.
DEFAULT_MAX_FRAME = 1 << 20


@runtime_checkable
class FrameChannel(Protocol):
    """A duplex pipe of delimited frames of at most ``max_frame_size`` bytes.

    ``send`` and ``recv`` may run concurrently in two tasks (one each); ``recv``/``recv_into`` return
    ``b""``/``0`` once the peer has closed cleanly (``close_send`` or ``aclose``), and raise
    :class:`ProtocolError` if the stream ends any other way. ``bytes_sent``/``bytes_received`` count
    bytes on the wire, framing included, for metrics.
    """

    max_frame_size: int
    bytes_sent: int
    bytes_received: int

    async def send(self, data: Buffer) -> None: ...

    async def recv(self) -> bytes: ...

    async def recv_into(self, buf: Buffer) -> int: ...

    async def close_send(self) -> None: ...

    async def aclose(self) -> None: ...


class PlainFrameChannel:
    """:class:`FrameChannel` over a :class:`ByteStream`, without encryption of its own.

    This is the fallback data path: used over a libp2p stream, Noise already authenticates and
    encrypts the bytes, so adding a second layer would only cost CPU. It may share the control stream
    (frames between two messages); in that case end with :meth:`close_send` rather than :meth:`aclose`,
    which closes the stream underneath.
    """

    def __init__(self, stream: ByteStream, *, max_frame_size: int = DEFAULT_MAX_FRAME) -> None:
        self.stream = stream
        self.max_frame_size = max_frame_size
        self._send_lock = trio.Lock()
        self._recv_lock = trio.Lock()
        self._sent_close = False
        self._got_close = False
        self.bytes_sent = 0
        self.bytes_received = 0

    async def send(self, data: Buffer) -> None:
        size = memoryview(data).nbytes
        if not 0 < size <= self.max_frame_size:
            raise ValueError(f"frame payload must be 1..{self.max_frame_size} bytes, got {size}")
        async with self._send_lock:
            if self._sent_close:
                raise trio.ClosedResourceError("frame channel already closed for sending")
            await self.stream.write(FRAME_HEADER.pack(size, FRAME_DATA) + bytes(data))
            self.bytes_sent += FRAME_HEADER.size + size

    async def _next_size(self, room: int) -> int:
        """Read one frame header; returns the payload size (0 after a clean close), checked against ``room``."""
        if self._got_close:
            return 0
        header = await read_exactly(self.stream, FRAME_HEADER.size, limit=FRAME_HEADER.size)
        self.bytes_received += FRAME_HEADER.size
        size, kind = FRAME_HEADER.unpack(header)
        if kind == FRAME_CLOSE and size == 0:
            self._got_close = True
            return 0
        if kind != FRAME_DATA or size == 0:
            raise ProtocolError(Reason.MALFORMED, f"frame kind {kind} with {size} bytes")
        if size > self.max_frame_size:
            raise ProtocolError(Reason.TOO_LARGE, f"frame of {size} bytes, limit {self.max_frame_size}")
        if size > room:
            raise ProtocolError(Reason.BAD_SIZE, f"frame of {size} bytes, room for {room}")
        return size

    async def _read_payload(self, size: int) -> bytes:
        try:
            payload = await read_exactly(self.stream, size, limit=self.max_frame_size)
            self.bytes_received += size
            return payload
        except ProtocolError as exc:
            if exc.reason is Reason.CLOSED:  # the header arrived, so a missing body is a cut frame
                raise ProtocolError(Reason.TRUNCATED, exc.detail) from exc
            raise

    async def recv(self) -> bytes:
        async with self._recv_lock:
            size = await self._next_size(self.max_frame_size)
            return await self._read_payload(size) if size else b""

    async def recv_into(self, buf: Buffer) -> int:
        """Receive one frame into ``buf``; a frame larger than ``buf`` is refused before it is read."""
        target = memoryview(buf).cast("B")
        async with self._recv_lock:
            size = await self._next_size(len(target))
            if size:
                target[:size] = await self._read_payload(size)
            return size

    async def aclose(self) -> None:
        """Tell the peer we are done (best effort), then close the underlying stream."""
        try:
            async with self._send_lock:
                if not self._sent_close:
                    self._sent_close = True
                    with trio.move_on_after(2):
                        await self.stream.write(FRAME_HEADER.pack(0, FRAME_CLOSE))
                        self.bytes_sent += FRAME_HEADER.size
        except ProtocolError:
            pass  # the stream is already broken; closing it is all that is left to do
        finally:
            await self.stream.aclose()

    async def close_send(self) -> None:
        """Send the end-of-stream marker but keep receiving (half-close)."""
        async with self._send_lock:
            if not self._sent_close:
                self._sent_close = True
                await self.stream.write(FRAME_HEADER.pack(0, FRAME_CLOSE))
                self.bytes_sent += FRAME_HEADER.size


async def close_quietly(stream: Any, *, reset: bool = False, timeout: float = 1.0) -> None:
    """Close (or reset) a libp2p stream at the end of an exchange, whatever state it is in.

    Shielded and bounded: it runs in `finally` blocks of cancelled tasks, and a partner that is already
    gone must neither raise nor hold us. Use `reset=True` after a failure so the partner sees an abort.
    Nothing is read from the stream afterwards, so what the partner still sends is dropped, not buffered
    (`p2p.limits.stop_receiving`).
    """
    from p2p.limits import stop_receiving  # lazily: it imports libp2p, which pure-wire users need not pay

    stop_receiving(stream)
    with trio.move_on_after(timeout) as scope:
        scope.shield = True
        try:
            await (stream.reset() if reset else stream.close())
        except Exception:  # the stream or its connection is already gone
            pass


@contextlib.contextmanager
def single_error() -> Iterator[None]:
    """Around a nursery: a group of one error comes out as that error. Why: trio groups even the body's own
    exception, and callers catch `ProtocolError` or `trio.TooSlowError` by type (protocols/avg.py `watched`,
    p2p/datapath.py `preconnect`). A group of several stays a group."""
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
