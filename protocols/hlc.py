"""Hybrid logical clock (HLC) for ordering swarm-state records.

Why not plain wall time: a node's wall clock can step backwards (NTP correction, a VM restore, a
reboot with a bad RTC). If records were ordered by wall time alone, a node that restarted with its
clock behind would publish records that every replica considers *older* than the ones it published
before, and its fresh state would be ignored until the clock caught up.

An HLC timestamp is ``(wall_ms, logical)``: the wall-clock part tracks physical time closely (so
timestamps stay meaningful to humans), and the logical part breaks ties and absorbs backward clock
steps. Each clock guarantees that every timestamp it issues is strictly greater than every timestamp
it issued or observed before. Observing the timestamps of records received from others is what makes
a restarted node (which learns its own old records from its peers) continue *after* them.

Guard against runaway clocks: a timestamp more than ``max_drift_s`` ahead of local physical time is
refused by :meth:`HybridLogicalClock.observe` instead of being adopted. Otherwise one peer with a badly
wrong clock (or a malicious one claiming the year 3000) would drag every clock in the swarm into the
future for good. A timestamp inside that limit moves this clock at most ``max_lead_s``
(:data:`MAX_LEAD_S`) ahead of local physical time (:meth:`HybridLogicalClock.follow`); see there why.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

#: Upper bound for the wall-clock part, in milliseconds (keeps values exact in a float64 and well
#: inside msgpack's integer range).
MAX_WALL_MS = 2**53 - 1
#: Upper bound for the logical counter; when reached the clock borrows one millisecond instead.
MAX_LOGICAL = 2**32 - 1
#: How far ahead of local physical time another node's timestamp may move this clock, in seconds.
#: Why a bound well below the drift limit: a record dated 599.9 s ahead (just inside the 600 s limit) was
#: adopted whole, so the victim's own records then carried +599.9 s, and a node whose clock ran 1 s
#: behind refused every one of them as skewed and saw a healthy node as gone after 61 s. One peer could
#: so push everyone's timestamps towards the limit. Records are ordered per author, so nothing needs our
#: clock to pass a far-ahead peer's; a few seconds still absorb ordinary skew between honest clocks.
MAX_LEAD_S = 5.0


class Timestamp(NamedTuple):
    """An HLC timestamp; tuples compare lexicographically, which is exactly HLC order."""

    wall_ms: int
    logical: int

    def __str__(self) -> str:
        return f"{self.wall_ms}.{self.logical}"


class ClockSkewError(ValueError):
    """A remote timestamp is further in the future than the allowed drift."""


class HybridLogicalClock:
    """A monotonic hybrid logical clock.

    ``clock`` returns physical time in seconds (``time.time`` by default); tests inject a fake one.
    The clock is not thread-safe; the daemon uses it from a single trio task.
    """

    def __init__(self, clock: Callable[[], float] = time.time, *, max_drift_s: float = 600.0,
                 max_lead_s: float = MAX_LEAD_S) -> None:
        if max_drift_s <= 0:
            raise ValueError(f"max_drift_s must be positive, got {max_drift_s}")
        if max_lead_s < 0:
            raise ValueError(f"max_lead_s must not be negative, got {max_lead_s}")
        self._clock = clock
        self._max_drift_ms = int(max_drift_s * 1000)
        self._max_lead_ms = int(min(max_lead_s, max_drift_s) * 1000)
        self._last = Timestamp(0, 0)

    @property
    def last(self) -> Timestamp:
        """The greatest timestamp issued or observed so far."""
        return self._last

    def physical_ms(self) -> int:
        """Current physical time in whole milliseconds."""
        return min(max(int(self._clock() * 1000), 0), MAX_WALL_MS)

    def now(self) -> Timestamp:
        """Issue a new timestamp, strictly greater than any issued or observed before."""
        physical = self.physical_ms()
        last = self._last
        if physical > last.wall_ms:
            ts = Timestamp(physical, 0)
        elif last.logical < MAX_LOGICAL:
            ts = Timestamp(last.wall_ms, last.logical + 1)
        else:  # a burst of 4 billion events in one millisecond: borrow the next millisecond
            ts = Timestamp(last.wall_ms + 1, 0)
        self._last = ts
        return ts

    def too_far_ahead(self, ts: Timestamp) -> bool:
        """Whether ``ts`` lies more than the allowed drift ahead of local physical time."""
        return ts.wall_ms > self.physical_ms() + self._max_drift_ms

    def observe(self, ts: Timestamp) -> None:
        """Account for a timestamp received from elsewhere, so later :meth:`now` calls exceed it, as far
        as :meth:`follow` allows.

        Raises :class:`ClockSkewError` (and leaves the clock untouched) when ``ts`` is further ahead of
        local physical time than ``max_drift_s``.
        """
        if self.too_far_ahead(ts):
            raise ClockSkewError(
                f"timestamp {ts} is {(ts.wall_ms - self.physical_ms()) / 1000:.1f} s ahead of the local clock "
                f"(allowed drift {self._max_drift_ms / 1000:.0f} s)"
            )
        self.follow(ts)

    def follow(self, ts: Timestamp) -> bool:
        """Account for another node's timestamp without the drift check, but never move this clock past
        local physical time plus ``max_lead_s`` (:data:`MAX_LEAD_S` says why). Returns whether ``ts`` was
        beyond that ceiling (the clock then stops at it: our next timestamps may sort before ``ts``)."""
        ceiling = Timestamp(min(self.physical_ms() + self._max_lead_ms, MAX_WALL_MS), 0)
        self.adopt(min(ts, ceiling))
        return ts > ceiling

    def adopt(self, ts: Timestamp) -> None:
        """Like :meth:`observe` but without the drift check: for timestamps this node issued itself
        (restored from its own state file), which were accepted when they were made."""
        if ts > self._last:
            self._last = Timestamp(ts.wall_ms, ts.logical)
