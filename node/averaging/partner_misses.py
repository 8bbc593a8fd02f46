"""Trainers that claim to average but never do: after a few missed rounds they stop counting as partners.

Why: a member record is a claim. A record with the trainer role and the swarm's manifest, from a peer
with no averaging handler (or one that is always busy, banned, or of another model), was counted by
`anyone_else` / `Partners.possible`, so every outer step of a real trainer waited out the whole pairing
window for it: a victim fell from 95 to 2.5 inner steps/s (issue #26 item 3).

A round of an outer step *misses* a peer when we asked it (or the schedule gave it to us) and it neither
paired nor asked us itself, and at least one answer was a failure (no handler, a broken stream) or a
refusal, or, as the scheduled partner, it answered "busy" or never showed up. "Not ready" (it is between
outer steps, a phase question the phase shift solves) is no miss, nor is "apart" (a refusal for outer steps
beyond `sync.max_step_gap`: an honest state that the catch-up ends, where sitting out kept two trainers
apart for minutes after a worker restart), nor is "busy" from a peer we asked
outside the schedule: honest peers are busy with their own scheduled partners, and in an odd-sized swarm
the node with a bye hears "busy" from everyone. After `limit` missed rounds in a row
the peer sits out for a back-off that doubles with each exclusion (`backoff_s` up to `max_backoff_s`);
when it ends one try is allowed, and one more miss excludes it again. Pairing with us, or a request from
it that we did not refuse, clears everything: it takes part. The table is bounded like the averager's.

"Not ready" from the partner the schedule gave us is no miss either, at first: an honest partner out of
phase with us says it. But an honest partner says it *between its own outer steps*, and when it publishes
it looks for its partner: the schedule pairs it with us as well (every node computes the same matching), so
it asks us (the smaller PeerID asks; the larger one asks once at the end of its scheduled phase, the
probe), and that request, answered "not ready" by us or not, clears its count. A fake trainer that
answers "not ready" to everything never asks (issue #26: it made every outer step of a real trainer wait
out the pairing window). So a scheduled partner that answered only "not ready" in more than
`not_ready_grace` of our rounds in a row, with no request from it and no pairing in between, misses each
further such round. "Not ready" outside the schedule never counts: a peer paired by its own schedule with
someone else has no reason to ask us.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable
from dataclasses import dataclass

import trio

from node.status_schema import SittingOutStatus

MISS_LIMIT = 3  # missed rounds in a row before a peer sits out
MISS_BACKOFF_S = 30.0  # its first time out; doubled at each exclusion in a row
MISS_BACKOFF_MAX_S = 600.0
# Rounds in a row a scheduled partner may answer only "not ready" (and never ask us) before each further
# one is a miss: a fake that is never ready sits out after NOT_READY_GRACE + MISS_LIMIT rounds.
NOT_READY_GRACE = 2
MAX_PEERS = 4096  # peers remembered; the oldest entries are forgotten first
MAX_SHOWN = 16  # peers named in status (all are counted): a Sybil crowd must not bloat every status answer



class Attempt(enum.Enum):
    """What one request to a partner gave (node/averaging/averager.py, `_try_partner`): what the averager
    does next, and whether the round missed the partner (`PartnerMisses.note`)."""

    PAIRED = "paired"
    NOT_READY = "not ready"  # it is still training (protocols/avg.py, `AnswerCode.asks_again`)
    EXCHANGING = "exchanging"  # busy transferring with another partner: no miss
    BUSY = "busy"  # busy otherwise (with its scheduled partner, asking someone else, ...)
    APART = "apart"  # refused: outer steps beyond `sync.max_step_gap` (no miss: the catch-up ends it)
    REFUSED = "refused"
    FAILED = "failed"  # no answer, a broken stream, a malformed message


# Outcomes of one attempt that miss a round whoever we asked.
_MISSED = frozenset({Attempt.FAILED, Attempt.REFUSED})


class _Mark(enum.Enum):
    """What the current round made of one peer."""

    HEARD = enum.auto()  # it paired with us, or asked us: it takes part
    MISSED = enum.auto()
    NOT_READY = enum.auto()  # scheduled with us, and said only "not ready"
    NEUTRAL = enum.auto()


@dataclass
class _Entry:
    misses: int = 0  # missed rounds in a row
    exclusions: int = 0  # times it was made to sit out in a row
    until: float = 0.0  # trio time until which it sits out
    not_ready: int = 0  # our rounds in a row it was scheduled with us and only said "not ready"


class PartnerMisses:
    """Per peer, missed averaging rounds in a row; `sits_out(peer)` once there were `limit` of them."""

    def __init__(self, *, limit: int = MISS_LIMIT, backoff_s: float = MISS_BACKOFF_S,
                 max_backoff_s: float = MISS_BACKOFF_MAX_S, max_peers: int = MAX_PEERS,
                 not_ready_grace: int = NOT_READY_GRACE,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self.limit = max(1, limit)
        self.not_ready_grace = max(0, not_ready_grace)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_peers = max_peers
        self._clock = clock
        self._peers: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._round: dict[str, _Mark] = {}  # peer -> what the current round made of it
        self.excluded_total = 0  # exclusions so far (status)

    # --- a round ---------------------------------------------------------------------------------------

    def begin_round(self) -> None:
        self._round = {}

    def note(self, peer: str, outcome: Attempt, *, scheduled: bool = False) -> None:
        """What one attempt at `peer` gave (`Attempt`); `scheduled`: it was the partner the schedule gave us
        (which should be waiting for us)."""
        if outcome is Attempt.PAIRED:
            self.heard(peer)
        elif self._round.get(peer) is not _Mark.HEARD:
            if outcome in _MISSED or (scheduled and outcome is Attempt.BUSY):
                self._round[peer] = _Mark.MISSED
            elif scheduled and outcome is Attempt.NOT_READY and self._round.get(peer) is not _Mark.MISSED:
                self._round[peer] = _Mark.NOT_READY
            else:
                self._round.setdefault(peer, _Mark.NEUTRAL)

    def heard(self, peer: str) -> None:
        """`peer` paired with us, or asked us with a request we did not refuse: it takes part."""
        self._round[peer] = _Mark.HEARD
        self._peers.pop(peer, None)

    def end_round(self, scheduled: str | None) -> None:
        """Close the round; `scheduled`: the partner the schedule gave us, a miss if it never showed
        (nor answered anything: "not ready" from it stays no miss)."""
        if scheduled is not None:
            self._round.setdefault(scheduled, _Mark.MISSED)
        for peer, what in self._round.items():
            if what is _Mark.MISSED:
                self._miss(peer)
            elif what is _Mark.NOT_READY:
                entry = self._entry(peer)
                entry.not_ready += 1
                if entry.not_ready > self.not_ready_grace:
                    self._miss(peer)
        self._round = {}

    # --- the verdict -----------------------------------------------------------------------------------

    def sits_out(self, peer: str) -> bool:
        entry = self._peers.get(peer)
        return entry is not None and entry.until > self._clock()

    def sitting_out(self) -> list[str]:
        now = self._clock()
        return sorted(p for p, e in self._peers.items() if e.until > now)

    def status(self, shown: int = MAX_SHOWN) -> SittingOutStatus:
        """``sync.sitting_out``: how many peers sit out now and for how long (the `shown` with the most
        time left, the repeat offenders), so an operator sees whom the averager stopped waiting for."""
        now = self._clock()
        left = sorted(((e.until - now, p) for p, e in self._peers.items() if e.until > now), key=lambda x: (-x[0], x[1]))
        return {
            "count": len(left),
            "exclusions": self.excluded_total,
            "peers": {peer: round(seconds, 1) for seconds, peer in left[:max(0, shown)]},
        }

    def _entry(self, peer: str) -> _Entry:
        entry = self._peers.pop(peer, None) or _Entry()
        self._peers[peer] = entry  # newest last: the oldest are forgotten first
        while len(self._peers) > self.max_peers:
            self._peers.popitem(last=False)
        return entry

    def _miss(self, peer: str) -> None:
        entry = self._entry(peer)
        entry.misses += 1
        if entry.misses >= self.limit:
            entry.until = self._clock() + min(self.max_backoff_s, self.backoff_s * 2 ** entry.exclusions)
            entry.exclusions += 1
            entry.misses = self.limit - 1  # after the back-off, one more miss is enough
            self.excluded_total += 1
