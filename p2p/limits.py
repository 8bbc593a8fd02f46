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
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

import trio

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
