"""Network groups: which subnet a peer's connection comes from, for per-IP and per-subnet limits.

Identities are free (a key pair is a few microseconds), addresses are not: an attacker who mints a
thousand PeerIDs still sends them from a handful of IPs. So every Sybil limit in Starling counts per
*network group* rather than per PeerID, as libp2p's resource manager and discv5's table limits do: an
IPv4 /24, an IPv6 /48 (what one site or customer is usually given; a /64 alone is one LAN and costs
nothing to multiply). The address used is the one the connection was *observed* from (the TCP peer
address, which the sender cannot choose), never an address a peer claims in a record.
"""

from __future__ import annotations

import functools
import ipaddress
from typing import Any

from p2p.status import StreamLimitsStatus

#: Group of a connection whose address cannot be read (a relayed stream, a test double): all such
#: peers share one group, so hiding the address buys an attacker nothing.
UNKNOWN_GROUP = "?"

IPV4_PREFIX = 24
IPV6_PREFIX = 48


@functools.lru_cache(maxsize=4096)
def group_of(ip: str | None) -> str:
    """The network group of an IP address: its /24 (IPv4) or /48 (IPv6); ``"?"`` when unknown.

    IPv4-mapped IPv6 addresses count as the IPv4 address they carry. Memoised (a pure function of the
    text): the connection manager asks for every connection's group twice a second.
    """
    if not ip:
        return UNKNOWN_GROUP
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return UNKNOWN_GROUP
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    prefix = IPV4_PREFIX if addr.version == 4 else IPV6_PREFIX
    return str(ipaddress.ip_network(f"{addr}/{prefix}", strict=False))


@functools.lru_cache(maxsize=4096)
def is_loopback_group(group: str) -> bool:
    """Whether a group is this machine's loopback (a local swarm: `make run`, tests), exempt from
    connection limits: nobody else can connect from there."""
    try:
        return ipaddress.ip_network(group).is_loopback
    except ValueError:
        return False


def stream_ip(stream: Any) -> str | None:
    """The IP a libp2p stream's connection comes from, or None where it cannot be read."""
    try:
        remote = stream.get_remote_address()
    except Exception:  # a relayed stream, a closed one, a test double
        return None
    return str(remote[0]) if remote else None


def peer_ip(host: Any, peer_id: Any) -> str | None:
    """The IP of the first open connection to ``peer_id`` (None when not connected or unreadable)."""
    try:
        conns = host.get_network().get_connections(peer_id)
    except Exception:
        return None
    for conn in conns or ():
        try:
            remote = conn.muxed_conn.get_remote_address()
        except Exception:
            continue
        if remote:
            return str(remote[0])
    return None


class SubnetStreamLimits:
    """Per-network-group limits on concurrent inbound streams of chosen protocols.

    A thousand identities from one machine could otherwise hold every state session, snapshot download
    or dial-back this node serves (each protocol's own limit counts streams, not senders).
    A stream beyond its group's share is reset at once, before its handler reads a byte. The check and
    the count happen with no await between them, so concurrent arrivals cannot all pass (the admission
    race of a check-then-await-then-increment). Loopback is exempt (local swarms and tests).

    :meth:`install` wraps ``host.set_stream_handler``, as :class:`p2p.auth.AccessControl` does: handlers
    registered afterwards are limited.
    """

    def __init__(self, per_subnet: dict[str, int]) -> None:
        for protocol, limit in per_subnet.items():
            if limit < 1:
                raise ValueError(f"{protocol}: a per-subnet stream limit must be at least 1, got {limit}")
        self.per_subnet = dict(per_subnet)
        self._active: dict[tuple[str, str], int] = {}
        #: Streams reset because their group had its share, by protocol.
        self.refused: dict[str, int] = {}

    def admit(self, protocol: str, group: str) -> bool:
        """Take a slot for one stream of ``protocol`` from ``group`` (False: the group has its share).
        Every True must be paired with :meth:`release`."""
        limit = self.per_subnet.get(protocol)
        if limit is None or is_loopback_group(group):
            return True
        key = (protocol, group)
        if self._active.get(key, 0) >= limit:
            self.refused[protocol] = self.refused.get(protocol, 0) + 1
            return False
        self._active[key] = self._active.get(key, 0) + 1
        return True

    def release(self, protocol: str, group: str) -> None:
        key = (protocol, group)
        count = self._active.get(key, 0) - 1
        if count > 0:
            self._active[key] = count
        else:
            self._active.pop(key, None)

    def install(self, host: Any) -> None:
        set_handler = host.set_stream_handler
        limits = self

        def limited_set_stream_handler(protocol_id: Any, handler: Any) -> None:
            protocol = str(protocol_id)
            if protocol not in limits.per_subnet:
                set_handler(protocol_id, handler)
                return

            async def limited(stream: Any) -> None:
                group = group_of(stream_ip(stream))
                if not limits.admit(protocol, group):
                    try:
                        await stream.reset()
                    except Exception:  # the stream is gone either way
                        pass
                    return
                try:
                    await handler(stream)
                finally:
                    limits.release(protocol, group)

            set_handler(protocol_id, limited)

        host.set_stream_handler = limited_set_stream_handler

    def status(self) -> StreamLimitsStatus:
        return {"per_subnet": dict(self.per_subnet), "refused": dict(self.refused)}
