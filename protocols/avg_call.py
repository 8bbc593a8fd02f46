"""What a caller hands the averaging exchange (protocols/avg.py, `initiate` and `respond`), as typed values.

Why apart from the messages: `AvgRequest` and `AvgAnswer` are what crosses the wire, bounded for a hostile
peer; these are what our own averager decides before anything crosses it. An asker's request is an `Ask` until
`initiate` has planned the transfer (element count, chunking, session key and punch port are its own); both
sides pass a `Session` (the pair's ids and the bounds it runs under) and state a `Contribution` (what their
values cover), one in its request, the other in its accept. A transfer's bounds (`TransferLimits`) and its
byte count (`Progress`, which the caller keeps to read the link's rate after a failure too) are the caller's
too, so they live here (protocols/avg.py names them as well).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["Ask", "Contribution", "Progress", "Session", "TransferLimits", "Wire"]


@dataclass(frozen=True)
class Session:
    """One exchange's two ends and the bounds it runs under, the same for the asker and the answerer: the
    peer ids bind the session keys to this pair, `handshake_timeout` bounds the request and its answer,
    `limits` the transfer (it runs as long as it moves); `progress` (the caller's, so that it can read the
    link's rate after a failure too) counts its bytes."""

    local_peer_id: bytes
    remote_peer_id: bytes
    handshake_timeout: float
    limits: TransferLimits
    progress: Progress | None = None


@dataclass(frozen=True)
class Contribution:
    """What one side's values cover and where it stands, as its request or its accept says it: the partner
    weighs a pair's mean by `samples` and checks the Delta's norm against `inner_steps`, meets halfway in
    phase by `waited_ms`, and reads `members` as how many trainers' mean the tensors carry (a group's second
    round). Bounds are the messages' (`AvgRequest`, `AvgAnswer`)."""

    outer_step: int
    inner_steps: int = 0
    samples: int = 0
    waited_ms: int = 0
    members: int = 1


@dataclass(frozen=True)
class Wire:
    """The encoding an asker proposes, all that the transfer's plan depends on besides the element count
    (protocols/avg.py, `make_plans`): the wire dtype and its int8 block, the `sync.compression` preset, and
    phi's fragment under it."""

    dtype: str
    int8_block: int = 4096
    compression: str = "none"
    fragment: int = 0


@dataclass(frozen=True)
class Ask:
    """An asker's request before the transfer is planned: its contribution, the model it trains, the wire it
    proposes, whether it can take a side channel, the round of its outer step, and which of how many streaming
    fragments the tensors are. `initiate` adds the rest of `AvgRequest`."""

    contribution: Contribution
    manifest_hash: str
    layout_hash: str
    wire: Wire
    datapath: bool = True
    stage: int = 1
    stream_fragment: int = 0
    stream_fragments: int = 1


@dataclass(frozen=True)
class TransferLimits:
    """When a transfer is given up. Never for being slow while it moves: a deadline computed from an
    assumed or remembered link rate ruled out every exchange on links slower than the guess, and an
    exchange that was cut taught nothing about the link (on 0.4 Mbit/s links no exchange ever completed).
    So a transfer ends only when it is dead or absurd:

    - ``stall_s``: no byte crossed the connection, either way, for this long (a dead link or partner);
    - ``floor_bps``: after ``stall_s``, its mean rate since it began is below this (bytes/s): a partner
      that trickles a byte now and then to hold our outer step, or a link no training could use;
    - ``max_s``: the whole transfer, however it flows (the last resort against a patient trickler).
    """

    stall_s: float = 30.0
    floor_bps: float = 2_000.0
    max_s: float = 3600.0

    def verdict(self, progress: Progress, began: float, now: float) -> str | None:
        """Why the transfer must end now (None: let it run). Times on the ``time.monotonic`` clock."""
        elapsed = now - began
        if elapsed >= self.max_s:
            return f"the transfer took longer than {self.max_s:g}s"
        if now - (progress.last or began) >= self.stall_s:
            return f"no byte moved for {self.stall_s:g}s"
        if elapsed >= self.stall_s and progress.bytes < self.floor_bps * elapsed:
            return (f"{progress.bytes} bytes in {elapsed:.0f}s is below the floor of "
                    f"{self.floor_bps * 8 / 1000:g} kbit/s")
        return None


class Progress:
    """The bytes one transfer moved and when, counted where they cross the connection (from the side
    channel's threads too: plain attribute updates under the GIL, and a lost count would only make a
    stall look a moment older).

    Why a partner's rate is measured from here: the rate while bytes flow is what the link can do. The
    wall time of a whole exchange also holds the handshake and a side channel's connect, and a failed
    exchange used to teach nothing; this is known after a failure too."""

    def __init__(self) -> None:
        self.bytes = 0
        self.first: float | None = None  # time.monotonic() of the first and latest byte
        self.last: float | None = None

    def moved(self, n: int) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
        self.last = now
        self.bytes += n

    def rate_bps(self, min_flow_s: float = 0.01) -> float | None:
        """Bytes/s while data flowed (both directions together), or None where it flowed for less than
        ``min_flow_s`` (too short to say anything about the link)."""
        if self.first is None or self.last is None or self.last - self.first < min_flow_s:
            return None
        return self.bytes / (self.last - self.first)
