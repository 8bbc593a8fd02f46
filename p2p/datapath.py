"""The fast data path: an encrypted, authenticated TCP side channel for bulk tensor bytes.

Why it exists: py-libp2p streams (Noise + yamux) move ~320 MB/s on loopback against ~2 GB/s for a raw
TCP socket, and averaging ships a whole model each way every outer step. So the libp2p stream carries
only control messages, and the bulk bytes go over a plain TCP connection protected here.

How it is secured, in order:

1. **Key agreement over the control stream.** Each side creates a :class:`KeyAgreement` (an ephemeral
   X25519 key) and sends its public key over the libp2p stream, which Noise already authenticates to
   the peer's PeerID; the responder also sends a random session id and its data-path port.
2. **Key derivation.** HKDF-SHA256 over the X25519 secret, with the session id as salt and a
   transcript as info (protocol tag, libp2p protocol id, both PeerIDs, both ephemeral public keys,
   the session id), gives two AES-256-GCM keys, one per direction. Keys are therefore bound to this
   pair of peers, this protocol and this exchange, and never reused.
3. **Connection.** The initiator connects to the responder's :class:`DataPathListener` (one port per
   daemon, many sessions), sends ``magic || session id`` in clear so the listener can find the keys,
   then an encrypted HELLO; the listener answers with an encrypted ACK. Both frames prove knowledge of
   the session keys, so a connection that is not from the partner is dropped without consuming the
   session. The initiator need not wait for the ACK to go on (``await_ack=False``): it tells its partner
   the path at once and reads the ACK before its first byte of bulk, a round trip sooner; and it may
   dial the listener early, with the request, to the port of its last exchange (:func:`preconnect`).
4. **Frames.** ``u32 length || u8 kind || AES-GCM(payload)`` with the 5-byte header as associated
   data and a per-direction frame counter as nonce. The receiver supplies the counter it expects, so a
   replayed, reordered, dropped, truncated or tampered frame fails authentication; a clean end of
   stream is itself an authenticated CLOSE frame, so cutting the TCP connection cannot pass for one.

Where no direct path exists, callers use :class:`p2p.wire.PlainFrameChannel` over a libp2p
stream instead; both implement :class:`p2p.wire.FrameChannel`.

Small frames (handshake, tests) go through the async methods on the trio thread. A bulk transfer runs
in two OS threads, one per direction, with blocking socket calls (:meth:`SecureChannel.run_in_threads`):
``cryptography``'s AES-GCM (~10 GB/s per core here), the socket calls and torch all release the GIL, so
the directions proceed in parallel and the event loop stays free.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import math
import os
import socket
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

import trio
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from p2p.wire import (
    DEFAULT_MAX_FRAME,
    FRAME_CLOSE,
    FRAME_DATA,
    FRAME_HEADER,
    Buffer,
    ProtocolError,
    Reason,
    single_error,
)

__all__ = [
    "PUBLIC_KEY_LEN",
    "SESSION_ID_LEN",
    "BlockingFrames",
    "DataPathListener",
    "Expectation",
    "KeyAgreement",
    "Role",
    "SecureChannel",
    "Preconnect",
    "SessionKeys",
    "connect_datapath",
    "new_session_id",
    "open_punched",
    "preconnect",
]

PUBLIC_KEY_LEN = 32
SESSION_ID_LEN = 16
TAG_LEN = 16
#: Sent in clear before the session id so stray connections (port scanners, other protocols) fail fast.
MAGIC = b"STRLDP1\n"
#: Domain separation for HKDF: keys derived here can never collide with keys derived elsewhere.
KDF_LABEL = b"starling/datapath/1"
FRAME_HELLO = 2
FRAME_ACK = 3
_KNOWN_KINDS = {FRAME_DATA, FRAME_CLOSE, FRAME_HELLO, FRAME_ACK}
_NONCE_PREFIX = bytes(4)
#: A blocking transfer thread gives up when its socket moves no byte for this long. The caller's deadline
#: (trio cancellation, which shuts the socket down) normally ends a stuck transfer long before.
BLOCKING_STALL_S = 60.0
# The TCP congestion control the side channel asks its socket for (`prefer_congestion`): BBR paces by the
# bandwidth and round trip it measures, where a loss-based one (CUBIC, most hosts' default) halves its window
# at each loss; over a long path that loses 1% of its packets that is a few hundred kbit/s whatever the link.
CONGESTION = b"bbr"
_TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", 13)  # Linux's option number where Python does not name it
T = TypeVar("T")
U = TypeVar("U")
_MAX_COUNTER = (1 << 64) - 1


class Role(enum.StrEnum):
    """Who connects: the initiator dials the responder's listener. Also selects the key direction."""

    INITIATOR = "initiator"
    RESPONDER = "responder"


@dataclass(frozen=True)
class SessionKeys:
    """Everything one side needs to open or accept one data-path session."""

    session_id: bytes
    role: Role
    send_key: bytes = field(repr=False)
    recv_key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.session_id) != SESSION_ID_LEN:
            raise ValueError(f"session id must be {SESSION_ID_LEN} bytes")
        if len(self.send_key) != 32 or len(self.recv_key) != 32 or self.send_key == self.recv_key:
            raise ValueError("session keys must be two distinct 32-byte keys")


def new_session_id() -> bytes:
    """A fresh random session id (the responder picks it, since its listener demultiplexes on it)."""
    return os.urandom(SESSION_ID_LEN)


class KeyAgreement:
    """One side's ephemeral X25519 key for exactly one session.

    Send :attr:`public_key` to the peer over the authenticated control stream, then call
    :meth:`derive` with the peer's public key. The private key never leaves this object and the object
    refuses a second derivation, so an ephemeral key cannot be reused by accident.
    """

    def __init__(self) -> None:
        self._private: X25519PrivateKey | None = X25519PrivateKey.generate()
        self.public_key: bytes = self._private.public_key().public_bytes_raw()

    def derive(
        self,
        *,
        role: Role,
        peer_public_key: bytes,
        session_id: bytes,
        local_peer_id: bytes,
        remote_peer_id: bytes,
        protocol_id: str,
    ) -> SessionKeys:
        """Derive this side's :class:`SessionKeys`.

        ``local_peer_id``/``remote_peer_id`` are the libp2p PeerIDs as bytes (``ID.to_bytes()``) of
        the Noise-authenticated connection the public keys travelled over; ``protocol_id`` is that
        stream's protocol. A malformed or low-order peer key raises :class:`ProtocolError`.
        """
        if self._private is None:
            raise RuntimeError("KeyAgreement.derive called twice: ephemeral keys are single-use")
        if len(peer_public_key) != PUBLIC_KEY_LEN or len(session_id) != SESSION_ID_LEN:
            raise ProtocolError(Reason.BAD_FIELD, "data-path public key or session id has the wrong length")
        private, self._private = self._private, None
        try:
            shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public_key))
        except ValueError as exc:  # all-zero shared secret: the peer sent a low-order point
            raise ProtocolError(Reason.AUTH, "unusable data-path public key") from exc
        if role is Role.INITIATOR:
            ids = (local_peer_id, remote_peer_id)
            pubs = (self.public_key, peer_public_key)
        else:
            ids = (remote_peer_id, local_peer_id)
            pubs = (peer_public_key, self.public_key)
        transcript = b"".join(
            _length_prefixed(part) for part in (KDF_LABEL, protocol_id.encode(), *ids, *pubs, session_id)
        )
        okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=session_id, info=transcript).derive(shared)
        initiator_to_responder, responder_to_initiator = okm[:32], okm[32:]
        if role is Role.INITIATOR:
            return SessionKeys(session_id, role, initiator_to_responder, responder_to_initiator)
        return SessionKeys(session_id, role, responder_to_initiator, initiator_to_responder)


def _length_prefixed(part: bytes) -> bytes:
    """Unambiguous concatenation: no two different transcripts serialise to the same bytes."""
    return struct.pack(">I", len(part)) + part


def _nonce(counter: int) -> bytes:
    return _NONCE_PREFIX + counter.to_bytes(8, "big")


def prefer_congestion(sock: Any, name: bytes = CONGESTION) -> str | None:
    """Ask for congestion control `name` on `sock` and return the one the socket uses (None: not a TCP
    socket of this kernel's kind). A kernel without it, or a process that may not choose it (outside
    `net.ipv4.tcp_allowed_congestion_control` without CAP_NET_ADMIN), keeps the host's default: a channel
    is never refused for it. Both ends ask: each direction's sender decides how it paces.

    `sock`: a stdlib or trio socket (both have these calls, and trio's are synchronous).

    Why: bulk tensors cross long paths that lose packets, and a loss-based congestion control turns 1% loss
    at 300 ms of round trip into a few hundred kbit/s, whatever the link's rate (issue #50;
    bench/congestion.py measures it in the network lab)."""
    if not hasattr(sock, "getsockopt"):
        return None
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, name)
    try:
        used = sock.getsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, 16)
    except OSError:
        return None
    return used.split(b"\0", 1)[0].decode("ascii", "replace") or None


class SecureChannel:
    """An AES-256-GCM framed channel over a TCP stream (implements ``p2p.wire.FrameChannel``).

    One task may send while another receives (the exchange streams both ways at once, and must, or
    both sides' socket buffers fill and the transfer deadlocks). Once any operation fails, the channel
    is unusable: a half-sent or unauthenticated frame cannot be recovered from.
    """

    def __init__(
        self, stream: trio.SocketStream, keys: SessionKeys, *, max_frame_size: int = DEFAULT_MAX_FRAME
    ) -> None:
        if not 0 < max_frame_size <= (1 << 31):
            raise ValueError(f"max_frame_size out of range: {max_frame_size}")
        self.stream = stream
        self.session_id = keys.session_id
        self.max_frame_size = max_frame_size
        # The congestion control its socket paces the bulk with (None: not a kernel TCP socket, as in tests).
        self.congestion = prefer_congestion(getattr(stream, "socket", None))
        self._seal_key = AESGCM(keys.send_key)
        self._open_key = AESGCM(keys.recv_key)
        self._send_counter = 0
        self._recv_counter = 0
        # Reusable buffers: one frame each way, so a channel costs ~2 frames of memory at any model size.
        self._send_buf = memoryview(bytearray(FRAME_HEADER.size + max_frame_size + TAG_LEN))
        self._recv_buf = memoryview(bytearray(max_frame_size + TAG_LEN))
        self._send_lock = trio.Lock()
        self._recv_lock = trio.Lock()
        self._sent_close = False
        self._got_close = False
        self._failed = False
        self._ack_due = False  # an initiator's HELLO was sent and the listener's ACK not read yet
        self.bytes_sent = 0
        self.bytes_received = 0
        # Told the size of every piece that crosses the socket, either way (from the transfer threads too):
        # how a transfer's owner tells a slow link that is moving from a dead one (protocols/avg.py).
        self.on_bytes: Callable[[int], None] | None = None

    async def await_ack(self, *, timeout: float) -> None:
        """Read the listener's ACK that :func:`connect_datapath` left unread (``await_ack=False``): its
        proof that it holds this session's keys, which must come before our first byte of bulk. Raises
        ``trio.TooSlowError`` past ``timeout`` and :class:`ProtocolError` for anything but the ACK."""
        if self._ack_due:
            with trio.fail_after(timeout):
                await self._recv_frame(memoryview(bytearray(0)), accept={FRAME_ACK})
            self._ack_due = False

    def _check_acked(self) -> None:
        if self._ack_due:
            raise RuntimeError("the listener's ACK is unread: await_ack() before the bulk")

    # -- sending ---------------------------------------------------------------------------------

    async def send(self, data: Buffer) -> None:
        """Encrypt and send one frame of 1..``max_frame_size`` bytes."""
        size = memoryview(data).nbytes
        if not 0 < size <= self.max_frame_size:
            raise ValueError(f"frame payload must be 1..{self.max_frame_size} bytes, got {size}")
        self._check_acked()
        await self._send_frame(FRAME_DATA, data)

    async def close_send(self) -> None:
        """Send the authenticated end-of-stream marker; receiving continues (half-close)."""
        await self._send_frame(FRAME_CLOSE, b"")

    async def _send_frame(self, kind: int, data: Buffer) -> None:
        async with self._send_lock:
            frame = self._seal(kind, data)
            try:
                await self.stream.send_all(frame)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self._failed = True
                raise ProtocolError(Reason.BROKEN, f"data path send failed: {exc}") from exc
            except BaseException:
                self._failed = True  # cancelled mid-frame: the byte stream is no longer aligned
                raise
            self.bytes_sent += len(frame)
            self._moved(len(frame))

    def _moved(self, n: int) -> None:
        if self.on_bytes is not None and n > 0:
            self.on_bytes(n)

    def _seal(self, kind: int, data: Buffer) -> memoryview:
        """Encrypt one frame into the send buffer; returns the bytes to put on the wire."""
        if self._sent_close:
            raise trio.ClosedResourceError("secure channel already closed for sending")
        self._check_usable()
        size = memoryview(data).nbytes
        if self._send_counter > _MAX_COUNTER:
            raise ProtocolError(Reason.AUTH, "frame counter exhausted")
        header = FRAME_HEADER.pack(size + TAG_LEN, kind)
        frame = self._send_buf[: FRAME_HEADER.size + size + TAG_LEN]
        frame[: FRAME_HEADER.size] = header
        self._seal_key.encrypt_into(_nonce(self._send_counter), data, header, frame[FRAME_HEADER.size :])
        self._send_counter += 1
        if kind == FRAME_CLOSE:
            self._sent_close = True
        return frame

    # -- receiving -------------------------------------------------------------------------------

    async def recv(self) -> bytes:
        """Receive one frame; ``b""`` once the peer has closed cleanly."""
        buf = bytearray(self.max_frame_size)
        n = await self.recv_into(buf)
        return bytes(memoryview(buf)[:n])

    async def recv_into(self, buf: Buffer) -> int:
        """Receive one frame into ``buf``; returns its size, 0 after the peer's clean close.

        A frame larger than ``buf`` is refused before it is read (``BAD_SIZE``). Plaintext is written
        into ``buf`` before the tag is checked, so on error ``buf`` holds garbage and must be discarded.
        """
        self._check_acked()
        target = memoryview(buf).cast("B")
        kind, n = await self._recv_frame(target, accept={FRAME_DATA, FRAME_CLOSE})
        return 0 if kind == FRAME_CLOSE else n

    async def _recv_frame(self, target: memoryview, *, accept: set[int]) -> tuple[int, int]:
        async with self._recv_lock:
            if self._got_close:
                return FRAME_CLOSE, 0
            self._check_usable()
            try:
                header = bytes(
                    await self._read_exactly(self._recv_buf[: FRAME_HEADER.size], at_boundary=True)
                )
                size, kind, plain = self._check_header(header, len(target), accept)
                ciphertext = await self._read_exactly(self._recv_buf[:size], at_boundary=False)
                self._open(header, ciphertext, target[:plain])
            except BaseException:
                self._failed = True
                raise
            return self._opened(kind, size, plain)

    def _check_header(self, header: bytes, room: int, accept: set[int]) -> tuple[int, int, int]:
        """(ciphertext size, kind, plaintext size) of a frame header, refused before its body is read."""
        size, kind = FRAME_HEADER.unpack(header)
        if kind not in _KNOWN_KINDS or kind not in accept:
            raise ProtocolError(Reason.MALFORMED, f"unexpected frame kind {kind}")
        if size < TAG_LEN:
            raise ProtocolError(Reason.MALFORMED, f"frame of {size} bytes is shorter than its tag")
        plain = size - TAG_LEN
        if plain > self.max_frame_size:
            raise ProtocolError(Reason.TOO_LARGE, f"frame of {plain} bytes, limit {self.max_frame_size}")
        if kind == FRAME_DATA and not 0 < plain <= room:
            raise ProtocolError(Reason.BAD_SIZE, f"data frame of {plain} bytes, room for {room}")
        if kind != FRAME_DATA and plain != 0:
            raise ProtocolError(Reason.MALFORMED, f"control frame kind {kind} with a payload")
        return size, kind, plain

    def _open(self, header: bytes, ciphertext: memoryview, target: memoryview) -> None:
        try:
            self._open_key.decrypt_into(_nonce(self._recv_counter), ciphertext, header, target)
        except InvalidTag:
            raise ProtocolError(
                Reason.AUTH, f"frame {self._recv_counter} failed authentication (tampered or replayed)"
            ) from None

    def _opened(self, kind: int, size: int, plain: int) -> tuple[int, int]:
        self._recv_counter += 1
        self.bytes_received += FRAME_HEADER.size + size
        if kind == FRAME_CLOSE:
            self._got_close = True
        return kind, plain

    async def _read_exactly(self, view: memoryview, *, at_boundary: bool) -> memoryview:
        """Fill ``view`` from the socket straight into our buffer (no intermediate ``bytes``)."""
        got = 0
        sock = self.stream.socket
        while got < len(view):
            try:
                n = await sock.recv_into(view[got:])
            except (OSError, trio.ClosedResourceError) as exc:
                raise ProtocolError(Reason.BROKEN, f"data path receive failed: {exc}") from exc
            if n == 0:
                # Without an authenticated CLOSE frame, any EOF is a cut: the peer (or someone) stopped us.
                where = "between frames" if at_boundary and got == 0 else "inside a frame"
                raise ProtocolError(Reason.TRUNCATED, f"data path connection ended {where}")
            got += n
            self._moved(n)
        return view

    # -- bulk transfer in threads ----------------------------------------------------------------

    async def run_in_threads(
        self, send_job: Callable[[BlockingFrames], T], recv_job: Callable[[BlockingFrames], U]
    ) -> tuple[T, U]:
        """Run one sending and one receiving job, each in its own OS thread on blocking socket calls.

        Why: on the event loop, one core does the encryption, the decryption, the kernel copies both
        ways and the caller's per-chunk work, and a pair of daemons moved ~0.4x what raw TCP moves.
        ``cryptography``'s AES-GCM, socket calls and torch all release the GIL, so a thread per
        direction runs them in parallel and keeps trio out of the per-frame path.

        The jobs get a :class:`BlockingFrames` (``send``/``recv_into`` with this channel's framing and
        keys). Cancelling the caller (its deadline) shuts the socket down, which wakes both threads; this
        returns only once both have stopped, so nothing they write into outlives the call.
        """
        self._check_acked()
        async with self._send_lock, self._recv_lock:
            self._check_usable()
            # A second descriptor for the same connection: Python's blocking calls with a timeout poll the
            # (shared, non-blocking) descriptor themselves, so trio's socket object is left as it was.
            sock = socket.socket(fileno=os.dup(self.stream.socket.fileno()))
            sock.settimeout(BLOCKING_STALL_S)
            restore_lowat = _lift_notsent_lowat(sock)
            frames = BlockingFrames(self, sock)
            done = 0
            cancelled = False
            failures: list[Exception] = []
            results: list[Any] = [None, None]

            async def run(i: int, job: Callable[[BlockingFrames], Any]) -> None:
                nonlocal done
                try:
                    results[i] = await trio.to_thread.run_sync(job, frames, limiter=limiter)
                except Exception as exc:
                    if cancelled:
                        # The thread failed because we shut its socket down on cancellation: report the
                        # cancellation (a deadline), not the broken socket it caused.
                        await trio.lowlevel.checkpoint()
                    failures.append(exc)  # before the abort: the first failure is the cause
                    frames.abort()  # wake the other thread: the transfer is over either way
                    raise
                done += 1
                if done == 2:
                    nursery.cancel_scope.cancel()  # both finished: stop the watcher below

            async def abort_on_cancel() -> None:
                nonlocal cancelled
                try:
                    await trio.sleep_forever()
                finally:
                    if done < 2 and not failures:  # cancelled from outside, not after a job failed
                        cancelled = True
                        frames.abort()

            limiter = trio.CapacityLimiter(2)  # both threads start at once, whatever else uses threads
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(run, 0, send_job)
                    nursery.start_soon(run, 1, recv_job)
                    nursery.start_soon(abort_on_cancel)
            except BaseExceptionGroup:
                self._failed = True
                # One side's error ends both (the other only saw the shutdown it caused): report the cause.
                if failures:
                    raise failures[0] from None
                raise
            except BaseException:
                self._failed = True
                raise
            finally:
                restore_lowat()
                sock.close()  # the duplicate only: the connection stays open until aclose
            return results[0], results[1]

    # -- lifecycle -------------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._failed:
            raise ProtocolError(Reason.BROKEN, "secure channel failed earlier")

    async def aclose(self, *, timeout: float = 2.0) -> None:
        """Send CLOSE (best effort, bounded by ``timeout``) and close the socket."""
        try:
            if not self._sent_close and not self._failed:
                with trio.move_on_after(timeout) as scope:
                    scope.shield = True
                    await self.close_send()
        except (ProtocolError, trio.ClosedResourceError, trio.BusyResourceError):
            pass  # nothing more to tell a peer we cannot reach
        finally:
            await trio.aclose_forcefully(self.stream)

    async def __aenter__(self) -> SecureChannel:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


def _lift_notsent_lowat(sock: socket.socket) -> Callable[[], None]:
    """Let the kernel hold as much unsent data as the send buffer allows, for the length of a bulk
    transfer; returns the function that puts the connection's previous limit back.

    Why: ``trio.SocketStream`` sets ``TCP_NOTSENT_LOWAT`` to 16 KiB on every TCP connection (a latency
    setting for an event loop). On this connection it caps the not-yet-sent queue at about 64 KB, and a
    blocking ``sendall`` of a 1 MiB frame sleeps until less than 8 KB of it is left: the sending thread
    must wake up, win the GIL and refill every few milliseconds, and whenever it is late the socket
    idles and the congestion control sees an application-limited sender. Over a 100 Mbit/s tbf link in
    the network lab, both directions at once, that cost 5-10 % of the throughput, plain Python sockets
    given the same option included. 0 means the system default (no limit unless configured).
    The option is per connection, so it applies to the trio stream too; it is restored because the
    channel's async methods may still run after the transfer (the CLOSE frame).
    """
    option = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    if option is None:  # not Linux or macOS: trio set nothing either
        return lambda: None
    try:
        previous = sock.getsockopt(socket.IPPROTO_TCP, option)
        sock.setsockopt(socket.IPPROTO_TCP, option, 0)
    except OSError:
        return lambda: None

    def restore() -> None:
        with contextlib.suppress(OSError):  # the connection may already be gone
            sock.setsockopt(socket.IPPROTO_TCP, option, previous)

    return restore


class BlockingFrames:
    """A :class:`SecureChannel`'s framing on blocking socket calls, for the two threads of
    :meth:`SecureChannel.run_in_threads` (one calls :meth:`send`, the other :meth:`recv_into`)."""

    def __init__(self, channel: SecureChannel, sock: socket.socket) -> None:
        self._channel = channel
        self._sock = sock
        self._aborted = False

    def send(self, data: Buffer) -> None:
        """Encrypt and send one data frame of 1..``max_frame_size`` bytes."""
        ch = self._channel
        size = memoryview(data).nbytes
        if not 0 < size <= ch.max_frame_size:
            raise ValueError(f"frame payload must be 1..{ch.max_frame_size} bytes, got {size}")
        frame = ch._seal(FRAME_DATA, data)
        try:
            self._sock.sendall(frame)
        except OSError as exc:
            raise self._broken("send", exc) from None
        ch.bytes_sent += len(frame)
        ch._moved(len(frame))

    def recv_into(self, buf: Buffer) -> int:
        """Receive one data frame into ``buf``; its size, or 0 after the peer's clean close."""
        ch = self._channel
        if ch._got_close:
            return 0
        target = memoryview(buf).cast("B")
        header = bytes(self._read_exactly(ch._recv_buf[: FRAME_HEADER.size], at_boundary=True))
        size, kind, plain = ch._check_header(header, len(target), {FRAME_DATA, FRAME_CLOSE})
        ch._open(header, self._read_exactly(ch._recv_buf[:size], at_boundary=False), target[:plain])
        kind, plain = ch._opened(kind, size, plain)
        return 0 if kind == FRAME_CLOSE else plain

    def abort(self) -> None:
        """Wake a thread blocked in this connection (called from the event loop on cancel or error)."""
        self._aborted = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def _read_exactly(self, view: memoryview, *, at_boundary: bool) -> memoryview:
        got = 0
        while got < len(view):
            try:
                n = self._sock.recv_into(view[got:])
            except OSError as exc:
                raise self._broken("receive", exc) from None
            if n == 0:
                if self._aborted:
                    raise ProtocolError(Reason.BROKEN, "data path transfer aborted")
                where = "between frames" if at_boundary and got == 0 else "inside a frame"
                raise ProtocolError(Reason.TRUNCATED, f"data path connection ended {where}")
            got += n
            self._channel._moved(n)
        return view

    def _broken(self, what: str, exc: OSError) -> ProtocolError:
        if isinstance(exc, TimeoutError):
            return ProtocolError(Reason.BROKEN, f"data path {what} stalled for {BLOCKING_STALL_S:.0f}s")
        return ProtocolError(Reason.BROKEN, f"data path {what} failed: {exc}")


# --------------------------------------------------------------------------------------------------
# Initiator side
# --------------------------------------------------------------------------------------------------


async def connect_datapath(
    address: tuple[str, int],
    keys: SessionKeys,
    *,
    timeout: float,
    max_frame_size: int = DEFAULT_MAX_FRAME,
    stream: trio.SocketStream | None = None,
    await_ack: bool = True,
) -> SecureChannel:
    """Dial the partner's data-path listener and authenticate the session (initiator side).

    Raises ``trio.TooSlowError`` past ``timeout``, and :class:`ProtocolError` if nothing listens at
    ``address`` (``BROKEN``: fall back to the libp2p stream) or the listener does not prove knowledge of
    the session keys.

    ``stream``: a connection to ``address`` opened already (:func:`preconnect`), used instead of dialling.
    ``await_ack`` False returns once the HELLO is sent, without waiting for the listener's ACK: the caller
    then tells its partner the path at once and awaits the ACK with :meth:`SecureChannel.await_ack` before
    its first byte of bulk, which saves the round trip between the ACK and the partner's first byte.
    """
    if keys.role is not Role.INITIATOR:
        raise ValueError("connect_datapath needs initiator keys")
    host, port = address
    with trio.fail_after(timeout):
        if stream is None:
            try:
                stream = await trio.open_tcp_stream(host, port)
            except OSError as exc:
                raise ProtocolError(Reason.BROKEN, f"no data path at {host}:{port}: {exc}") from exc
        channel = await _hello(stream, keys, max_frame_size)
        if await_ack:
            await channel.await_ack(timeout=math.inf)
        return channel


async def _hello(stream: trio.SocketStream, keys: SessionKeys, max_frame_size: int) -> SecureChannel:
    """The initiator's half of the session handshake on a connected stream: the preamble and HELLO sent,
    the listener's ACK still to be read (:meth:`SecureChannel.await_ack`). Closed on failure."""
    try:
        await stream.send_all(MAGIC + keys.session_id)
        channel = SecureChannel(stream, keys, max_frame_size=max_frame_size)
        await channel._send_frame(FRAME_HELLO, b"")
        channel._ack_due = True
        return channel
    except trio.BrokenResourceError as exc:  # a connection the listener closed meanwhile: no path there
        await trio.aclose_forcefully(stream)
        raise ProtocolError(Reason.BROKEN, f"data path connection lost before the handshake: {exc}") from exc
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise


PRECONNECT_FRESH_S = 5.0  # a pre-dialled connection older than this is not used (`Preconnect.take`)


class Preconnect:
    """A TCP connection to a partner's data-path listener, dialled while the exchange's handshake is under
    way (:func:`preconnect`), so that the side channel's connect costs no round trip of its own.

    Why a guess: the listener's port comes in the partner's answer, one round trip after the request; the
    port of the last exchange with that partner is almost always the same (one listener per daemon). A
    guess that does not match the answer is closed unused (the listener counts it as rejected)."""

    def __init__(self, address: tuple[str, int] | None) -> None:
        self.address = address
        self.stream: trio.SocketStream | None = None
        self.connected_at = 0.0
        self.done = trio.Event()
        # The dial's own scope: cancelling the nursery's instead would also swallow a cancellation of the
        # caller's that is on its way out through the body (an inner cancelled scope catches it).
        self._scope = trio.CancelScope()

    async def _run(self, timeout: float) -> None:
        assert self.address is not None
        try:
            with self._scope, trio.move_on_after(timeout):
                self.stream = await trio.open_tcp_stream(*self.address)
                self.connected_at = trio.current_time()
        except OSError:
            pass  # the exchange dials as before
        finally:
            self.done.set()

    async def take(self, address: tuple[str, int]) -> trio.SocketStream | None:
        """The connection if it was dialled to `address` and is up (waiting for the dial, which is
        bounded), else None; the caller owns what it takes. One held longer than `PRECONNECT_FRESH_S`
        is closed instead: the listener drops a connection that names no session for its handshake
        timeout (10 s), and a long handshake (a slow partner's answer) must not meet one it dropped."""
        if self.address != address:
            return None
        await self.done.wait()
        stream, self.stream = self.stream, None
        if stream is not None and trio.current_time() - self.connected_at > PRECONNECT_FRESH_S:
            await trio.aclose_forcefully(stream)
            return None
        return stream


@contextlib.asynccontextmanager
async def preconnect(address: tuple[str, int] | None, *, timeout: float) -> AsyncIterator[Preconnect]:
    """Dial `address` (None: nothing) in the background for the body; a connection not taken by then is
    closed on the way out."""
    early = Preconnect(address)
    with single_error():  # the body's own error, as it was raised (the dial raises none)
        async with trio.open_nursery() as nursery:
            if address is not None:
                nursery.start_soon(early._run, timeout)
            else:
                early.done.set()
            try:
                yield early
            finally:
                early._scope.cancel()
                if early.stream is not None:
                    await trio.aclose_forcefully(early.stream)
                    early.stream = None


async def _read_preamble(stream: trio.SocketStream) -> bytes | None:
    """``magic || session id`` from a new connection: the session id, or None for anything else."""
    preamble = bytearray(len(MAGIC) + SESSION_ID_LEN)
    view, got = memoryview(preamble), 0
    while got < len(preamble):
        n = await stream.socket.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    if bytes(preamble[: len(MAGIC)]) != MAGIC:
        return None
    return bytes(preamble[len(MAGIC) :])


async def open_punched(
    stream: trio.SocketStream, keys: SessionKeys, *, timeout: float, max_frame_size: int = DEFAULT_MAX_FRAME
) -> SecureChannel:
    """The session handshake on a connection both sides opened at once (``p2p.punch``): the initiator
    speaks as if it had dialled a listener, the responder answers as its listener would. The stream is
    closed on failure; ``trio.TooSlowError`` past ``timeout``."""
    with trio.fail_after(timeout):
        if keys.role is Role.INITIATOR:
            channel = await _hello(stream, keys, max_frame_size)
            await channel.await_ack(timeout=math.inf)
            return channel
        try:
            if await _read_preamble(stream) != keys.session_id:
                raise ProtocolError(Reason.AUTH, "the punched connection did not name our session")
            channel = SecureChannel(stream, keys, max_frame_size=max_frame_size)
            await channel._recv_frame(memoryview(bytearray(0)), accept={FRAME_HELLO})
            await channel._send_frame(FRAME_ACK, b"")
            return channel
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise


# --------------------------------------------------------------------------------------------------
# Responder side
# --------------------------------------------------------------------------------------------------


class Expectation:
    """A registered, not yet connected session on a :class:`DataPathListener`.

    Use as an async context manager around the moment the session id is announced, so that the
    registration exists before the partner can possibly connect, and is removed (and any channel that
    arrived but was not collected is closed) however the block exits::

        async with listener.expect(keys, timeout=10) as pending:
            await send_msg(control, Accept(session_id=keys.session_id, ...))
            channel = await pending.wait()
    """

    def __init__(self, listener: DataPathListener, keys: SessionKeys, deadline: float) -> None:
        self.keys = keys
        self.deadline = deadline
        self._listener = listener
        self._arrived = trio.Event()
        self._channel: SecureChannel | None = None
        self._error: ProtocolError | None = None
        self._taken = False
        self.closed = False

    async def wait(self) -> SecureChannel:
        """The authenticated channel once the partner connects; ``trio.TooSlowError`` at the deadline."""
        with trio.fail_at(self.deadline):
            await self._arrived.wait()
        if self._error is not None:
            raise self._error
        assert self._channel is not None
        self._taken = True
        return self._channel

    def _deliver(self, channel: SecureChannel | None, error: ProtocolError | None = None) -> bool:
        if self.closed or self._arrived.is_set():
            return False
        self._channel, self._error = channel, error
        self._arrived.set()
        return True

    async def aclose(self) -> None:
        self.closed = True
        self._listener._unregister(self)
        if self._channel is not None and not self._taken:
            await self._channel.aclose()

    async def __aenter__(self) -> Expectation:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with trio.CancelScope(shield=True):
            await self.aclose()


class DataPathListener:
    """The daemon's one data-path TCP port, serving many sessions told apart by session id.

    Run :meth:`serve` in the daemon's nursery (``port = await nursery.start(listener.serve)``), then
    register each session with :meth:`expect` before announcing it to the partner. Connections that
    name no registered session, fail to authenticate, or dawdle past ``handshake_timeout`` are closed
    without affecting the session they claimed; at most ``max_handshakes`` may be in progress at once,
    so unauthenticated peers cannot pile up sockets.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME,
        handshake_timeout: float = 10.0,
        max_pending: int = 256,
        max_handshakes: int = 64,
    ) -> None:
        self.host = host
        self.port = port
        self.max_frame_size = max_frame_size
        self.handshake_timeout = handshake_timeout
        self.max_pending = max_pending
        self._handshakes = trio.CapacityLimiter(max_handshakes)
        self._pending: dict[bytes, Expectation] = {}
        self.rejected = 0  # connections refused (unknown session, bad auth, timeout); for metrics

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; reports the bound port through ``task_status``."""
        listeners = await trio.open_tcp_listeners(self.port, host=self.host)
        self.port = listeners[0].socket.getsockname()[1]
        # Not trio.serve_listeners: it closes each stream when its handler returns, but an accepted
        # channel must outlive the handshake task that authenticated it.
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(self._accept_loop, listener, nursery)
            task_status.started(self.port)

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        async with listener:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:
                    if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS):
                        raise
                    await trio.sleep(0.1)  # out of descriptors: back off instead of spinning
                    continue
                nursery.start_soon(self._handle, stream)

    def expect(self, keys: SessionKeys, *, timeout: float) -> Expectation:
        """Register a session now; see :class:`Expectation`. The deadline starts now."""
        if keys.role is not Role.RESPONDER:
            raise ValueError("DataPathListener.expect needs responder keys")
        if not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout}")
        if keys.session_id in self._pending:
            raise ValueError("session id already registered")
        if len(self._pending) >= self.max_pending:
            raise RuntimeError(f"too many pending data-path sessions ({self.max_pending})")
        expectation = Expectation(self, keys, trio.current_time() + timeout)
        self._pending[keys.session_id] = expectation
        return expectation

    def _unregister(self, expectation: Expectation) -> None:
        if self._pending.get(expectation.keys.session_id) is expectation:
            del self._pending[expectation.keys.session_id]

    async def _handle(self, stream: trio.SocketStream) -> None:
        try:
            self._handshakes.acquire_on_behalf_of_nowait(stream)
        except trio.WouldBlock:
            self.rejected += 1
            await trio.aclose_forcefully(stream)
            return
        try:
            with trio.move_on_after(self.handshake_timeout):
                if await self._accept(stream):
                    return
        except (ProtocolError, OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self._handshakes.release_on_behalf_of(stream)
        self.rejected += 1
        await trio.aclose_forcefully(stream)

    async def _accept(self, stream: trio.SocketStream) -> bool:
        """Authenticate one incoming connection; True once the authenticated channel is dealt with
        (handed to its :class:`Expectation`, or closed cleanly), False to reject the connection."""
        session_id = await _read_preamble(stream)
        expectation = self._pending.get(session_id) if session_id is not None else None
        if expectation is None:
            return False
        channel = SecureChannel(stream, expectation.keys, max_frame_size=self.max_frame_size)
        # A failed HELLO leaves the session registered: a stranger who saw the session id in clear
        # cannot use it to knock the real partner out.
        await channel._recv_frame(memoryview(bytearray(0)), accept={FRAME_HELLO})
        if self._pending.get(expectation.keys.session_id) is not expectation:
            return False  # another connection won the race, or the waiter gave up meanwhile
        self._unregister(expectation)
        try:
            await channel._send_frame(FRAME_ACK, b"")
        except ProtocolError as exc:
            expectation._deliver(None, exc)
            return False
        if not expectation._deliver(channel):
            await channel.aclose()  # the waiter left while we acknowledged: end the session cleanly
        return True
