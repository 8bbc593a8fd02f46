"""Hole punching that says why it failed: py-libp2p's DCUtR (``DCUtRProtocol``), with each punch's outcome
and its per-address dial errors reported (:class:`ReportingDCUtR`), and one operator sentence for a
failure (:func:`describe_punch_failure`).

Why a module apart from node/swarm/nat.py: this adapts the library's hooks (they change with its
version); the NAT service only takes the outcomes (the peer's path becomes ``hole-punched``, or the
reason it stays relayed is kept for status).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol

from node.swarm.circuit import short_id
from protocols.dialback import DialStatus, classify_dial_error

_DIAL_FAILURE_TEXT = {
    DialStatus.REFUSED: "answered with RST (the NAT refuses unsolicited connections)",
    DialStatus.TIMEOUT: "did not answer (the NAT dropped our SYNs)",
    DialStatus.UNREACHABLE: "is unreachable (no route)",
}
_DIAL_FAILURE_RANK = [DialStatus.REFUSED, DialStatus.TIMEOUT, DialStatus.UNREACHABLE, DialStatus.FAILED]


def describe_punch_failure(peer_id: ID, errors: list[tuple[str, DialStatus, str]]) -> str:
    """One sentence for an operator: which address failed how, with the most telling failure first."""
    if not errors:
        return f"hole punching to {short_id(peer_id)} failed: no direct address to try; staying relayed"
    addr, status, detail = min(errors, key=lambda e: _DIAL_FAILURE_RANK.index(e[1]))
    how = _DIAL_FAILURE_TEXT.get(status, f"failed ({detail})")
    return f"hole punching to {short_id(peer_id)} failed: {addr} {how}; staying relayed"


PunchCallback = Callable[[ID, bool, list[tuple[str, DialStatus, str]]], None]


class ReportingDCUtR(DCUtRProtocol):
    """py-libp2p's DCUtR, with each hole punch's outcome and per-address dial errors reported.

    The library logs dial failures at debug level and returns a bare bool; an operator needs to know
    *why* two peers stay relayed (a NAT answering with RST is a different fix from one dropping SYNs).
    ``_perform_hole_punch`` and ``_dial_peer`` are the library's (0.8.1) hooks for exactly these steps;
    the override of ``_dial_peer`` keeps the library's behaviour and adds the error record.
    """

    def __init__(self, host: IHost, on_punch: PunchCallback) -> None:
        super().__init__(host, read_timeout=15, write_timeout=15, dial_timeout=5)
        self.on_punch = on_punch
        self.punching: set[ID] = set()  # a direct connection to these peers comes from a hole punch
        self._errors: dict[ID, list[tuple[str, DialStatus, str]]] = {}

    async def _perform_hole_punch(
        self, peer_id: ID, addrs: list[multiaddr.Multiaddr], as_responder: bool = False
    ) -> bool:
        errors: list[tuple[str, DialStatus, str]] = []
        self._errors[peer_id] = errors
        self.punching.add(peer_id)
        try:
            ok = await super()._perform_hole_punch(peer_id, addrs, as_responder)
        finally:
            if self._errors.get(peer_id) is errors:
                del self._errors[peer_id]
                self.punching.discard(peer_id)
        self.on_punch(peer_id, ok, errors[-32:])
        return ok

    async def _dial_peer(
        self,
        peer_id: ID,
        addr: multiaddr.Multiaddr,
        source: tuple[str, int] | None = None,
        as_responder: bool = False,
    ) -> None:
        errors = self._errors.get(peer_id)
        if errors is None:  # not part of a hole punch (e.g. the unilateral upgrade): library behaviour
            await super()._dial_peer(peer_id, addr, source, as_responder)
            return
        peerstore = self.host.get_peerstore()
        try:
            known = list(peerstore.addrs(peer_id))
        except Exception:
            known = []
        network: Any = self.host.get_network()
        try:
            with trio.fail_after(self.dial_timeout):
                if as_responder:
                    await network.dial_addr_as_responder(addr, peer_id, source)
                else:
                    await network.dial_addr(addr, peer_id, source)
        except trio.TooSlowError:
            errors.append((str(addr), DialStatus.TIMEOUT, f"no answer within {self.dial_timeout} s"))
            return
        except Exception as e:
            errors.append((str(addr), *classify_dial_error(e)))
            # A peer-id mismatch makes the swarm forget the peer's addresses; restore them (as the library does).
            if "mismatch" in str(e).lower() and known:
                peerstore.add_addrs(peer_id, known, 600)
            return
        if await self._verify_direct_connection(peer_id):
            self._direct_connections.add(peer_id)
