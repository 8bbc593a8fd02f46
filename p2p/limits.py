"""Resource limits py-libp2p 0.8.1 declares but does not keep, kept here (shared/design/py-libp2p-notes.md).

Inbound connection slots (pitfall 11). The swarm takes one slot of ``_inbound_limiter`` (max_connections
minus min_connections) per inbound connection and gives it back when ``_do_handle_inbound_connection``
returns; for TCP that handler ends in ``await self.manager.wait_finished()``, i.e. it returns only when the
swarm shuts down. Every inbound connection ever accepted therefore holds its slot for the life of the
daemon, closed or not: after max_connections connect/disconnect cycles (honest churn or an attacker's
loop) the node refuses every new inbound connection. :func:`release_inbound_slots_on_close` ends that
handler when its connection closes, so the library's own ``finally`` gives the slot back.

The patch is instance-level (applied by p2p/host.py's ``build_host``) and leaves the library's handler
intact: it only learns which muxed connection the handler produced and cancels the handler once that
connection is closed.

Yamux receive windows (pitfall 12). 0.8.1 notices a peer sending past a stream's receive window, logs it
at debug and buffers the data anyway, so flow control protects nothing: a peer can make us hold all it
sends. :class:`BoundedYamux` (the muxer ``build_host`` registers) buffers no more than the window, closes
the connection of a peer that overruns it (as go-yamux does) and counts the offence in
:class:`MuxerOffences`.

Yamux window updates. 0.8.1 answers every read smaller than half the window with its own WINDOW_UPDATE
frame ("partial slack"), where go-yamux waits until half the window is consumed. Membership traffic is
made of small messages, so two frames in three on a quiet daemon's connections were window updates: one
TCP segment each, with its headers and ACK. :class:`_CoalescedWindowStream` keeps go-yamux's rule.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import struct
import time
from collections.abc import Callable
from typing import Any

import trio
from libp2p.protocol_muxer.exceptions import MultiselectError
from libp2p.stream_muxer.yamux.yamux import (
    GO_AWAY_PROTOCOL_ERROR,
    TYPE_GO_AWAY,
    YAMUX_HEADER_FORMAT,
    Yamux,
    YamuxStream,
)

from p2p.status import MuxerStatus

log = logging.getLogger("starling.limits")


class _InboundUpgrade:
    """What one inbound handler produced: the muxed connection, once its upgrade succeeded."""

    def __init__(self) -> None:
        self.conn: Any = None
        self.upgraded = trio.Event()


#: The inbound handler running in this task (set by the wrapped handler, filled by the wrapped upgrade:
#: the swarm awaits the upgrade in the handler's own task, so both see the same object).
_current_upgrade: contextvars.ContextVar[_InboundUpgrade | None] = contextvars.ContextVar(
    "starling_inbound_upgrade", default=None
)


async def _cancel_when_closed(upgrade: _InboundUpgrade, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` (the handler's) once the connection it upgraded has closed.

    Yamux sets ``event_closed`` on every way a connection ends (our close, the peer's GO_AWAY or EOF, a
    read error, the swarm's pruner); a muxer without it keeps the library's behaviour (no cancel).
    """
    await upgrade.upgraded.wait()
    closed = getattr(upgrade.conn, "event_closed", None)
    if closed is None:
        return
    await closed.wait()
    scope.cancel()


def release_inbound_slots_on_close(swarm: Any) -> None:
    """Narrow patch: an inbound connection gives its ``_inbound_limiter`` slot back when it closes.

    Wraps two of the swarm's methods on this instance: ``upgrade_inbound_raw_conn`` records the muxed
    connection it returns, and ``_do_handle_inbound_connection`` runs the library's handler beside a
    watcher that cancels it once that connection is closed. The handler's wait is then over and
    ``_handle_inbound_connection``'s ``finally`` releases the slot. A handler that fails or refuses the
    connection returns on its own, as before; the watcher is cancelled with it (no stray task).
    """
    handle = swarm._do_handle_inbound_connection
    upgrade_inbound = swarm.upgrade_inbound_raw_conn

    async def recorded_upgrade(raw_conn: Any, maddr: Any) -> Any:
        muxed = await upgrade_inbound(raw_conn, maddr)
        current = _current_upgrade.get()
        if current is not None and current.conn is None:
            current.conn = muxed
            current.upgraded.set()
        return muxed

    async def handle_until_closed(read_write_closer: Any, maddr: Any, failure_event: Any) -> None:
        upgrade = _InboundUpgrade()
        token = _current_upgrade.set(upgrade)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_when_closed, upgrade, nursery.cancel_scope)
                await handle(read_write_closer, maddr, failure_event)
                nursery.cancel_scope.cancel()  # refused or failed: the handler returned by itself
        finally:
            _current_upgrade.reset(token)

    swarm.upgrade_inbound_raw_conn = recorded_upgrade
    swarm._do_handle_inbound_connection = handle_until_closed


# --- Yamux receive windows (pitfall 12) -----------------------------------------------------------------

#: How long a GO_AWAY to a peer that broke the protocol may take to write (it may not be reading).
GO_AWAY_DEADLINE_S = 2.0
#: Offence log lines per peer at most this often; the counters count every offence.
LOG_EVERY_S = 60.0
#: Peers whose offences are remembered by name (the oldest is forgotten beyond this).
MAX_TRACKED_PEERS = 1024


class MuxerOffences:
    """What peers did to this node's Yamux connections: counted for `status`, logged (rate-limited).

    One instance per host (``build_host(muxer_offences=...)``); ``on_offence``, when set, is called with
    the peer's id and the reason, so that the daemon can feed its own ban policy.
    """

    def __init__(self) -> None:
        self.window_overruns = 0
        self.dropped_bytes = 0  # sent on streams we had reset or that the peer had finished
        self.by_peer: dict[str, int] = {}
        self.on_offence: Callable[[str, str], None] | None = None
        self._last_log: dict[str, float] = {}

    def window_overrun(self, peer: str, stream_id: int, sent: int, window: int) -> None:
        self.window_overruns += 1
        self.by_peer[peer] = self.by_peer.pop(peer, 0) + 1
        if len(self.by_peer) > MAX_TRACKED_PEERS:
            del self.by_peer[next(iter(self.by_peer))]
        now = time.monotonic()
        if now - self._last_log.get(peer, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._last_log[peer] = now
            if len(self._last_log) > MAX_TRACKED_PEERS:
                self._last_log.clear()
            log.warning("closing the connection with %s: it sent %d bytes on stream %d, past the %d-byte "
                        "receive window it was granted", peer, sent, stream_id, window)
        if self.on_offence is not None:
            self.on_offence(peer, "yamux_window_overrun")

    def status(self) -> MuxerStatus:
        return {"window_overruns": self.window_overruns, "dropped_bytes": self.dropped_bytes,
                "offenders": len(self.by_peer)}


#: Set on a Yamux stream that nobody will read any more (its handler returned, or we closed it after our
#: last read): what arrives for it is dropped, not buffered.
_DONE_ATTR = "_starling_done"


def stop_receiving(stream: Any) -> None:
    """We read nothing more from ``stream`` (a libp2p stream or its Yamux stream): free what it buffered
    and drop what still arrives, within its window (past it is still an overrun).

    Why: a stream we answered and closed stays open for receiving until the peer closes it, and py-libp2p
    auto-tunes each stream's window up to 16 MiB; a peer that filled the windows of 16 streams we had
    refused, never exceeding one, held +258 MiB of our memory with no offence (one connection, and no bound
    on how many refused streams it may open). Called when a stream handler returns (p2p/host.py) and by
    ``p2p.wire.close_quietly``. A muxer other than :class:`BoundedYamux` ignores the mark."""
    muxed = getattr(stream, "muxed_stream", stream)
    try:
        setattr(muxed, _DONE_ATTR, True)
    except AttributeError:  # a test double or a stream type without attributes: nothing to mark
        return
    conn = getattr(muxed, "muxed_conn", None)
    buffers = getattr(conn, "stream_buffers", None)
    stream_id = getattr(muxed, "stream_id", None)
    if isinstance(conn, BoundedYamux) and isinstance(buffers, dict) and stream_id is not None:
        buffer = buffers.get(stream_id)
        if buffer:
            conn.offences.dropped_bytes += len(buffer)
            buffer.clear()


#: Protocols whose handlers own their stream only until they return: Starling's own. py-libp2p's (circuit
#: relay, DCUtR, ...) may hand the stream on to a connection that reads it after the handler returned.
OWN_PROTOCOL_PREFIX = "/starling/"


def drop_after_handlers(host: Any) -> None:
    """Narrow patch: every handler of a Starling protocol (:data:`OWN_PROTOCOL_PREFIX`) registered on
    ``host`` from now on marks its stream :func:`stop_receiving` when it returns (nobody reads such a stream
    after its handler). Other protocols' handlers are left as they are."""
    set_handler = host.set_stream_handler

    def set_stream_handler(protocol_id: Any, handler: Any) -> None:
        if not str(protocol_id).startswith(OWN_PROTOCOL_PREFIX):
            set_handler(protocol_id, handler)
            return

        async def handled(stream: Any) -> None:
            try:
                await handler(stream)
            finally:
                stop_receiving(stream)

        set_handler(protocol_id, handled)

    host.set_stream_handler = set_stream_handler


def survive_removed_handlers(host: Any) -> None:
    """Narrow, instance-level patch: a protocol whose handler is removed while a peer's stream is still
    negotiating it fails that stream, not the connection.

    py-libp2p 0.8.1's ``Multiselect.negotiate`` checks ``protocol in self.handlers``, awaits the write of its
    answer, then reads ``self.handlers[protocol]``: a ``remove_stream_handler`` in between (a service
    stopping, the daemon shutting down) raises ``KeyError``, which ends the connection's stream nursery and
    printed a traceback in 8 of 64 daemons stopped at once (bench/scale.py). As :class:`MultiselectError`
    the host resets that one stream and logs it at debug, as for any failed negotiation. (Upstream: look
    the handler up once, ``self.handlers.get``, and answer "na" when it is gone.)
    """
    negotiate = host.multiselect.negotiate

    async def negotiate_surviving(communicator: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await negotiate(communicator, *args, **kwargs)
        except KeyError as exc:
            raise MultiselectError(f"handler of {exc} removed during negotiation") from None

    host.multiselect.negotiate = negotiate_surviving


class _WindowedBuffer(bytearray):
    """One stream's receive buffer: it takes only what the stream's receive window allows.

    Yamux.handle_incoming appends every DATA payload with ``extend`` (under ``streams_lock``, before it
    charges the window); this is the one place every payload passes, so the check sits here.
    """

    def __init__(self, conn: BoundedYamux, stream_id: int) -> None:
        super().__init__()
        self._conn = conn
        self._stream_id = stream_id

    def extend(self, data: Any) -> None:
        if self._conn._admit(self._stream_id, len(data)):
            super().extend(data)


class _CoalescedWindowStream(YamuxStream):
    """A Yamux stream that returns receive window to its peer as go-yamux does: once at least half the
    window has been read (the library's "full grow" update), not after every small read.

    Why: the library's "partial slack" branch sends a 12-byte WINDOW_UPDATE (an encrypted frame, a TCP
    segment of its own) for each read below that threshold. On a daemon that only gossips, 93 of its 145
    frames a second were such updates (5 network-only daemons on loopback). The peer still has the other
    half of the window to send into, so deferring the update stalls nobody; the window accounting itself
    is the library's (the bytes read are returned by the next full update).
    """

    async def _auto_tune_and_send_window_update(self, *, bytes_read: int = 0) -> None:
        if bytes_read > 0:
            async with self.window_lock:
                buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
                unreturned = self.target_recv_window - (self.recv_window + buffered)
                if 0 < unreturned < self._grow_threshold():
                    return  # returned with the next update, once half the window is consumed
        await super()._auto_tune_and_send_window_update(bytes_read=bytes_read)


class _Streams(dict[int, YamuxStream]):
    """``Yamux.streams`` whose new entries send window updates as :class:`_CoalescedWindowStream` does (the
    library builds each stream as a plain ``YamuxStream`` in two places, then stores it here)."""

    def __setitem__(self, stream_id: int, stream: YamuxStream) -> None:
        if type(stream) is YamuxStream:
            stream.__class__ = _CoalescedWindowStream
        super().__setitem__(stream_id, stream)


class _StreamBuffers(dict[int, bytearray]):
    """``Yamux.stream_buffers`` whose new entries are :class:`_WindowedBuffer` (the library creates each
    with ``stream_buffers[stream_id] = bytearray()``)."""

    def __init__(self, conn: BoundedYamux) -> None:
        super().__init__()
        self._conn = conn

    def __setitem__(self, stream_id: int, value: bytearray) -> None:
        buffer = _WindowedBuffer(self._conn, stream_id)
        bytearray.extend(buffer, value)  # whatever the library put there, unchecked (always empty)
        super().__setitem__(stream_id, buffer)


class BoundedYamux(Yamux):
    """py-libp2p's Yamux with its receive windows enforced, as go-yamux does.

    0.8.1 logs a window overrun and buffers the data anyway, so a peer that ignores flow control makes
    us buffer whatever it sends, without bound (3 GB sent on a stream we had half-closed: +3 GB of RSS,
    never freed). Here a DATA payload larger than what is left of its stream's window is not buffered:
    the peer broke the protocol, so the connection is closed with a GO_AWAY (protocol error) and the
    offence counted (:class:`MuxerOffences`). Data for a stream that is closed for receiving (we reset
    it, or the peer finished or reset it) is dropped, and resetting a stream frees what it had buffered:
    nobody will read either.

    Use :func:`yamux_with_limits` to get the class bound to a host's :class:`MuxerOffences`.
    """

    offences: MuxerOffences = MuxerOffences()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stream_buffers = _StreamBuffers(self)
        self.streams = _Streams()
        self._incoming_scope: trio.CancelScope | None = None
        self._violation = False
        #: When a DATA payload last arrived from the peer (trio clock; -inf: never), whatever its stream:
        #: evidence that the peer's process runs, which SWIM takes in place of a late ack
        #: (node/swarm/membership.py, "Other traffic is evidence too").
        self.last_data_at = -math.inf

    def _admit(self, stream_id: int, size: int) -> bool:
        """Whether ``size`` bytes that arrived for ``stream_id`` may be buffered (called with
        ``streams_lock`` held, from handle_incoming)."""
        self.last_data_at = trio.current_time()
        stream = self.streams.get(stream_id)
        if stream is None or stream.recv_closed or self._violation:
            self.offences.dropped_bytes += size
            return False
        if size > stream.recv_window:
            self._violation = True
            self.offences.window_overrun(str(self.peer_id), stream_id, size, stream.recv_window)
            self.offences.dropped_bytes += size
            if self._incoming_scope is not None:
                self._incoming_scope.cancel()  # handle_incoming stops at its next await; see below
            return False
        if getattr(stream, _DONE_ATTR, False):  # nobody reads it any more (stop_receiving)
            self.offences.dropped_bytes += size
            return False
        return True

    async def handle_incoming(self) -> None:
        """The library's frame loop, stopped at its next await once a peer overran a window; the
        connection is then closed here, in the loop's own task (before Yamux.start's nursery is
        cancelled), through the library's own error path (streams woken, swarm told)."""
        with trio.CancelScope() as self._incoming_scope:
            await super().handle_incoming()
        if not self._violation:
            return
        with trio.move_on_after(GO_AWAY_DEADLINE_S), contextlib.suppress(Exception):
            await self._write_frame(struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_GO_AWAY, 0, 0, GO_AWAY_PROTOCOL_ERROR))
        await self._cleanup_on_error()

    async def _finalize_stream(self, stream: YamuxStream, *, fully_closed: bool) -> None:
        """As the library's, but a reset stream's buffered data is freed at once (go-yamux's reads fail on
        a reset stream too) instead of lingering until the stale-stream sweeper's grace period ends."""
        async with self.streams_lock:
            if stream.reset_received:
                buffer = self.stream_buffers.get(stream.stream_id)
                if buffer:
                    self.offences.dropped_bytes += len(buffer)
                    buffer.clear()
            self._finalize_stream_locked(stream, fully_closed=fully_closed)


def yamux_with_limits(offences: MuxerOffences) -> type[BoundedYamux]:
    """:class:`BoundedYamux` counting into ``offences`` (the upgrader builds muxers from a class)."""
    return type("BoundedYamux", (BoundedYamux,), {"offences": offences, "__module__": __name__})


def use_registered_muxers(upgrader: Any) -> None:
    """Narrow patch: build the muxer class registered for the negotiated protocol.

    0.8.1's ``MuxerMultistream.new_conn`` builds a plain ``Yamux`` for /yamux/1.0.0 whatever class
    ``muxer_opt`` names, so :class:`BoundedYamux` would never run. This is that method without the special
    case: negotiate, build the registered class, annotate (the library's ``on_close`` there is a no-op
    that SwarmConn replaces).
    """
    muxers = upgrader.muxer_multistream

    async def new_conn(conn: Any, peer_id: Any) -> Any:
        protocol, muxer_class = await muxers._selector.select(conn, conn.is_initiator, muxers.negotiate_timeout)
        return muxers._annotate_connection(muxer_class(conn, peer_id), conn, protocol)

    muxers.new_conn = new_conn
