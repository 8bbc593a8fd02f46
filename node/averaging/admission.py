"""Admission: whom the averager listens to and whom it asks (the link table, per-IP caps, bans, back-offs).

Why a table per partner at all: a partner's measured rate, its failures and its offences decide whether
and when we ask it again, and whether we answer it. Why bounded (`MAX_LINKS`) and why per IP as well as per
PeerID: a fresh identity costs nothing, so one machine could otherwise fill the table, hold every request
slot, or offend forever under new names. So:

- *Requests read at once*: at most `MAX_INBOUND`, of which `MAX_INBOUND_PER_IP` from one IP address (one
  machine's Sybil identities share it); extra ones are reset before a byte is read (`inbound`).
- *Offences* (a poisoned or malformed update, or one seen outside an exchange: a Yamux window overrun, a
  snapshot donor that lied) are counted per reason; `sync.ban_after` of them ban the partner for
  `sync.ban_s`, and `IP_BAN_AFTER` banned identities from one IP ban the IP itself (everyone behind it,
  honest or not: the price of identities that cost nothing).
- *Back-off*: a partner that failed is asked again only after an exponential back-off (a soft one, about a
  second, after it declined).
- Loopback peers are exempt from per-IP limits and bans (`per_ip_key`): peers on this machine are the
  operator's own (`make run`'s local swarm puts every peer on 127.0.0.1).

The round state machine (node/averaging/averager.py) asks this table and tells it what happened; it never
reads the fields it keeps for those decisions (`Link.failures`, `banned_until`, `next_try`) itself.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import logging
import random
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import trio

from node.config.sync import SyncConfig
from node.status_schema import PeerLinkStatus
from p2p.wire import ProtocolError
from protocols.avg import Rejected

log = logging.getLogger("starling.averager")

BACKOFF_MAX_S = 300.0
# Protocol errors that only a buggy or hostile partner produces (a dead link is no offence).
MALFORMED = frozenset({"malformed", "too_large", "bad_kind", "bad_version", "bad_field", "bad_size", "auth"})
# A link's rate keeps this much of what earlier transfers showed at each new one (`FlowRate`).
RATE_KEEP = 0.5
MAX_INBOUND = 16  # pairing requests read concurrently
MAX_INBOUND_PER_IP = 4  # of those, from one IP address (one machine's Sybil identities share it)
IP_BAN_AFTER = 2  # identities banned from one IP before the IP itself is banned (identities are free)
MAX_LINKS = 4096  # partners remembered (rate, back-off, bans); the least useful are forgotten first


class FlowRate:
    """A link's rate each way, from the transfers it carried: their bytes over the seconds they flowed,
    both sums decayed by `keep` at each new transfer (so the latest few count most).

    Why bytes over seconds and not an average of each transfer's rate: a small transfer that fits in a token
    bucket's burst passes at the wire's speed, far above the link's rate, and an average of rates gave it
    the weight of a whole bf16 exchange. In bench/wan.py (uniform, 0.4 Mbit/s, 64 KiB bucket) the 37 kB
    probe timed at about 2.5 MB/s each way and the next `medium` transfer at 71 kB/s; halfway between, 1.3
    MB/s, made `auto` choose bf16 `none` for three exchanges of 38 s each, and the trainers made 5-6 outer
    steps in 180 s instead of 20. Weighted by their seconds, the two give 78 kB/s (the probe's sums halved once), and `medium` stays."""

    def __init__(self, keep: float) -> None:
        self.keep = keep
        self.bytes = 0.0  # each way
        self.seconds = 0.0

    def add(self, nbytes_each_way: float, seconds: float) -> float:
        """Fold one transfer in; returns the rate each way (bytes/s)."""
        self.bytes = self.keep * self.bytes + nbytes_each_way
        self.seconds = self.keep * self.seconds + seconds
        return self.bytes / self.seconds


@dataclass
class Link:
    """What we know of one partner: measured rate, traffic, back-off and bans."""

    rate_bps: float | None = None  # bytes/s each way while data flowed (`FlowRate`; None: never measured)
    flow: FlowRate = field(default_factory=lambda: FlowRate(RATE_KEEP))
    failures: int = 0
    offences: int = 0
    banned_until: float = 0.0
    next_try: float = 0.0
    rounds: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    last_path: str = ""  # what carried the bulk last time: datapath (side channel) or stream (libp2p)
    clipped: int = 0  # exchanges whose values we clipped (node/averaging/robust.py)
    ip: str | None = None  # the address its latest request or answer came from (`per_ip_key`)
    compression: str | None = None  # the preset of our latest exchange with it (`sync.compression = auto`)
    # Where its side channel listened when it last accepted us: dialled early at the next request
    # (protocols/avg.py `initiate`, `early`), so that the connect costs no round trip of its own.
    datapath_addr: tuple[str, int] | None = None
    # It confirmed the averaging protocol's latest version on our last stream to it: the next request is
    # written with the stream's proposal, not a round trip after it (p2p/multiselect.py, `open_optimistic`).
    speaks_latest: bool = False


def per_ip_key(ip: str | None) -> str | None:
    """The address that per-IP limits and bans count under; None (exempt) for loopback: peers on this
    machine are the operator's own (`make run`'s local swarm puts every peer on 127.0.0.1)."""
    if ip is None:
        return None
    try:
        return None if ipaddress.ip_address(ip).is_loopback else ip
    except ValueError:
        return ip


class Admission:
    """The link table, the request slots and the bans of one averager."""

    def __init__(self, cfg: SyncConfig, *, max_links: int = MAX_LINKS,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self.cfg = cfg
        self.max_links = max_links
        self._clock = clock
        self._links: dict[str, Link] = {}
        # Offences per reason and requests refused unread (too many, from a banned IP), for status.
        self.rejections: dict[str, int] = {}
        self._inbound = 0
        self._inbound_by_ip: dict[str, int] = {}
        # Per IP: identities banned from it, and until when the IP itself is banned (bounded like the links).
        self._ip_bans: collections.OrderedDict[str, tuple[int, float]] = collections.OrderedDict()

    # --- the link table ----------------------------------------------------------------------------------

    def link(self, peer: str) -> Link:
        """`peer`'s link, created (and another forgotten, where the table is full) if it has none."""
        link = self._links.get(peer)
        if link is None:
            if len(self._links) >= self.max_links:
                self._forget_a_link()
            link = self._links[peer] = Link()
        return link

    @property
    def links(self) -> Mapping[str, Link]:
        """The table, read-only (status, tests): peer -> its link."""
        return types.MappingProxyType(self._links)

    def saw(self, peer: str, ip: str | None) -> None:
        """`peer`'s latest request or answer came from `ip` (the address its bans and caps count under)."""
        self.link(peer).ip = per_ip_key(ip)

    def _forget_a_link(self) -> None:
        """Make room (fresh identities cost nothing, so the table must be bounded): forget the oldest
        partner we never averaged with and do not ban, else the oldest unbanned one. Banned ones are kept:
        forgetting them would lift the ban."""
        now = self._clock()
        unbanned = [p for p, link in self._links.items() if link.banned_until <= now]
        never = [p for p in unbanned if self._links[p].rounds == 0]
        victim = (never or unbanned or list(self._links))[0]
        del self._links[victim]

    def per_peer(self) -> dict[str, PeerLinkStatus]:
        """`sync.per_peer`: each link as status shows it."""
        return {
            p: {"rounds": link.rounds, "bytes_sent": link.bytes_sent, "bytes_received": link.bytes_received,
                "rate_mbps": None if link.rate_bps is None else round(link.rate_bps * 8 / 1e6, 3),
                "failures": link.failures, "path": link.last_path, "clipped": link.clipped}
            for p, link in self._links.items()
        }

    # --- inbound requests ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def inbound(self, ip: str | None) -> Iterator[bool]:
        """One slot to read a pairing request from `ip` in (already through `per_ip_key`): yields whether
        it was given; a refusal is counted in `rejections`, and the caller resets the stream unread."""
        refusal = None
        if self._inbound >= MAX_INBOUND:
            refusal = "too_many_requests"
        elif ip is not None and self._inbound_by_ip.get(ip, 0) >= MAX_INBOUND_PER_IP:
            refusal = "too_many_requests_from_ip"
        elif ip is not None and self.ip_banned(ip):
            refusal = "banned_ip"
        if refusal is not None:
            self.rejections[refusal] = self.rejections.get(refusal, 0) + 1
            yield False
            return
        self._inbound += 1
        if ip is not None:
            self._inbound_by_ip[ip] = self._inbound_by_ip.get(ip, 0) + 1
        try:
            yield True
        finally:
            self._inbound -= 1
            if ip is not None:
                left = self._inbound_by_ip.pop(ip) - 1
                if left > 0:
                    self._inbound_by_ip[ip] = left

    def inbound_held(self) -> tuple[int, dict[str, int]]:
        """Requests being read now: in all, and per IP (only those with some)."""
        return self._inbound, dict(self._inbound_by_ip)

    # --- offences and bans -------------------------------------------------------------------------------

    def offence(self, peer: str, reason: str) -> None:
        """A poisoned or malformed update (or an offence seen outside an exchange): counted per reason;
        `sync.ban_after` of them ban the partner, and banned identities ban their IP (`IP_BAN_AFTER`)."""
        self.rejections[reason] = self.rejections.get(reason, 0) + 1
        link = self.link(peer)
        link.offences += 1
        if link.offences >= self.cfg.ban_after:
            now = self._clock()
            link.banned_until = now + self.cfg.ban_s
            link.offences = 0
            log.warning("banning %s for %.0fs after %d invalid updates", peer, self.cfg.ban_s, self.cfg.ban_after)
            if link.ip is not None:
                self._note_ip_ban(link.ip, now)

    def _note_ip_ban(self, ip: str, now: float) -> None:
        """One more identity banned from `ip`; IP_BAN_AFTER of them ban the IP itself for `sync.ban_s`."""
        count, until = self._ip_bans.pop(ip, (0, 0.0))
        count += 1
        if count >= IP_BAN_AFTER:
            until = now + self.cfg.ban_s
            count = 0
            log.warning("banning IP %s for %.0fs: %d identities from it were banned for invalid updates",
                        ip, self.cfg.ban_s, IP_BAN_AFTER)
        self._ip_bans[ip] = (count, until)
        while len(self._ip_bans) > self.max_links:
            self._ip_bans.popitem(last=False)

    def ip_banned(self, ip: str) -> bool:
        entry = self._ip_bans.get(ip)
        return entry is not None and entry[1] > self._clock()

    def banned(self, peer: str) -> bool:
        """`peer` itself is banned (what a request from it is refused for)."""
        return self.link(peer).banned_until > self._clock()

    def barred(self, peer: str) -> bool:
        """`peer` or the IP it last came from is banned: no partner of ours, asked or counted."""
        link = self._links.get(peer)
        return link is not None and (link.banned_until > self._clock()
                                     or (link.ip is not None and self.ip_banned(link.ip)))

    def banned_peers(self) -> list[str]:
        now = self._clock()
        return sorted(p for p, link in self._links.items() if link.banned_until > now)

    # --- what an exchange gave ---------------------------------------------------------------------------

    def may_ask(self, peer: str) -> bool:
        """Neither barred nor backing off: `peer` may be asked in the open phase now (and has a link, which
        status lists, from now on)."""
        return self.link(peer).next_try <= self._clock() and not self.barred(peer)

    def failed(self, peer: str, error: BaseException, *, count: bool = True, offence: bool = True) -> None:
        """An exchange with `peer` failed: an invalid update or a malformed message is an offence (unless
        `offence` is False: the averager's judgement that the refusal says nothing against the peer); a
        counted failure (`count`: not a request that merely timed out before it was read) backs off."""
        if isinstance(error, Rejected) and offence:
            self.offence(peer, error.reason)
        elif isinstance(error, ProtocolError) and count and error.reason.value in MALFORMED:
            self.offence(peer, f"protocol_{error.reason.value}")
        if count:
            self.back_off(peer)

    def back_off(self, peer: str, *, soft: bool = False, at_least_s: float = 0.0) -> None:
        """Ask `peer` again only later: about a second after it declined (`soft`; at least `at_least_s`),
        else exponentially longer with each failure in a row (`sync.backoff_s`, up to BACKOFF_MAX_S)."""
        link = self.link(peer)
        if soft:
            link.next_try = self._clock() + max(random.uniform(0.5, 1.5), min(at_least_s, BACKOFF_MAX_S))
            return
        link.failures += 1
        delay = min(BACKOFF_MAX_S, self.cfg.backoff_s * 2 ** (link.failures - 1))
        link.next_try = self._clock() + delay * random.uniform(0.8, 1.2)

    def succeeded(self, peer: str, *, sent: int, received: int, path: str, compression: str, clipped: bool) -> None:
        """An exchange with `peer` completed: its back-off ends, its traffic is counted."""
        link = self.link(peer)
        link.compression = compression
        link.rounds += 1
        link.failures = 0
        link.next_try = 0.0
        link.bytes_sent += sent
        link.bytes_received += received
        link.last_path = path
        link.clipped += clipped
