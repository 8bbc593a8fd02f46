"""The daemon's side of an outer step: pair with one partner and average, or step solo.

The worker publishes `(phi, Delta)` in shared memory and the supervisor calls `Averager.exchange`. Who
pairs with whom comes from a schedule that every trainer computes from the outer step and the
trainers it knows (node/averaging/pairing.py: a fresh random matching per outer step, the solo step rotating
when their number is odd, and local: views a few members apart still give nearly everyone the same partner), because "whoever asks first" phase-locks equal machines into fixed pairs and
starves an odd one out. For up to `sync.pair_window_s`:

1. *Scheduled phase* (the first half of the window): only the scheduled partner counts. The smaller
   PeerID of the pair asks (again every few hundred ms while the partner is still training), the other
   waits for it; anyone else asking is told we are busy. A scheduled partner that refuses, fails or is
   busy with someone else ends this phase at once: the views disagreed.
2. *Open phase* (the rest): any ready eligible partner, least recently paired first; requests from
   anyone are accepted. This is where a bye, a new member or a node whose view differs finds a partner.

No node ever waits for more than one partner, and a partner that refuses, fails or misses its deadline
costs a back-off for that partner and, at worst, a solo step here. Crossing requests (A asks B while B
asks A) become one exchange: the request of the smaller PeerID wins. Once paired, a transfer runs as long
as it moves (`sync.stall_timeout_s` without a byte, a floor of a few kbit/s, `sync.max_transfer_s` in all:
protocols/avg.py, `TransferLimits`), so a slow link is never ruled out by a guess of its rate; each
partner's rate is measured while bytes flow, after failed transfers too, and shown in status. The worker
keeps training meanwhile (node/worker/trainer.py): on a slow link an outer step simply lasts as long as its
exchange.

Phase: outer steps are paced by time (node/worker/trainer.py, `publish_due`), and two partners that published at
different moments meet halfway: each tells the other how long it waited for the pairing, and the result
moves the next publish by half the difference (`ExchangeOutcome.shift_s`), so phases converge across the
swarm like any gossip average. A node that found nobody ready at all in its window is out of phase with
everyone: the trainers it asked said how long ago they published and whether they averaged, and it moves
its next publish all the way to the phase of those that averaged (they are in phase with their partners
and stay where they are) or halfway towards those that did not (they move towards us too)
(`_phase_shift`).

Groups of four: with `sync.group_size` = 4 (opt-in) an outer step has a second round with the
partner the schedule gives for it (`_second_round`): each side sends what its first round gave (the
pair's sample-weighted means, or its own values after a bye) and says how many trainers and samples
that stands for, and both end with the sample-weighted means of the group (of four, or three with a
bye). The second round waits for its scheduled partner only (no open phase, one window); when it does
not happen the first round's result stands. A second-round request carries `stage` 2, so it never meets
a first-round exchange. When it reaches a partner still in its first round, and comes from the trainer
the schedule gives that partner for its second round, the partner holds it until its second round
begins (`_await_round`: at most what is left of its first round's window, and never near the asker's
answer deadline) instead of sending the asker away to ask again a few hundred ms later; a request it
could not hold is answered "not ready", and the asker asks again.

Weights: each side says how many inner steps and samples its Delta covers; the worker weights the pair's
Delta and its phi pull by samples (node/worker/outer.py, `PairWeights`). What a partner sends is bounded before it reaches the
worker (node/averaging/robust.py): its Delta norm and its phi's distance from ours are clipped to a multiple of our
own Delta norm per inner step (scaled by the steps the exchange covers, a partner's claimed steps and
samples credited up to the swarm's H); only values that are no model of ours (non-finite, or longer than
`sync.max_delta_ratio` x our own phi's norm) are refused.

Compression: the initiator names the exchange's `sync.compression` preset in its request (and the phi
fragment), and both sides' wires, outcomes and workers follow it. With a fixed preset a responder refuses any
other; with `auto` (the default) the initiator picks one per exchange from the partner's measured rate and the
outer step's compute period (`outer_period`, else the pace; node/averaging/compression_choice.py), and an `auto`
responder takes whatever known preset the request names, since both ends measured the same link.

Two rules keep heterogeneous machines from drifting apart for good:

- When the daemon knows of no other trainer that could pair at all (alive, of our run, with a usable
  path, whatever its outer step), the outer step is solo at once: waiting out the pairing window would
  only slow down a node that nobody can pair with. Trainers that exist but whose records put them outside
  `sync.max_step_gap` still get the window (records lag a heartbeat, and in a swarm of short outer steps
  a node that never waited would race away from everyone). Busy partners count as eligible.
- After an exchange both partners adopt the larger of their two outer steps (each learns the other's
  from the request or the answer, `ExchangeOutcome.group_outer_step` hands it to the worker), so paired
  nodes' counters never drift apart. A node whose outer steps have gone unaveraged for a while re-syncs
  from the swarm instead (node/averaging/latejoin.py, `CatchUp`), fed by `on_outer_step`; at once when a partner
  refuses it as too far behind (`on_behind`). Refusals show in status (`last_refusal`) and in the log at
  INFO, once a minute per peer and reason: `declined` alone rose while the reason was logged at debug.
"""

from __future__ import annotations

import collections
import functools
import ipaddress
import logging
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import trio
from libp2p.peer.id import ID

from node.averaging.compression_choice import AUTO, choose_compression
from node.averaging.pairing import scheduled_partners
from node.averaging.partner_misses import Attempt, PartnerMisses
from node.averaging.robust import UpdateBound
from node.bridge.exchange import ExchangeOutcome, ExchangeRequest
from node.config.sync import SyncConfig
from node.status_schema import DIRECT_PATHS, MixingStatus, SyncStatus
from p2p.datapath import DataPathListener
from p2p.wire import ProtocolError, close_quietly
from protocols import avg
from protocols.avg import AnswerCode, Declined, Rejected, Tensors
from protocols.compress import PRESETS, get_compression

log = logging.getLogger("starling.averager")

BACKOFF_MAX_S = 300.0
# Protocol errors that only a buggy or hostile partner produces (a dead link is no offence).
_MALFORMED = {"malformed", "too_large", "bad_kind", "bad_version", "bad_field", "bad_size", "auth"}
RATE_EWMA = 0.5
MAX_INBOUND = 16  # pairing requests read concurrently
MAX_INBOUND_PER_IP = 4  # of those, from one IP address (one machine's Sybil identities share it)
IP_BAN_AFTER = 2  # identities banned from one IP before the IP itself is banned (identities are free)
MAX_LINKS = 4096  # partners remembered (rate, back-off, bans); the least useful are forgotten first
SCHEDULED_SHARE = 0.5  # of the pairing window spent on the scheduled partner only
SCHEDULED_RETRY_S = (0.15, 0.3)  # asking a scheduled partner that is still training, again after this
# A second-round request that arrives during our first round is held for at most this share of the
# handshake deadline (the asker's wait for our answer; past it the asker counts a failure against us).
HOLD_SHARE = 0.5
HOLD_MARGIN_S = 0.5  # past our first round's window: the second round begins right after it ends
REFUSAL_LOG_S = 60.0  # a refusal is logged at INFO at most this often per peer and kind of reason
# How long a scheduled partner that is busy *transferring* is waited for: this many times our own typical
# transfer (an EWMA of our exchanges' durations), when that is longer than the pairing window.
BUSY_WAIT_FACTOR = 1.5
MIXING_WINDOW = 20  # outer steps that `status()["mixing"]` and the member record's partners look back over


@dataclass
class _Pending:
    """One round of this node's published outer step while it looks for a partner."""

    request: ExchangeRequest  # its `layout_hash` is what partners compare
    tensors: Tensors
    stage: int = 1  # the round of the outer step (node/averaging/pairing.py, `schedule`)
    members: int = 1  # trainers whose (mean) values `tensors` carries: 2 in a second round after a pair
    samples: int | None = None  # the samples those values stand for (None: the request's own)
    inner_steps: int | None = None  # the most inner steps among them (None: the request's own)
    window_s: float | None = None  # how long this round looks for a partner (None: sync.pair_window_s)
    open_phase: bool = True  # whether anyone may be asked once the scheduled partner is out of reach
    claimed_by: str | None = None  # partner peer id once an exchange owns the outputs; "solo" when closed
    progress: avg.Progress | None = None  # the claiming exchange's bytes, while its transfer runs (status)
    initiating_to: str | None = None
    result: int = 1
    done: trio.Event = field(default_factory=trio.Event)
    transfer_finished: trio.Event = field(default_factory=trio.Event)
    transfer_scope: trio.CancelScope | None = None
    partner_outer_step: int | None = None  # the partner's, from its request or its answer
    partner_samples: int = 0
    partner_inner_steps: int = 0
    partner_members: int = 1
    partner_waited_s: float = 0.0
    began: float = 0.0  # when the worker published (trio clock)
    waited_s: float = 0.0  # from the publish to the pairing
    scheduled: str | None = None  # this outer step's partner by the schedule (None: a bye, or no schedule)
    next_partner: str | None = None  # the schedule's partner for the outer step's next round (groups of four)
    scheduled_until: float = 0.0  # end of the scheduled phase
    probed: bool = False  # the larger PeerID asked its scheduled partner once, its request not having come
    saw_ready: bool = False  # some partner was ready (busy with someone else counts) during the window
    # Between-steps answers: how far (s) each asked trainer's publish was from ours (theirs - ours), and
    # whether its last outer step was averaged.
    phase_gaps: list[tuple[float, bool]] = field(default_factory=list)
    largest_seen: int = 0  # the largest outer step a ready partner showed us in this window
    # The exchange's `sync.compression` preset and phi fragment: the initiator's choice (protocols/compress.py,
    # node/averaging/compression_choice.py), set when the round is paired.
    compression: str = "none"
    fragment: int = 0

    @property
    def own_steps(self) -> int:
        return self.request.inner_steps if self.inner_steps is None else self.inner_steps

    def in_scheduled_phase(self, now: float) -> bool:
        return self.scheduled is not None and now < self.scheduled_until

    def mark_paired(self, partner: str, now: float) -> None:
        self.claimed_by = partner
        self.waited_s = now - self.began


@dataclass
class _Link:
    """What we know of one partner: measured rate and back-off."""

    rate_bps: float | None = None  # bytes/s each way while data flowed (EWMA; None: never measured)
    failures: int = 0
    offences: int = 0
    banned_until: float = 0.0
    next_try: float = 0.0
    rounds: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    last_path: str = ""  # what carried the bulk last time: datapath (side channel) or stream (libp2p)
    clipped: int = 0  # exchanges whose values we clipped (node/averaging/robust.py)
    ip: str | None = None  # the address its latest request or answer came from
    compression: str | None = None  # the preset of our latest exchange with it (`sync.compression = auto`)


def _per_ip_key(ip: str | None) -> str | None:
    """The address that per-IP limits and bans count under; None (exempt) for loopback: peers on this
    machine are the operator's own (`make run`'s local swarm puts every peer on 127.0.0.1)."""
    if ip is None:
        return None
    try:
        return None if ipaddress.ip_address(ip).is_loopback else ip
    except ValueError:
        return ip


class Averager:
    def __init__(
        self,
        host: Any,
        cfg: SyncConfig,
        *,
        manifest_hash: Callable[[], str | None],
        eligible_peers: Callable[[], list[str]] | None = None,
        metrics: Any = None,
        listen_host: str = "127.0.0.1",
        path_of: Callable[[str], str] | None = None,
        on_transfer: Callable[[str, int, float], None] | None = None,
        reachable: Callable[[], bool] | None = None,
        on_outer_step: Callable[[bool], None] | None = None,
        anyone_else: Callable[[], bool] | None = None,
        pace: Callable[[], float] | None = None,
        max_inner_steps: int | None = None,
        swarm_steps: Callable[[], dict[str, int]] | None = None,
        speeds: Callable[[], dict[str, float]] | None = None,
        outer_period: Callable[[], float] | None = None,
        on_behind: Callable[[int], None] | None = None,
    ) -> None:
        self.host = host
        self.cfg = cfg
        self.manifest_hash = manifest_hash
        self.eligible_peers = eligible_peers
        self.metrics = metrics
        self.path_of = path_of  # direct | hole-punched | relayed | none (node/swarm/nat.py)
        self.on_transfer = on_transfer
        # Behind a NAT our side-channel port cannot be reached: offering it would cost the partner a
        # connect timeout on every round before it falls back to the libp2p stream.
        self.reachable = reachable
        # Told at the end of every outer step whether it was averaged (the catch-up counts the steps
        # without a partner). Not whether a partner looked eligible at its start: a partner one step
        # beyond `sync.max_step_gap` is eligible by its record (which may lag a heartbeat) and yet refuses
        # every request, and two such trainers stepped solo side by side for minutes, never catching up.
        self.on_outer_step = on_outer_step
        # Told a partner's outer step when it refused us as too far behind it: the catch-up starts now,
        # not after `sync.catch_up_after` more outer steps (a restarted worker resumes from a checkpoint
        # up to `train.checkpoint_every` outer steps back, while its partner went on).
        self.on_behind = on_behind
        self._refusal_logged: dict[tuple[str, AnswerCode], float] = {}  # (peer, reason) -> trio time logged
        # Whether any other trainer of our run could pair at all, whatever its outer step: when none can,
        # the outer step is solo at once. Trainers that the records show outside the step gap still get the
        # pairing window: records lag (a heartbeat old), the gap is judged on the actual request, and where
        # outer steps are short a node that never waits races ahead of everyone and pairs with no one.
        self.anyone_else = anyone_else
        # The swarm's pace (seconds between two publishes; 0: none), for the phase of trainers between steps.
        self.pace = pace
        # Outer steps of the swarm's alive trainers (member records), to keep our counter in their range.
        self.swarm_steps = swarm_steps
        # Samples/s of the trainers (ours included) as their records show: the schedule pairs like speeds
        # in some outer steps (node/averaging/pairing.py).
        self.speeds = speeds
        # Compute seconds of one of our outer steps (H inner steps; 0: unknown), against which
        # `sync.compression = auto` weighs a transfer's predicted time. None: the pace stands for it.
        self.outer_period = outer_period
        self._last_publish_at: float | None = None  # trio clock: our latest publish
        self.listener = DataPathListener(listen_host, cfg.datapath_port, max_frame_size=avg.MAX_FRAME) if cfg.datapath else None
        self.me = str(host.get_id())
        self._pending: _Pending | None = None
        self._links: dict[str, _Link] = {}
        self.stats: dict[str, Any] = {
            "rounds": 0,
            "solo_rounds": 0,
            "unpaired_rounds": 0,  # solo at once: no eligible partner when the outer step began
            "failures": 0,
            "declined": 0,
            "last_partner": None,
            "last_duration_s": None,
            "last_bytes": None,
            "last_path": None,
            "bytes_sent": 0,
            "bytes_received": 0,
            "last_bytes_per_param": None,  # payload bytes this node sent per parameter in its last exchange
            "last_compression": None,  # the sync.compression preset its wire used (auto chooses per exchange)
            "last_error": None,
        }
        # The latest refusal either way (a partner's answer to us, or ours to it), for status: `declined`
        # alone counted them while the reason was logged at debug level only.
        self._last_refusal: tuple[str, str, str, str, float] | None = None  # (peer, by, reason, hint, time)
        self._last_success_at = -math.inf  # trio time of our latest completed exchange
        self._partners: set[str] = set()
        # (outer step, its partners (none: a solo step), whether the first was the scheduled one), newest last.
        self._recent: collections.deque[tuple[int, tuple[str, ...], bool]] = collections.deque(maxlen=MIXING_WINDOW)
        self._last_paired: dict[str, int] = {}  # partner -> our exchange count when we last averaged with it
        self._last_outer_step = 0  # the outer step our latest exchange ended at (after any adoption)
        self.rejections: dict[str, int] = {}
        self._inbound = 0
        self._inbound_by_ip: dict[str, int] = {}
        # Per IP: identities banned from it, and until when the IP itself is banned. A fresh PeerID costs
        # nothing, so bans per identity alone let one machine offend forever (bounded like _links).
        self._ip_bans: collections.OrderedDict[str, tuple[int, float]] = collections.OrderedDict()
        # The swarm's H: the most inner steps an honest partner's Delta covers (node/averaging/robust.py).
        self.bound = UpdateBound(cfg.clip_ratio, cfg.max_delta_ratio, max_inner_steps, cfg.clip_phi_ratio)
        self.clipped: dict[str, int] = {"delta": 0, "phi": 0}
        self._phi_mean: np.ndarray | None = None  # a pair's mean phi, sent in a second round
        if cfg.assumed_rate_mbps != 100.0 or cfg.deadline_slack != 3.0:
            log.warning("sync.assumed_rate_mbps and sync.deadline_slack are ignored now: a transfer runs as long "
                        "as it moves (sync.stall_timeout_s, sync.max_transfer_s); remove them from the config")
        self._round_begun = trio.Event()  # set (and replaced) whenever a round of an outer step begins
        self._transfer_s: float | None = None  # our exchanges' typical duration (EWMA), for `_busy_wait_s`
        # Our typical rate each way over all partners (EWMA): `auto`'s guess for a partner not measured yet.
        self._rate_bps: float | None = None
        # Trainers that claim to average but miss round after round sit out (node/averaging/partner_misses.py).
        self.misses = PartnerMisses()

    # --- lifecycle ---------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.host.set_stream_handler(avg.PROTOCOL_ID, self._handle_stream)
        # A 1.2.0 asker (a node not upgraded yet) is answered without the reason code (protocols/avg.py).
        self.host.set_stream_handler(avg.PROTOCOL_ID_1_2, functools.partial(self._handle_stream, coded=False))
        async with trio.open_nursery() as nursery:
            if self.listener is not None:
                await nursery.start(self.listener.serve)
            task_status.started()
            await trio.sleep_forever()

    def status(self) -> SyncStatus:
        st = cast("SyncStatus", dict(self.stats))  # the counters; the rest is checked key by key
        st["distinct_partners"] = len(self._partners)
        st["wire_dtype"] = self.cfg.wire_dtype
        st["compression"] = self.cfg.compression
        st["datapath_port"] = self.listener.port if self.listener is not None else None
        st["per_peer"] = {
            p: {"rounds": link.rounds, "bytes_sent": link.bytes_sent, "bytes_received": link.bytes_received,
                "rate_mbps": None if link.rate_bps is None else round(link.rate_bps * 8 / 1e6, 3), "failures": link.failures, "path": link.last_path,
                "clipped": link.clipped}
            for p, link in self._links.items()
        }
        st["mixing"] = self.mixing()
        pending = self._pending
        st["state"] = "idle" if pending is None else ("pairing" if pending.claimed_by is None else "exchanging")
        if pending is not None and pending.progress is not None and pending.claimed_by not in (None, "solo"):
            # What a slow link's operator wants to see: the transfer is moving, and how fast.
            moved = pending.progress
            rate = moved.rate_bps()
            st["transfer"] = {"partner": str(pending.claimed_by), "bytes": moved.bytes,
                              "seconds": round(trio.current_time() - pending.began - pending.waited_s, 1),
                              "rate_mbps": None if rate is None else round(rate * 8 / 2 / 1e6, 3)}
        st["rejections"] = dict(self.rejections)
        st["clipped"] = dict(self.clipped)
        now = trio.current_time()
        st["banned"] = sorted(p for p, link in self._links.items() if link.banned_until > now)
        st["sitting_out"] = self.misses.status()
        st["last_refusal"] = None
        if self._last_refusal is not None:
            peer, by, reason, hint, at = self._last_refusal
            st["last_refusal"] = {"peer": peer, "by": by, "reason": reason, "hint": hint,
                                  "seconds_ago": round(now - at, 1), "averaged_since": self._last_success_at > at}
        return st

    def _note_refusal(self, peer: str, by: str, code: AnswerCode, reason: str, ours: int, theirs: int) -> None:
        """Record a refusal for status and log it at INFO, once a minute per peer and kind of reason
        (`code`): a node that steps solo beside an alive partner must say why (`by`: "partner" refused us,
        "us")."""
        now = trio.current_time()
        hint = ""
        if code is AnswerCode.STEP_GAP:
            behind = theirs - ours
            hint = (f"{'this node' if behind > 0 else 'the partner'} is {abs(behind)} outer steps behind "
                    f"(sync.max_step_gap {self.cfg.max_step_gap}): "
                    f"{'it' if behind > 0 else 'the partner'} catches up from the swarm")
        self._last_refusal = (peer, by, reason, hint, now)
        key = (peer, code)
        if now < self._refusal_logged.get(key, -math.inf):
            return
        self._refusal_logged[key] = now + REFUSAL_LOG_S
        if len(self._refusal_logged) > MAX_LINKS:
            self._refusal_logged.pop(next(iter(self._refusal_logged)))
        if by == "partner":
            log.info("partner %s refused to average: %r%s", peer, reason, f"; {hint}" if hint else "")
        else:
            log.info("refused to average with %s: %r%s", peer, reason, f"; {hint}" if hint else "")

    def mixing(self) -> MixingStatus:
        """Whom this node averaged with over its last MIXING_WINDOW outer steps, and how often it stepped
        solo: what `starling status` shows and `starling doctor` checks for islands."""
        recent = list(self._recent)
        partners: dict[str, int] = {}
        for _, step_partners, _ in recent:
            for partner in step_partners:
                partners[partner] = partners.get(partner, 0) + 1
        averaged = sum(1 for _, step_partners, _ in recent if step_partners)
        return {
            "window": MIXING_WINDOW,
            "outer_steps": len(recent),
            "averaged": averaged,
            "solo": len(recent) - averaged,
            "solo_share": round((len(recent) - averaged) / len(recent), 3) if recent else None,
            "scheduled": sum(1 for _, p, sched in recent if p and sched),
            "partners": partners,
            "distinct_partners": len(partners),
        }

    def recent_partners(self) -> list[str]:
        """Distinct partners over the last MIXING_WINDOW outer steps, most frequent first (for the member
        record, so that every node can see the swarm's pairing graph)."""
        counts = self.mixing()["partners"]
        return sorted(counts, key=lambda p: (-counts[p], p))

    # --- validation of what partners send ------------------------------------------------------------------

    def _credit(self, pending: _Pending) -> tuple[int, int]:
        """The partner's inner steps and samples as we believe them (node/averaging/robust.py, `credit`); a side
        that carries the mean of `members` trainers is credited up to that many trainers' samples."""
        own = pending.request
        members = max(1, pending.partner_members)
        credited = self.bound.credit(own.inner_steps, own.samples, pending.partner_inner_steps,
                                     pending.partner_samples // members)
        return credited.inner_steps, credited.samples * members

    def _values_judge(self, pending: _Pending) -> avg.Validator:
        """What the transfer asks once the partner's values are in: how much of them to keep
        (`UpdateBound.judge`). The partner's steps are known only once it has answered, so they are read
        when the values arrive."""
        return lambda seen: self.bound.judge(seen, pending.own_steps, self._credit(pending)[0])

    # --- the supervisor's call ---------------------------------------------------------------------------

    async def exchange(self, request: ExchangeRequest) -> ExchangeOutcome:
        """Average this outer step with the partners the schedule gives; the outcome's `group_size` is
        the group size n (2 for a pair, up to 4 after a second round), or 1 for a solo step. The request
        is not changed, only its output tensors (and its Delta slot in a second round).

        With n >= 2, `request.phi_out` and `request.delta_out` hold the group's sums of phi and Delta
        (the worker's outer step divides by n). After one round they are the pair's plain sums (the same
        bits on both partners) and the outcome's `partner_samples` the partner's credited samples (the
        worker weights the pair's mean by samples, node/worker/outer.py); after a second round they are n times
        the group's sample-weighted means, already weighted (`partner_samples` 0).

        After an exchange, the outcome's `group_outer_step` is the largest outer step of the group (the
        worker adopts it). With no other trainer to pair with (`anyone_else`) the step is solo at once
        (see the module docstring); otherwise it waits up to the pairing window for a partner.
        """
        if self.eligible_peers is not None:
            has_partner = any(p != self.me for p in self.eligible_peers())
            if not has_partner and self.anyone_else is not None and not self.anyone_else():
                if self.on_outer_step is not None:
                    self.on_outer_step(False)
                self.stats["solo_rounds"] += 1
                self.stats["unpaired_rounds"] += 1
                self._recent.append((request.outer_step, (), False))
                log.debug("outer step %d: solo after 0.00s (no other trainer to pair with)", request.outer_step)
                return ExchangeOutcome.solo(self._follow_the_swarm(request.outer_step, None))
        began = trio.current_time()
        first, second = scheduled_partners(self.me, self._schedule_members(), request.outer_step,
                                           self.speeds() if self.speeds is not None else None)
        if self.cfg.group_size < 4:
            second = None
        arrays = _arrays(request)
        pending = _Pending(
            request,
            arrays,
            began=began,
            scheduled=first,
            scheduled_until=began + SCHEDULED_SHARE * self.cfg.pair_window_s,
            next_partner=second,
        )
        self._last_publish_at = began
        partners: list[str] = []
        joins_later = first is None and second is not None
        if not joins_later:
            await self._run_round(pending)
        # (A bye with a second-round partner joins that partner's pair instead of looking for anyone.)
        size = pending.result
        partner_samples, shift_s = 0, 0.0
        if size < 2:
            if not pending.saw_ready and not joins_later:
                # Nobody was ready in the whole window: our phase is off everyone's. Move towards theirs.
                shift_s = self._phase_shift(pending.phase_gaps)
            # A solo step follows the largest outer step that ready trainers showed us meanwhile (within our
            # gap), as an exchange does: the schedule is keyed by the outer step, and a node one step
            # behind the others would otherwise compute another matching than theirs at every step.
            group_outer_step = self._group_outer_step(request.outer_step, pending.largest_seen or None)
        else:
            group_outer_step = self._group_outer_step(request.outer_step, pending.partner_outer_step)
            partner_samples = self._credit(pending)[1]
            # Meet halfway: the one that waited longer published earlier and moves its next publish later.
            shift_s = (pending.waited_s - pending.partner_waited_s) / 2
            partners.append(str(pending.claimed_by))
        if second is not None:
            size, group_outer_step = await self._second_round(request, arrays, pending if size >= 2 else None,
                                                              second, size, partners, group_outer_step)
            # The outputs hold weighted means (or a solo step's): no pair weighting is left to the worker.
            partner_samples = 0
        if size < 2:
            self.stats["solo_rounds"] += 1
        self._recent.append((request.outer_step, tuple(partners), partners[:1] == [first] if first else False))
        for partner in partners:
            self._last_paired[partner] = self.stats["rounds"]
        group_outer_step = self._follow_the_swarm(request.outer_step, group_outer_step)
        self._last_outer_step = max(request.outer_step, group_outer_step or 0)
        if self.on_outer_step is not None:
            self.on_outer_step(size >= 2)
        log.debug("outer step %d: %s after %.2fs", request.outer_step,
                  f"averaged in a group of {size}" if size >= 2 else "solo", trio.current_time() - began)
        # The first round's preset (a second round, in groups of four, is always `none`).
        preset = get_compression(pending.compression if size >= 2 else "none")
        phi_range = preset.fragment_range(arrays.phi.size, pending.fragment) if preset.lossy else None
        return ExchangeOutcome(size, group_outer_step, partner_samples, shift_s, preset.name, phi_range)

    async def _run_round(self, pending: _Pending) -> None:
        """Look for a partner and exchange with it, for one round; `pending.result` says how it went."""
        self._pending = pending
        self._round_begun.set()  # wakes requests held for this round (`_await_round`)
        self._round_begun = trio.Event()
        self.misses.begin_round()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pair, pending)
                await pending.done.wait()
                nursery.cancel_scope.cancel()
        finally:
            # A scheduled partner that never showed up is a miss only when the round found nobody else.
            self.misses.end_round(pending.scheduled if pending.result < 2 else None)
            self._pending = None
            if pending.transfer_scope is not None and not pending.transfer_finished.is_set():
                # We are being cancelled while a responder transfer writes into the outputs: stop it
                # and wait for it to let go of the shared memory before the worker reuses it.
                pending.transfer_scope.cancel()
                with trio.CancelScope(shield=True), trio.move_on_after(5):
                    await pending.transfer_finished.wait()

    async def _second_round(self, request: ExchangeRequest, arrays: Tensors, first: _Pending | None, partner: str,
                            size: int, partners: list[str], group_outer_step: int) -> tuple[int, int]:
        """The second round of a group step (node/averaging/pairing.py, `schedule`): send what the first round gave
        (the pair's sample-weighted means, or our own values after a bye or a failed first round) to the
        second-round partner, receive its side's, and leave n times the group's weighted means in the
        outputs. Returns the group size and the group's outer step (`group_outer_step`: the first round's);
        a second round that does not happen or fails leaves the first round's result (a pair's weighted
        means, or a solo step).

        Where the pair's means go: phi's into a buffer of ours (the worker's phi slot is its live phi),
        Delta's into the worker's Delta slot, which it only wrote for us (its outer step recomputes its
        own Delta from its weights, node/worker/trainer.py `apply_result`)."""
        own_samples = max(0, request.samples)
        if first is not None:
            partner_samples = self._credit(first)[1]
            phi_mean = self._phi_buffer(arrays.phi)
            _weighted_mean(phi_mean, arrays.phi, arrays.phi_out, own_samples, partner_samples)
            _weighted_mean(arrays.delta, arrays.delta, arrays.delta_out, own_samples, partner_samples)
            mine = Tensors(phi_mean, arrays.delta, arrays.phi_out, arrays.delta_out)
            members, samples = 2, own_samples + partner_samples
            steps = max(request.inner_steps, self._credit(first)[0])
        else:
            mine = arrays
            members, samples, steps = 1, own_samples, request.inner_steps
        began = trio.current_time()
        # A bye's partner is still in its first round: it gets that round's window as well.
        window = self.cfg.pair_window_s * (2 if first is None and not partners else 1)
        pending = _Pending(request, mine, stage=2, members=members, samples=samples, inner_steps=steps,
                           window_s=window, open_phase=False, began=began, scheduled=partner,
                           scheduled_until=began + window)
        await self._run_round(pending)
        if pending.result < 2:
            if first is None:
                return size, group_outer_step
            # The transfer may have written into the outputs before it failed: the first round's result
            # is the pair's means, kept in `mine`.
            np.multiply(mine.phi, 2, out=arrays.phi_out)
            np.multiply(mine.delta, 2, out=arrays.delta_out)
            return 2, group_outer_step
        partners.append(partner)
        theirs = self._credit(pending)[1]
        group = members + pending.partner_members
        # The outputs hold the plain sum of the two sides' means; weight each side by its samples (by its
        # members where samples are unknown) and scale by the group size for the worker.
        weights = (samples, theirs) if samples > 0 and theirs > 0 else (members, pending.partner_members)
        _weighted_mean(arrays.phi_out, mine.phi, arrays.phi_out, *weights, scale=group)
        _weighted_mean(arrays.delta_out, mine.delta, arrays.delta_out, *weights, scale=group)
        return group, self._group_outer_step(group_outer_step, pending.partner_outer_step)

    def _phi_buffer(self, like: np.ndarray) -> np.ndarray:
        """A model-sized fp32 buffer for a pair's mean phi, kept between outer steps."""
        if self._phi_mean is None or self._phi_mean.shape != like.shape:
            self._phi_mean = np.empty_like(like)
        return self._phi_mean

    def _follow_the_swarm(self, outer_step: int, group_outer_step: int | None) -> int | None:
        """The outer step to continue from (`group_outer_step`, the exchange's, None: our own
        `outer_step`), jumped up to the swarm's when we have fallen more than half the step gap behind it.

        Why: the counter keys the pairing schedule and `sync.max_step_gap` refuses partners too far apart,
        while pairs adopt each other's larger count only when they meet. Groups whose outer steps take
        different times (a faster exchange, a node that started later from a fresh model) drift apart,
        and past the gap they never meet again: islands. The counter carries no weights (the lr follows
        the inner step), so following the swarm's is safe. The swarm's is the second largest outer step
        among the other alive trainers' records, so that no single record (a liar) can move it."""
        if self.swarm_steps is None:
            return group_outer_step
        others = sorted((step for peer, step in self.swarm_steps().items() if peer != self.me), reverse=True)
        if len(others) < 2:
            return group_outer_step
        lead, ours = others[1], max(outer_step, group_outer_step or 0)
        if lead > ours + max(1, self.cfg.max_step_gap // 2):
            log.info("outer step %d is far behind the swarm's %d: following it", ours, lead)
            return lead
        return group_outer_step

    def _phase_shift(self, gaps: list[tuple[float, bool]]) -> float:
        """How far to move our next publish towards the trainers that were between outer steps: the median
        over them of the distance to each one's phase, taken modulo the pace (a trainer that published 1 s
        before the end of its period is 1 s ahead of our next publish, not a period behind ours), all of
        it towards one that averaged (it keeps its phase), half of it towards one that stepped solo (it
        moves towards us as well: two solo nodes moving all the way would only swap places). 0 without a
        pace or without any answer."""
        period = self.pace() if self.pace is not None else 0.0
        if period <= 0 or not gaps:
            return 0.0
        moves = [(((g + period / 2) % period) - period / 2) * (1.0 if paired else 0.5) for g, paired in gaps]
        return statistics.median(moves)

    def _schedule_members(self) -> list[str]:
        """The other trainers the schedule pairs us among: the eligible ones (the swarm state's view; other
        nodes' views may differ by a few members, which moves only a few partners), or the connected peers
        where no such view is given (tests, benchmarks)."""
        if self.eligible_peers is not None:
            members = set(self.eligible_peers())
        else:
            members = {str(p) for p in self.host.get_connected_peers()}
        members.discard(self.me)
        return sorted(members)

    def _busy_wait_s(self) -> float:
        """How long a round may wait for a scheduled partner that is still transferring its previous
        outer step (it answers "already exchanging").

        Why wait at all: on a slow link an exchange lasts minutes, the worker trains on meanwhile (so the
        wait costs no compute), and pairs end their transfers seconds apart. Giving up after the pairing
        window sent the pair that finished first back to each other in the open phase, step after step:
        fixed pairs, the islands the schedule exists to prevent. The bound is our own typical transfer time
        (partners' links are alike or the schedule pairs like with like), and never below the window."""
        window = self.cfg.pair_window_s
        if self._transfer_s is None:
            return window
        return max(window, min(BUSY_WAIT_FACTOR * self._transfer_s, self.cfg.max_transfer_s))

    async def _pair(self, pending: _Pending) -> None:
        deadline = pending.began + (self.cfg.pair_window_s if pending.window_s is None else pending.window_s)
        while pending.claimed_by is None and trio.current_time() < max(deadline, pending.scheduled_until):
            if pending.in_scheduled_phase(trio.current_time()):
                await self._meet_scheduled(pending)
                continue
            if not pending.open_phase:
                break
            partner = self._choose_partner()
            if partner is None:
                await trio.sleep(random.uniform(0.1, 0.4))
                continue
            self.misses.note(partner, await self._try_partner(pending, partner))
            if pending.claimed_by is None:
                await trio.sleep(random.uniform(0.05, 0.2))
        if pending.claimed_by is None:
            pending.claimed_by = "solo"  # close the door to late requests
            pending.result = 1
            pending.done.set()

    async def _meet_scheduled(self, pending: _Pending) -> None:
        """One try at the scheduled partner: the smaller PeerID asks, the other waits for its request."""
        partner = pending.scheduled
        assert partner is not None
        link = self._link(partner)
        if link.banned_until > trio.current_time():
            pending.scheduled_until = 0.0
            return
        if partner < self.me:
            # Its request comes to _serve_request. If it has not come by the end of the scheduled phase, ask
            # once: a partner still transferring its previous outer step over a slow link says so, and is
            # worth waiting for (below); one that is training or asking us meanwhile is left as it was.
            if pending.probed or trio.current_time() + 0.2 < pending.scheduled_until:
                await trio.sleep(0.1)
                return
            pending.probed = True
        outcome = await self._try_partner(pending, partner, scheduled=True)
        self.misses.note(partner, outcome, scheduled=True)
        if pending.claimed_by is not None:
            return
        if partner < self.me and outcome in (Attempt.NOT_READY, Attempt.BUSY):
            await trio.sleep(0.1)  # the probe: it will ask us (or its crossing request is on its way)
            return
        if outcome is Attempt.EXCHANGING and pending.window_s is None:
            # Still moving its previous outer step over a slow link: keep the schedule's pairing and wait
            # for it (`_busy_wait_s`), asking again at a pace that costs nothing next to such a transfer.
            pending.scheduled_until = max(pending.scheduled_until, pending.began + self._busy_wait_s())
            if trio.current_time() < pending.scheduled_until:
                await trio.sleep(random.uniform(*SCHEDULED_RETRY_S) * 3)
                return
        if outcome is Attempt.NOT_READY:
            await trio.sleep(random.uniform(*SCHEDULED_RETRY_S))
        else:
            pending.scheduled_until = 0.0  # it refused, failed, or pairs with someone else: open phase

    def sits_out(self, peer: str) -> bool:
        """Whether `peer` should not count as a possible partner now: banned (it or its IP), or it missed
        too many rounds in a row (node/averaging/partner_misses.py). A peer that counts costs every outer step the
        whole pairing window when it never pairs."""
        link = self._links.get(peer)
        if link is not None and (link.banned_until > trio.current_time()
                                 or (link.ip is not None and self._ip_banned(link.ip))):
            return True
        return self.misses.sits_out(peer)

    def _may_punch(self, partner: str) -> bool:
        """Whether to open a punched side channel with `partner` where its listener (or ours) is behind a
        NAT: only with the side channel on and over a direct connection (a relayed one's remote address is
        the relay's, so a punch towards it could only fail)."""
        return self.cfg.datapath and (self.path_of is None or self.path_of(partner) in DIRECT_PATHS)

    def _group_outer_step(self, ours: int, theirs: int | None) -> int:
        """The outer step both partners continue from: the larger one. A partner's step beyond our own gap
        (its `max_step_gap` may be larger than ours) is not adopted: we keep our own."""
        if theirs is None or abs(theirs - ours) > self.cfg.max_step_gap:
            return ours
        if theirs > ours:
            log.debug("adopting the partner's outer step %d (ours was %d)", theirs, ours)
        return max(ours, theirs)

    def _choose_partner(self) -> str | None:
        """A ready eligible partner for the open phase: the least recently paired, random among ties
        (never paired counts as least recent), so that the fallback spreads partners too."""
        now = trio.current_time()
        connected = {str(p) for p in self.host.get_connected_peers()}
        pool = connected if self.eligible_peers is None else connected & set(self.eligible_peers())
        pool.discard(self.me)
        ready = [p for p in pool if self._link(p).next_try <= now and self._link(p).banned_until <= now
                 and not (self._link(p).ip is not None and self._ip_banned(self._link(p).ip))]
        if not ready:
            return None
        oldest = min(self._last_paired.get(p, -1) for p in ready)
        return random.choice([p for p in ready if self._last_paired.get(p, -1) == oldest])

    def _link(self, peer: str) -> _Link:
        link = self._links.get(peer)
        if link is None:
            if len(self._links) >= MAX_LINKS:
                self._forget_a_link()
            link = self._links[peer] = _Link()
        return link

    def _forget_a_link(self) -> None:
        """Make room in the partner table (fresh identities cost nothing, so it must be bounded): forget the
        oldest partner we never averaged with and do not ban, else the oldest unbanned one. Banned ones are
        kept: forgetting them would lift the ban."""
        now = trio.current_time()
        unbanned = [p for p, link in self._links.items() if link.banned_until <= now]
        never = [p for p in unbanned if self._links[p].rounds == 0]
        victim = (never or unbanned or list(self._links))[0]
        del self._links[victim]

    def _transfer_limits(self) -> avg.TransferLimits:
        """A transfer runs as long as it moves (protocols/avg.py, `TransferLimits`): no deadline from a link
        rate, assumed or measured, can rule out a slow link that works."""
        return avg.TransferLimits(stall_s=self.cfg.stall_timeout_s, max_s=self.cfg.max_transfer_s)

    def _learn_rate(self, partner: str, progress: avg.Progress) -> None:
        """Fold the rate this transfer's bytes flowed at into the partner's link (EWMA), whether it
        completed or not: a transfer that was cut still shows what the link does."""
        rate = progress.rate_bps()
        if rate is None:
            return
        link = self._link(partner)
        each_way = rate / 2
        link.rate_bps = each_way if link.rate_bps is None else (1 - RATE_EWMA) * link.rate_bps + RATE_EWMA * each_way
        self._rate_bps = each_way if self._rate_bps is None else (1 - RATE_EWMA) * self._rate_bps + RATE_EWMA * each_way

    def _outer_period_s(self) -> float:
        """Compute seconds of one of our outer steps as far as we know them (0: unknown): `outer_period`, or
        the swarm's pace where none was given."""
        source = self.outer_period if self.outer_period is not None else self.pace
        try:
            period = float(source()) if source is not None else 0.0
        except Exception:  # a period that cannot be computed is unknown, as before any speed was measured
            log.exception("the outer step's period could not be computed")
            return 0.0
        return period if period > 0 and period != float("inf") else 0.0

    def _compression_for(self, partner: str, pending: _Pending) -> str:
        """The preset we ask `partner` to exchange this round with: `sync.compression`, or with `auto` the
        least compressed one whose transfer the measured rate fits in an outer step
        (node/averaging/compression_choice.py). A second round (groups of four) is always `none`."""
        if self.cfg.compression != AUTO:
            return self.cfg.compression
        if pending.stage != 1:
            return "none"
        link = self._link(partner)
        return choose_compression(
            rate_bps=link.rate_bps if link.rate_bps is not None else self._rate_bps,
            period_s=self._outer_period_s(),
            numel=pending.tensors.phi.size,
            previous=link.compression,
            group_size=self.cfg.group_size,
            wire_dtype=self.cfg.wire_dtype,
        )

    def _accepts_compression(self, name: str) -> bool:
        """Whether we take a request for preset `name`: our own fixed `sync.compression` only; with `auto`
        any known preset the initiator chose (it measured the same link: the pair's bottleneck), lossy ones
        only where our groups are pairs (`SyncConfig.validate` says why)."""
        if self.cfg.compression != AUTO:
            return name == self.cfg.compression
        return name in PRESETS and (self.cfg.group_size == 2 or not PRESETS[name].lossy)

    def _request_fields(self, pending: _Pending, compression: str, fragment: int) -> dict[str, Any]:
        return {
            "outer_step": pending.request.outer_step,
            "manifest_hash": self.manifest_hash() or "none",
            "layout_hash": pending.request.layout_hash,
            "wire_dtype": self.cfg.wire_dtype,
            "int8_block": 4096,
            "datapath": self.listener is not None,
            "stage": pending.stage,
            "compression": compression,
            "fragment": fragment,
            **self._contribution(pending),
        }

    @staticmethod
    def _contribution(pending: _Pending) -> dict[str, int]:
        """What our values cover and how long we have waited: the partner's weights and phase."""
        waited = max(0.0, trio.current_time() - pending.began)
        samples = pending.request.samples if pending.samples is None else pending.samples
        return {
            "inner_steps": min(max(0, pending.own_steps), 1 << 30),
            "samples": min(max(0, samples), 1 << 40),
            "waited_ms": min(int(waited * 1000), 1 << 30),
            "members": pending.members,
        }

    def _note_partner(self, pending: _Pending, message: avg.AvgRequest | avg.AvgAnswer) -> None:
        if isinstance(message, avg.AvgRequest):
            # The initiator chooses the preset and phi's fragment (`_judge` accepted the preset).
            pending.compression = message.compression
            pending.fragment = message.fragment
        pending.partner_outer_step = message.outer_step
        pending.partner_samples = message.samples
        pending.partner_inner_steps = message.inner_steps
        pending.partner_members = message.members
        # A partner cannot have waited longer than our window allows (its figure only moves our phase).
        pending.partner_waited_s = min(message.waited_ms / 1000, self.cfg.pair_window_s)

    async def _try_partner(self, pending: _Pending, partner: str, *, scheduled: bool = False) -> Attempt:
        """Ask `partner` (`Attempt` says what came of it); the partner's answer is acted on by its code
        (protocols/avg.py, `AnswerCode`), never by its words."""
        pending.initiating_to = partner
        began = trio.current_time()
        claimed_here = False
        numel = pending.tensors.phi.size
        progress = avg.Progress()
        compression = self._compression_for(partner, pending)
        preset = get_compression(compression)
        fragment = preset.fragment_of(pending.request.outer_step) if preset.lossy else 0
        answered = False  # the partner's answer came: what fails after it is no handshake timeout
        try:
            stream = None
            with trio.fail_after(self.cfg.handshake_timeout_s):
                stream = await self.host.new_stream(ID.from_base58(partner), list(avg.PROTOCOL_IDS))
            self._link(partner).ip = _per_ip_key(avg.partner_ip(stream))

            def claim(answer: avg.AvgAnswer) -> bool:
                nonlocal claimed_here, answered
                answered = True
                if pending.claimed_by is not None:
                    return False  # a crossing request claimed this step meanwhile
                pending.mark_paired(partner, trio.current_time())
                self._note_partner(pending, answer)
                pending.compression, pending.fragment = compression, fragment
                pending.progress = progress
                claimed_here = True
                return True

            try:
                result = await avg.initiate(
                    stream,
                    self._request_fields(pending, compression, fragment),
                    pending.tensors,
                    local_peer_id=self.host.get_id().to_bytes(),
                    remote_peer_id=ID.from_base58(partner).to_bytes(),
                    remote_ip=avg.partner_ip(stream),
                    handshake_timeout=self.cfg.handshake_timeout_s,
                    limits=self._transfer_limits(),
                    progress=progress,
                    on_accept=claim,
                    validate=self._values_judge(pending),
                    offer_punch=self._may_punch(partner),
                )
            finally:
                await close_quietly(stream)
        except Declined as e:
            self.stats["declined"] += 1
            not_ready = e.code.asks_again
            if e.code.busy:
                # Busy or between outer steps, it shows where its count is (a refusal's may be far off).
                pending.largest_seen = max(pending.largest_seen, e.outer_step)
                pending.saw_ready = pending.saw_ready or not not_ready
            if not_ready and e.since_publish_ms > 0:
                their_publish = trio.current_time() - min(e.since_publish_ms / 1000, 86400.0)
                pending.phase_gaps.append((their_publish - pending.began, e.paired))
            if not scheduled:
                self._back_off(partner, soft=True)
            log.debug("partner %s declined: %s", partner, e)
            if not_ready:
                return Attempt.NOT_READY
            if e.code.busy:
                return Attempt.EXCHANGING if e.code is AnswerCode.EXCHANGING else Attempt.BUSY
            ours = pending.request.outer_step
            self._note_refusal(partner, "partner", e.code, e.reason, ours, e.outer_step)
            if e.code is AnswerCode.STEP_GAP:
                if e.outer_step > ours and self.on_behind is not None:
                    self.on_behind(e.outer_step)
                return Attempt.APART  # an honest state the catch-up ends: no missed round (partner_misses.py)
            return Attempt.REFUSED
        except Exception as e:  # ProtocolError, TooSlowError, and whatever libp2p raises for a dead stream
            self._learn_rate(partner, progress)
            if isinstance(e, trio.TooSlowError) and not answered:  # it said nothing: say which deadline
                e = trio.TooSlowError(f"no answer to the pairing request within {self.cfg.handshake_timeout_s:g}s "
                                      "(sync.handshake_timeout_s)")
            self._fail(partner, e, trio.current_time() - began)
            if claimed_here:  # our exchange owned this step and failed: solo, nothing applied
                pending.result = 1
                pending.done.set()
            return Attempt.FAILED
        finally:
            pending.initiating_to = None
        self._learn_rate(partner, progress)
        self._succeed(partner, result, numel, pending.compression)
        pending.result = 2
        pending.done.set()
        return Attempt.PAIRED

    # --- the responder -----------------------------------------------------------------------------------

    async def _handle_stream(self, stream: Any, *, coded: bool = True) -> None:
        """Inbound requests: at most MAX_INBOUND read at once (each under the handshake deadline), so
        silent or slow peers cannot pile up tasks and buffers; extra ones are reset at once. `coded`: the
        asker speaks 1.3.0, whose answers carry a reason code (protocols/avg.py)."""
        ip = _per_ip_key(avg.partner_ip(stream))
        refusal = None
        if self._inbound >= MAX_INBOUND:
            refusal = "too_many_requests"
        elif ip is not None and self._inbound_by_ip.get(ip, 0) >= MAX_INBOUND_PER_IP:
            refusal = "too_many_requests_from_ip"
        elif ip is not None and self._ip_banned(ip):
            refusal = "banned_ip"
        if refusal is not None:
            self.rejections[refusal] = self.rejections.get(refusal, 0) + 1
            await close_quietly(stream, reset=True)
            return
        self._inbound += 1
        if ip is not None:
            self._inbound_by_ip[ip] = self._inbound_by_ip.get(ip, 0) + 1
        try:
            await self._serve_request(stream, coded=coded)
        finally:
            self._inbound -= 1
            if ip is not None:
                left = self._inbound_by_ip.pop(ip) - 1
                if left > 0:
                    self._inbound_by_ip[ip] = left

    async def _serve_request(self, stream: Any, *, coded: bool = True) -> None:
        arrived = trio.current_time()
        partner = str(stream.muxed_conn.peer_id)
        self._link(partner).ip = _per_ip_key(avg.partner_ip(stream))
        try:
            request = await avg.read_request(stream, self.cfg.handshake_timeout_s)
        except (ProtocolError, trio.TooSlowError) as e:
            self._fail(partner, e, 0.0, count=isinstance(e, ProtocolError))
            await close_quietly(stream, reset=True)
            return
        pending = self._pending
        if pending is not None:
            pending.saw_ready = True  # whoever asks has published: our phase is not off everyone's
            pending.largest_seen = max(pending.largest_seen, request.outer_step)
        verdict = self._judge(request, pending, partner)
        if (verdict is not None and verdict[0] is AnswerCode.NOT_IN_ROUND and pending is not None
                and partner == pending.next_partner):
            # Held only when nothing but our stage stands between the request and a yes: a banned, relayed
            # or foreign-run partner is answered at once.
            pending = await self._await_round(request.stage, pending, arrived)
            verdict = self._judge(request, pending, partner)
        if verdict is None or verdict[0].busy:
            self.misses.heard(partner)  # it asks us as a partner of our run would: it takes part
        if verdict is not None and not verdict[0].busy:
            ours = pending.request.outer_step if pending is not None else self._last_outer_step
            self._note_refusal(partner, "us", verdict[0], verdict[1], ours, request.outer_step)
            if verdict[0] is AnswerCode.STEP_GAP and request.outer_step > ours and self.on_behind is not None:
                self.on_behind(request.outer_step)  # the asker is ahead of us beyond the gap: we are behind
        if verdict is not None:
            # Between outer steps we say the last one we took: an asker that is behind learns the count.
            since = 0
            if pending is None and self._last_publish_at is not None:
                since = max(1, min(int((trio.current_time() - self._last_publish_at) * 1000), 1 << 31))
            await avg.answer(stream, verdict[0], verdict[1],
                             pending.request.outer_step if pending else self._last_outer_step, since,
                             paired=pending is None and bool(self._recent) and bool(self._recent[-1][1]), coded=coded)
            await close_quietly(stream)
            return
        assert pending is not None
        pending.mark_paired(partner, trio.current_time())
        self._note_partner(pending, request)
        began = trio.current_time()
        progress = pending.progress = avg.Progress()
        try:
            with trio.CancelScope() as scope:
                pending.transfer_scope = scope
                result = await avg.respond(
                    stream,
                    request,
                    pending.tensors,
                    outer_step=pending.request.outer_step,
                    listener=self.listener if (self.reachable is None or self.reachable()) else None,
                    local_peer_id=self.host.get_id().to_bytes(),
                    remote_peer_id=stream.muxed_conn.peer_id.to_bytes(),
                    handshake_timeout=self.cfg.handshake_timeout_s,
                    limits=self._transfer_limits(),
                    progress=progress,
                    validate=self._values_judge(pending),
                    allow_punch=self._may_punch(partner),
                    **self._contribution(pending),
                )
            if scope.cancelled_caught:
                raise trio.TooSlowError("cancelled by shutdown")
        except Exception as e:  # ProtocolError, TooSlowError, a reset stream: all end in a solo step
            self._learn_rate(partner, progress)
            self._fail(partner, e, trio.current_time() - began)
            pending.result = 1
            pending.done.set()
            await close_quietly(stream, reset=True)
            return
        finally:
            pending.transfer_finished.set()
        self._learn_rate(partner, progress)
        self._succeed(partner, result, pending.tensors.phi.size, pending.compression)
        pending.result = 2
        pending.done.set()
        await close_quietly(stream)

    async def _await_round(self, stage: int, current: _Pending, arrived: float) -> _Pending | None:
        """Wait for round `stage` of this outer step to begin and return its pending round (or whatever
        round is on when the wait ends; None between outer steps).

        Why hold: in a group of four the two pairs rarely end their first rounds together. The second-round
        asker that ends first used to be told "not ready" and ask again 0.15-0.3 s later, which at outer
        steps of a second or two is a real share of the step and stalls the worker (`train.max_lag`).
        Held, the request is answered the moment our second round begins. The wait is bounded by what is
        left of our first round's window (the second round begins as soon as it ends) and by a share of
        the asker's deadline for our answer, counted from the request's arrival (`arrived`: reading it took
        some of that deadline already), so a hold never turns into a failure the asker counts against us.
        Only the partner the schedule gives us for that round is held (`_serve_request`), so a peer cannot
        park requests here."""
        now = trio.current_time()
        window = self.cfg.pair_window_s if current.window_s is None else current.window_s
        left = current.began + window - now
        share = HOLD_SHARE * self.cfg.handshake_timeout_s - (now - arrived)
        with trio.move_on_after(max(0.0, min(left + HOLD_MARGIN_S, share))):
            while self._pending is None or self._pending.stage < stage:
                await self._round_begun.wait()
        return self._pending

    def _judge(self, req: avg.AvgRequest, pending: _Pending | None, partner: str) -> tuple[AnswerCode, str] | None:
        """None to accept, else why not: the code the asker acts on (its verdict, busy or refuse, goes with
        it) and the words it logs and shows."""
        if (
            self.path_of is not None
            and not self.cfg.allow_relay_bulk
            and self.path_of(partner) not in DIRECT_PATHS
        ):
            return (AnswerCode.NO_DIRECT_PATH, "no direct path between us: bulk tensors do not go through relays")
        if self._link(partner).banned_until > trio.current_time():
            return (AnswerCode.BANNED, "banned for repeated invalid updates")
        ours = self.manifest_hash() or "none"
        if req.manifest_hash != ours:
            log.error("refusing %s: run manifest %s differs from ours %s", partner, req.manifest_hash[:12], ours[:12])
            return (AnswerCode.MANIFEST, f"manifest mismatch: yours {req.manifest_hash}, ours {ours}")
        if pending is None:
            return (AnswerCode.NOT_READY, "not ready (training between outer steps)")
        if req.stage != pending.stage:
            # A second-round request while we are still in our first round: the asker retries ("not
            # ready"); a first-round request while we are in our second: we are busy with our group.
            if req.stage > pending.stage:
                return (AnswerCode.NOT_IN_ROUND, "not ready (in the first round of its outer step)")
            return (AnswerCode.SECOND_ROUND, "in the second round of its outer step")
        ours_layout = pending.request.layout_hash
        if req.layout_hash != ours_layout or req.numel != pending.tensors.phi.size:
            return (AnswerCode.LAYOUT,
                    f"parameter layout mismatch: yours {req.layout_hash[:12]}, ours {ours_layout[:12]}")
        gap = abs(req.outer_step - pending.request.outer_step)
        if gap > self.cfg.max_step_gap:
            return (AnswerCode.STEP_GAP,
                    f"outer steps too far apart: yours {req.outer_step}, ours {pending.request.outer_step}")
        if req.wire_dtype not in ("fp32", "bf16", "int8"):
            return (AnswerCode.WIRE_DTYPE, f"unknown wire dtype {req.wire_dtype!r}")
        if not self._accepts_compression(req.compression):
            # Error feedback and the fragment pull assume what the wire carried: a mix would be silently wrong.
            groups = f" with sync.group_size = {self.cfg.group_size}" if self.cfg.compression == AUTO else ""
            return (AnswerCode.COMPRESSION,
                    f"compression mismatch: yours {req.compression[:16]!r}, ours {self.cfg.compression!r}"
                    f"{groups}: set the same sync.compression on every trainer")
        if pending.claimed_by is not None:
            return (AnswerCode.EXCHANGING, "already exchanging")
        if pending.in_scheduled_phase(trio.current_time()) and partner != pending.scheduled:
            return (AnswerCode.SCHEDULED, "waiting for the partner the schedule gives it")
        if pending.initiating_to is not None:
            if pending.initiating_to == partner and partner < self.me:
                return None  # crossing requests: the smaller PeerID's request wins
            if pending.initiating_to == partner:
                return (AnswerCode.CROSSING, "crossing request")
            return (AnswerCode.ASKING_OTHER, "asking someone else")
        return None

    # --- bookkeeping -------------------------------------------------------------------------------------

    def _succeed(self, partner: str, result: avg.TransferResult, numel: int = 0, compression: str = "none") -> None:
        self._last_success_at = trio.current_time()
        link = self._link(partner)
        link.compression = compression
        self._transfer_s = result.duration_s if self._transfer_s is None else (
            (1 - RATE_EWMA) * self._transfer_s + RATE_EWMA * result.duration_s)
        link.rounds += 1
        link.failures = 0
        link.next_try = 0.0
        link.bytes_sent += result.bytes_sent
        link.bytes_received += result.bytes_received
        link.last_path = result.path
        self._partners.add(partner)
        if result.clip.clipped:
            link.clipped += 1
            self.clipped["delta"] += result.clip.delta_scale < 1.0
            self.clipped["phi"] += result.clip.phi_scale < 1.0
            # Honest partners are clipped too (a late starter, a partition, a node in warm-up): one line per
            # exchange would flood the journal, so the counts go to status and metrics, the detail to debug.
            log.debug("clipped the update of %s: kept %.2g of its Delta and %.2g of its phi's distance from ours",
                      partner, result.clip.delta_scale, result.clip.phi_scale)
        total = result.bytes_sent + result.bytes_received
        self.stats.update(
            rounds=self.stats["rounds"] + 1,
            last_partner=partner,
            last_duration_s=round(result.duration_s, 3),
            last_bytes=total,
            last_path=result.path,
            bytes_sent=self.stats["bytes_sent"] + result.bytes_sent,
            bytes_received=self.stats["bytes_received"] + result.bytes_received,
            last_bytes_per_param=round(result.bytes_sent / numel, 4) if numel else None,
            last_compression=compression,
        )
        if self.metrics is not None:
            self.metrics.observe_round(result.duration_s, total, partner, True)
        if self.on_transfer is not None:
            self.on_transfer(partner, total, result.duration_s)
        log.debug("averaged with %s over the %s in %.2fs (%.1f MB)", partner, result.path, result.duration_s, total / 1e6)

    def note_offence(self, peer: str, reason: str) -> None:
        """An offence seen outside an exchange (a Yamux window overrun, p2p/limits.py; a snapshot donor that
        lied about its model): counted and banned like a poisoned update, so that the offender is not our
        averaging partner either."""
        self._offence(peer, reason)

    def _offence(self, partner: str, reason: str) -> None:
        """A poisoned or malformed update: counted per reason; repeated offences ban the partner."""
        self.rejections[reason] = self.rejections.get(reason, 0) + 1
        link = self._link(partner)
        link.offences += 1
        if link.offences >= self.cfg.ban_after:
            now = trio.current_time()
            link.banned_until = now + self.cfg.ban_s
            link.offences = 0
            log.warning("banning %s for %.0fs after %d invalid updates", partner, self.cfg.ban_s, self.cfg.ban_after)
            if link.ip is not None:
                self._note_ip_ban(link.ip, now)

    def _note_ip_ban(self, ip: str, now: float) -> None:
        """One more identity banned from `ip`; IP_BAN_AFTER of them ban the IP itself for `sync.ban_s`
        (everyone behind it, honest or not: the price of identities that cost nothing)."""
        count, until = self._ip_bans.pop(ip, (0, 0.0))
        count += 1
        if count >= IP_BAN_AFTER:
            until = now + self.cfg.ban_s
            count = 0
            log.warning("banning IP %s for %.0fs: %d identities from it were banned for invalid updates",
                        ip, self.cfg.ban_s, IP_BAN_AFTER)
        self._ip_bans[ip] = (count, until)
        while len(self._ip_bans) > MAX_LINKS:
            self._ip_bans.popitem(last=False)

    def _ip_banned(self, ip: str) -> bool:
        entry = self._ip_bans.get(ip)
        return entry is not None and entry[1] > trio.current_time()

    def _fail(self, partner: str, error: BaseException, duration: float, *, count: bool = True) -> None:
        text = f"{type(error).__name__}: {error}"[:300]
        if isinstance(error, Rejected):
            self._offence(partner, error.reason)
        elif isinstance(error, ProtocolError) and count and error.reason.value in _MALFORMED:
            self._offence(partner, f"protocol_{error.reason.value}")
        self.stats["last_error"] = f"{partner}: {text}"
        if count:
            self.stats["failures"] += 1
            self._back_off(partner)
            if self.metrics is not None:
                self.metrics.observe_round(duration, 0, partner, False)
        log.warning("exchange with %s failed: %s", partner, text)

    def _back_off(self, partner: str, *, soft: bool = False) -> None:
        link = self._link(partner)
        if soft:
            link.next_try = trio.current_time() + random.uniform(0.5, 1.5)
            return
        link.failures += 1
        delay = min(BACKOFF_MAX_S, self.cfg.backoff_s * 2 ** (link.failures - 1))
        link.next_try = trio.current_time() + delay * random.uniform(0.8, 1.2)


def _arrays(request: ExchangeRequest) -> Tensors:
    """The request's four slots as flat float32 numpy arrays over the same memory (no copy; `ValueError`
    where that cannot be). The daemon's views of the shared memory are numpy arrays already
    (node/bridge/shm.py); CPU torch tensors, as tests and benches hand them in, are viewed without a copy too."""
    return Tensors(request.phi, request.delta, request.phi_out, request.delta_out).as_arrays()


_BLOCK = 1 << 20  # elements per step of `_weighted_mean`: its temporaries stay a few MB, whatever the model


def _weighted_mean(out: np.ndarray, own: np.ndarray, pair_sum: np.ndarray, w_own: int, w_partner: int,
                   *, scale: float = 1.0) -> None:
    """out = scale * (w_own * own + w_partner * other) / (w_own + w_partner), given pair_sum = own + other,
    as `scale * (a * pair_sum + b * own)`: no copy of `other` is needed. `out` may be `own` or `pair_sum`
    (in place). Unknown (non-positive) weights give the plain mean.

    Block by block through two block-sized buffers, so that a model of billions of parameters costs no
    model-sized temporary (numpy has no fused in-place `add(x, alpha=...)`)."""
    if w_own <= 0 or w_partner <= 0:
        w_own = w_partner = 1
    total = w_own + w_partner
    a = np.float32(scale * w_partner / total)
    b = np.float32(scale * (w_own - w_partner) / total)
    block = min(_BLOCK, out.size)
    scaled, term = np.empty(block, np.float32), np.empty(block, np.float32)
    for start in range(0, out.size, block):
        stop = min(start + block, out.size)
        s = scaled[: stop - start]
        np.multiply(pair_sum[start:stop], a, out=s)
        if b:
            t = term[: stop - start]
            np.multiply(own[start:stop], b, out=t)
            s += t
        out[start:stop] = s
