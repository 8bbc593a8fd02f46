"""What every `starling doctor` check returns (`Finding`, its levels) and the small readers the checks
share: short PeerIDs, bounded lists, numbers from the status, a multiaddr's host and port.

A module of its own so that the three kinds of checks (node/ops/doctor_local.py, doctor_bootstrap.py,
doctor_status.py) and the command that runs them (node/ops/doctor.py) share these without importing
each other.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Literal

Level = Literal["ok", "skip", "warn", "error"]
OK: Level = "ok"
SKIP: Level = "skip"
WARN: Level = "warn"
ERROR: Level = "error"
MAX_LISTED = 8  # peers named in one finding; the rest are counted


@dataclass(frozen=True)
class Finding:
    """One verdict: which check, how bad, what was seen, and what to do about it ('' when nothing)."""

    check: str
    level: Level
    message: str
    fix: str = ""


def short(peer_id: str) -> str:
    return peer_id[:6] + ".." + peer_id[-6:] if len(peer_id) > 14 else peer_id


def list_some(items: list[str]) -> str:
    """At most MAX_LISTED items, comma-separated, with a count of the rest."""
    shown = ", ".join(items[:MAX_LISTED])
    return shown + (f" and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else "")


def host_port(text: str) -> tuple[str, str, int] | None:
    """(protocol, host, port) of a /ip4|ip6|dns*/H/tcp/P multiaddr prefix, else None."""
    from p2p.addrs import AddrError, parse_multiaddr

    try:
        addr = parse_multiaddr(text)
        protos = [p.name for p in addr.protocols()]
        if len(protos) < 2 or protos[0] not in ("ip4", "ip6", "dns", "dns4", "dns6") or protos[1] != "tcp":
            return None
        return protos[0], str(addr.value_for_protocol(protos[0])), int(addr.value_for_protocol("tcp"))
    except (AddrError, ValueError):
        return None


def address_family(proto: str) -> int:
    return {
        "ip4": socket.AF_INET,
        "dns4": socket.AF_INET,
        "ip6": socket.AF_INET6,
        "dns6": socket.AF_INET6,
    }.get(proto, socket.AF_UNSPEC)


def as_number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
