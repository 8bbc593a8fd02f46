"""What this node refused to peers and why, summed by kind: the ``refusals`` section of `starling status`.

Each limit counts its refusals where it is kept: the connection manager (cap, per-subnet cap), the muxer
(window overruns), access control (swarm key, allowlist), the per-subnet stream limits (per protocol), the
replicator (state sessions: all slots or the peer's share), the snapshot server (downloads at once) and the
averager (requests at once, per IP, banned IPs). An operator asking "is somebody hitting my limits?" should
not have to know those seven places: :func:`collect` sums them into one flat dict with fixed keys, and
:func:`refused_line` says it in one line. No limit is kept here; this only reads counters.

Imports nothing heavy: `starling status` renders with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from node.status_schema import (
    AuthorizationStatus,
    ConnectionsStatus,
    MuxerStatus,
    RefusalsStatus,
    ReplicationStatus,
    StreamLimitsStatus,
)
from protocols.hlc import MAX_LEAD_S

#: key -> (what was refused, plural, why), in the order the keys are declared in RefusalsStatus.
KINDS: dict[str, tuple[str, str, str]] = {
    "connections_over_cap": ("connection closed", "connections closed", "over the cap"),
    "connections_subnet_cap": ("connection closed", "connections closed", "subnet cap"),
    "connections_window_overrun": ("connection closed", "connections closed", "window overrun"),
    "handshakes_refused": ("connection refused", "connections refused", "handshake failed"),
    "peers_not_allowed": ("connection or stream refused", "connections or streams refused", "not in allow_peers"),
    "state_sessions_busy": ("state session", "state sessions", "all busy"),
    "state_sessions_peer_share": ("state session", "state sessions", "peer share"),
    "state_sessions_subnet_share": ("state session", "state sessions", "subnet share"),
    "snapshot_downloads_busy": ("snapshot download", "snapshot downloads", "all busy"),
    "snapshot_downloads_subnet_share": ("snapshot download", "snapshot downloads", "subnet share"),
    "dialbacks_subnet_share": ("dial-back", "dial-backs", "subnet share"),
    "averaging_requests_busy": ("averaging request", "averaging requests", "all busy"),
    "averaging_requests_per_ip": ("averaging request", "averaging requests", "per-IP"),
    "averaging_requests_banned_ip": ("averaging request", "averaging requests", "banned IP"),
    "clocks_capped": ("record's clock not followed", "records' clocks not followed", f"over {MAX_LEAD_S:g} s ahead"),
}

def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def collect(
    *,
    connections: ConnectionsStatus,
    muxer: MuxerStatus,
    authorization: AuthorizationStatus,
    stream_limits: StreamLimitsStatus,
    replication: ReplicationStatus,
    averaging_rejections: Mapping[str, int],
    snapshot_busy: int,
    subnet_kinds: Mapping[str, str],
    clock_capped: int,
) -> RefusalsStatus:
    """The refusals from the sections node/daemon.py puts in its status (and the snapshot server's count,
    which no section carries; ``averaging_rejections`` is ``sync.rejections``, empty without an averager;
    ``clock_capped`` is ``swarm_totals.clock_capped``).

    ``subnet_kinds`` maps a protocol id of the per-subnet stream limits to its key here (the daemon knows
    the ids; this module stays free of the protocol modules)."""
    busy = _int(replication.get("busy_refusals"))
    peer_share = min(busy, _int(replication.get("peer_share_refusals")))
    subnet: dict[str, int] = {}
    for protocol, count in (stream_limits.get("refused") or {}).items():
        key = subnet_kinds.get(protocol)
        if key is not None:
            subnet[key] = subnet.get(key, 0) + _int(count)
    conns, auth, rejections = connections, authorization, averaging_rejections
    return {
        "connections_over_cap": _int(conns.get("cap_pruned")),
        "connections_subnet_cap": _int(conns.get("subnet_pruned")),
        "connections_window_overrun": _int(muxer.get("window_overruns")),
        "handshakes_refused": _int(auth.get("refused_handshakes")),
        "peers_not_allowed": _int(auth.get("refused_peers")),
        "state_sessions_busy": busy - peer_share,
        "state_sessions_peer_share": peer_share,
        "state_sessions_subnet_share": subnet.get("state_sessions_subnet_share", 0),
        "snapshot_downloads_busy": snapshot_busy,
        "snapshot_downloads_subnet_share": subnet.get("snapshot_downloads_subnet_share", 0),
        "dialbacks_subnet_share": subnet.get("dialbacks_subnet_share", 0),
        "averaging_requests_busy": _int(rejections.get("too_many_requests")),
        "averaging_requests_per_ip": _int(rejections.get("too_many_requests_from_ip")),
        "averaging_requests_banned_ip": _int(rejections.get("banned_ip")),
        "clocks_capped": _int(clock_capped),
    }


def refused_line(refusals: Mapping[str, Any]) -> str:
    """One line for `starling status`: what was refused and why, the largest counts first.

    "refused: 12 state sessions (peer share), 3 averaging requests (per-IP), 1 connection closed (window
    overrun)"; "refused: nothing" before anything was. Keys this version does not know (a newer daemon's)
    are shown by name."""
    counts = [(k, _int(v)) for k, v in refusals.items() if _int(v) > 0]
    if not counts:
        return "refused: nothing"
    order = {k: i for i, k in enumerate(KINDS)}
    counts.sort(key=lambda kv: (-kv[1], order.get(kv[0], len(order)), kv[0]))
    parts = []
    for key, n in counts:
        one, many, why = KINDS.get(key, (key, key, ""))
        parts.append(f"{n} {one if n == 1 else many}" + (f" ({why})" if why else ""))
    return "refused: " + ", ".join(parts)
