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
   A scheduled partner still transferring its previous outer step stretches the scheduled phase (a wait,
   `busy_wait_s`), and an open phase as long as a round's (half the window) follows that wait. A round
   in which some partner showed it was in a round of its own (busy, or waiting for its scheduled one) looks
   for as long as such a wait before it steps solo: on a slow link partners come free a transfer apart.

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
(node/averaging/stepping.py, `phase_shift`).

Groups of four: with `sync.group_size` = 4 (opt-in) an outer step has a second round with the
partner the schedule gives for it (`_second_round`): each side sends what its first round gave (the
pair's sample-weighted means, or its own values after a bye) and says how many trainers and samples
that stands for, and both end with the sample-weighted means of the group (of four, or three with a
bye; the arithmetic is node/averaging/group_mean.py). The second round waits for its scheduled partner only (no open phase, one window); when it does
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
outer step's compute period (`outer_period`, else the pace; node/averaging/compression_choice.py), and the
slower side's view wins: an `auto` responder refuses a preset less compressed than the one it would choose
for that initiator (its rate with it, else its typical rate), saying which it wants, and the initiator asks
again at once with that one (`_try_partner`), which it then starts from with that partner.

Streaming fragments (`sync.fragments` = F > 1): each exchange is one fragment's (the request's slices of
the slots, node/bridge/supervisor.py), and this machine treats it as an outer step of a model that size:
the schedule is drawn for (outer step, fragment) (so each fragment sync has its own partner), the request
names the fragment (protocols/avg.py; a responder in another fragment's round answers `OTHER_FRAGMENT`,
one with another count refuses), the bounds and `auto` apply to the fragment (its budget is the period over
F), and the catch-up counts a period of F syncs as one outer step (`_outer_step_ended`).

Two rules keep heterogeneous machines from drifting apart for good:

- When the daemon knows of no other trainer that could pair at all (alive, of our run, with a usable
  path, whatever its outer step), the outer step is solo at once: waiting out the pairing window would
  only slow down a node that nobody can pair with. Trainers that exist but whose records put them outside
  `sync.max_step_gap` still get the window (records lag a heartbeat, and in a swarm of short outer steps
  a node that never waited would race away from everyone). Busy partners count as eligible.
- After an exchange both partners adopt the larger of their two outer steps (each learns the other's
  from the request or the answer, `ExchangeOutcome.group_outer_step` hands it to the worker), so paired
  nodes' counters never drift apart (node/averaging/stepping.py). A node whose outer steps have gone
  unaveraged for a while re-syncs from the swarm instead (node/averaging/latejoin.py, `CatchUp`), fed by
  `AveragerHooks.on_outer_step`; at once when a partner refuses it as too far behind (`on_behind`).
  Refusals show in status (`last_refusal`, node/averaging/report.py) and in the log at INFO.

What this module keeps is the round state machine: when to ask whom, how to answer, and what a round's
result is. Whom it may ask and answer at all is node/averaging/admission.py's (the link table, per-IP caps,
bans, back-offs); what it reports is report.py's; what it asks of the rest of the node is a `SwarmView`
(node/averaging/swarm_view.py). A partner's answer is acted on by its code (protocols/avg.py, `AnswerCode`),
never by its words (save a known preset named in a compression refusal). The module stays one (about 950
lines, a tenth of them this docstring) because a round is one machine: the asking and the answering side
share the pending round, its claim and its events, and a crossing request, a held second-round request or a
cancelled transfer touches both.
"""

from __future__ import annotations

import collections
import functools
import logging
import random
import time
from dataclasses import replace
from typing import Any, cast

import trio
from libp2p.peer.id import ID

from node.averaging import stepping
from node.averaging.admission import RATE_KEEP, Admission, FlowRate, per_ip_key
from node.averaging.compression_choice import (
    AUTO,
    ORDER,
    accepts,
    after_refusal,
    first_ask_floor,
    keeps_own_exact,
    preset_for,
    refusal_reason,
    wanted_in,
)
from node.averaging.group_mean import GroupMean, group_sums, restore_pair
from node.averaging.link_model import bandwidth_s
from node.averaging.pairing import scheduled_partners
from node.averaging.partner_misses import Attempt, PartnerMisses
from node.averaging.phases import PhaseClock, asked_status
from node.averaging.report import Report
from node.averaging.robust import UpdateBound
from node.averaging.round import Round, RoundState
from node.averaging.swarm_view import NO_HOOKS, AveragerHooks, SwarmView
from node.bridge.exchange import ExchangeOutcome, ExchangeRequest
from node.config.sync import SyncConfig
from node.status_schema import DIRECT_PATHS, MixingStatus, SyncStatus
from p2p.datapath import DataPathListener
from p2p.multiselect import open_stream, speaks
from p2p.wire import ProtocolError, close_quietly
from protocols import avg
from protocols.avg import AnswerCode, Declined, Rejected, Tensors
from protocols.compress import get_compression

log = logging.getLogger("starling.averager")

# A completed transfer whose bytes flowed for less than this is too fast to time: it shows the link moves at
# least its bytes over this (`_learn_rate`), so `auto`'s first, compressed probe teaches a fast link too.
TIMED_FLOW_S = 0.01
SCHEDULED_SHARE = 0.5  # of the pairing window spent on the scheduled partner only
SCHEDULED_RETRY_S = (0.15, 0.3)  # asking a scheduled partner that is still training, again after this
# A second-round request that arrives during our first round is held for at most this share of the
# handshake deadline (the asker's wait for our answer; past it the asker counts a failure against us).
HOLD_SHARE = 0.5
HOLD_MARGIN_S = 0.5  # past our first round's window: the second round begins right after it ends
# How long a scheduled partner that is busy *transferring* is waited for: this many times the longest of our
# own recent transfers, when that is longer than the pairing window (`busy_wait_s`).
BUSY_WAIT_FACTOR = 1.5
RECENT_TRANSFERS = 8  # of our own, whose longest bounds that wait
# A pairing answer can wait behind this much of the partner's own bulk data in its link's queue: a home
# uplink's buffer holds seconds of it, the lab's tbf a 64 KiB bucket and as much queue (`_answer_deadline_s`).
QUEUED_BYTES = 128 * 1024
# However slow the partner's link, a pairing answer is never waited for longer than this many times
# `sync.handshake_timeout_s` (4 x 5 s = 20 s by default; the lab's 0.08 Mbit/s link needs 13): a peer that had itself
# measured slow and then sits on requests costs a round that long, not more.
MAX_ANSWER_WAIT_FACTOR = 4.0


def busy_wait_s(window_s: float, transfer_s: float | None, max_transfer_s: float) -> float:
    """How long a round may wait for a scheduled partner that is still transferring its previous outer step
    (it answers "already exchanging"): `BUSY_WAIT_FACTOR` times the longest of our own recent transfers
    (`transfer_s`, None: none measured yet), up to `sync.max_transfer_s`, and never less than the pairing
    window; counted from its first such answer (`_meet_scheduled`).

    Why wait at all: on a slow link an exchange lasts minutes, the worker trains on meanwhile (so the wait
    costs no compute), and pairs end their transfers seconds apart. Giving up after the pairing window sent
    the pair that finished first back to each other in the open phase, step after step: fixed pairs, the
    islands the schedule exists to prevent. The bound is our own transfers' time (partners' links are alike
    or the schedule pairs like with like), the longest recent one rather than a typical one: where one
    link is slower, the busy partner is often moving its exchange with that link's trainer, and a wait
    from our typical (fast) transfer gave up a fraction of a second before it came free (traced with one
    link at 0.08 Mbit/s among 0.4 Mbit/s ones)."""
    if transfer_s is None:
        return window_s
    return max(window_s, min(BUSY_WAIT_FACTOR * transfer_s, max_transfer_s))


class Averager:
    """One trainer's averaging: `exchange` (the supervisor's call, once per outer step) and the responder
    for partners' requests (`run` serves them)."""

    def __init__(
        self,
        host: Any,
        cfg: SyncConfig,
        swarm: SwarmView,
        *,
        hooks: AveragerHooks = NO_HOOKS,
        metrics: Any = None,
        listen_host: str = "127.0.0.1",
        max_inner_steps: int | None = None,
    ) -> None:
        self.host = host
        self.cfg = cfg
        self.swarm = swarm
        self.hooks = hooks
        self.metrics = metrics
        self.me = str(host.get_id())
        self.listener = DataPathListener(listen_host, cfg.datapath_port, max_frame_size=avg.MAX_FRAME) if cfg.datapath else None
        self.admission = Admission(cfg)
        self.report = Report(cfg.max_step_gap)
        # Trainers that claim to average but miss round after round sit out (node/averaging/partner_misses.py).
        self.misses = PartnerMisses()
        # The swarm's H (`max_inner_steps`): the most inner steps an honest partner's Delta covers
        # (node/averaging/robust.py).
        self.bound = UpdateBound(cfg.clip_ratio, cfg.max_delta_ratio, max_inner_steps, cfg.clip_phi_ratio)
        self._group_mean = GroupMean()
        self._pending: Round | None = None
        self._round_begun = trio.Event()  # set (and replaced) whenever a round of an outer step begins
        self._last_publish_at: float | None = None  # trio clock: our latest publish
        self._last_paired: dict[str, int] = {}  # partner -> our exchange count when we last averaged with it
        self._last_outer_step = 0  # the outer step our latest exchange ended at (after any adoption)
        # Our outer steps since the latest averaged one (None: none averaged since the daemon started): whether
        # our phi is the swarm's model, the scale a partner's phi distance is judged on (`_fail`).
        self._since_averaged: int | None = None
        self._period_averaged = False  # streaming fragments: whether a sync of the current period averaged
        self._period_fragment: int | None = None  # and the fragment of its latest sync (None: none yet)
        # Our latest exchanges' transfer times, for `_busy_wait_s` (the longest of them).
        self._transfers_s: collections.deque[float] = collections.deque(maxlen=RECENT_TRANSFERS)
        # Our typical rate each way over all partners (`FlowRate`): `auto`'s guess for a partner not measured yet.
        self._rate_bps: float | None = None
        self._flow = FlowRate(RATE_KEEP)
        # The least compressed preset of any exchange this node completed (None: none yet): how far the
        # evidence behind `_rate_bps` reaches, for a partner not measured yet (`first_ask_floor`).
        self._widest: str | None = None
        # The swarm's outer step to continue from at our next round's end (`follow`; None: none asked).
        self._follow_to: int | None = None
        self._followed: set[int] = set()  # streaming fragments that took `_follow_to` already
        if cfg.assumed_rate_mbps != 100.0 or cfg.deadline_slack != 3.0:
            log.warning("sync.assumed_rate_mbps and sync.deadline_slack are ignored now: a transfer runs as long "
                        "as it moves (sync.stall_timeout_s, sync.max_transfer_s); remove them from the config")

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

    # --- what the daemon reads -----------------------------------------------------------------------------

    def status(self) -> SyncStatus:
        pending = self._pending
        st = cast("SyncStatus", {
            **self.report.stats,  # the counters; the rest is checked key by key
            "distinct_partners": self.report.distinct_partners(),
            "wire_dtype": self.cfg.wire_dtype,
            "compression": self.cfg.compression,
            "datapath_port": self.listener.port if self.listener is not None else None,
            "per_peer": self.admission.per_peer(),
            "mixing": self.report.mixing(),
            "state": "idle" if pending is None else pending.state.value,
            "rejections": dict(self.admission.rejections),
            "clipped": dict(self.report.clipped),
            "banned": self.admission.banned_peers(),
            "sitting_out": self.misses.status(),
            "last_refusal": self.report.last_refusal(),
        })
        if self.cfg.fragments > 1:
            st["fragments"] = self.cfg.fragments
            st["fragment"] = None if pending is None else pending.request.fragment
        if pending is not None and pending.progress is not None and pending.state is RoundState.EXCHANGING:
            # What a slow link's operator wants to see: the transfer is moving, and how fast.
            moved = pending.progress
            rate = moved.rate_bps()
            st["transfer"] = {"partner": str(pending.partner), "bytes": moved.bytes,
                              "seconds": round(trio.current_time() - pending.began - pending.waited_s, 1),
                              "rate_mbps": None if rate is None else round(rate * 8 / 2 / 1e6, 3)}
        return st

    @property
    def rejections(self) -> dict[str, int]:
        """Offences and requests refused unread, per reason (node/averaging/admission.py)."""
        return self.admission.rejections

    def mixing(self) -> MixingStatus:
        """Whom this node averaged with over its recent outer steps (node/averaging/report.py)."""
        return self.report.mixing()

    def recent_partners(self) -> list[str]:
        """Distinct recent partners, most frequent first (for the member record, so that every node can see
        the swarm's pairing graph)."""
        return self.report.recent_partners()

    def sits_out(self, peer: str) -> bool:
        """Whether `peer` should not count as a possible partner now: banned (it or its IP), or it missed
        too many rounds in a row (node/averaging/partner_misses.py). A peer that counts costs every outer step the
        whole pairing window when it never pairs."""
        return self.admission.barred(peer) or self.misses.sits_out(peer)

    def answer_for(self, request: avg.AvgRequest, partner: str) -> tuple[AnswerCode, str] | None:
        """How we would answer `request` from `partner` now (None: accept), without answering: the
        responder's judgement (`_judge`) against the round in progress, or between outer steps."""
        return self._judge(request, self._pending, partner)

    def note_offence(self, peer: str, reason: str) -> None:
        """An offence seen outside an exchange (a Yamux window overrun, p2p/limits.py; a snapshot donor that
        lied about its model): counted and banned like a poisoned update, so that the offender is not our
        averaging partner either."""
        self.admission.offence(peer, reason)

    # --- validation of what partners send ------------------------------------------------------------------

    def _credit(self, pending: Round) -> tuple[int, int]:
        """The partner's inner steps and samples as we believe them (node/averaging/robust.py, `credit`); a side
        that carries the mean of `members` trainers is credited up to that many trainers' samples."""
        own, theirs = pending.request, _stated(pending)
        members = max(1, theirs.members)
        credited = self.bound.credit(own.inner_steps, own.samples, theirs.inner_steps, theirs.samples // members)
        return credited.inner_steps, credited.samples * members

    def _values_judge(self, pending: Round) -> avg.Validator:
        """What the transfer asks once the partner's values are in: how much of them to keep
        (`UpdateBound.judge`). The partner's steps are known only once it has answered, so they are read
        when the values arrive."""
        return lambda seen: self.bound.judge(seen, pending.own_steps, self._credit(pending)[0],
                                             pending.request.fragment)

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
        worker adopts it). With no other trainer to pair with (`SwarmView.anyone_else`) the step is solo at
        once (see the module docstring); otherwise it waits up to the pairing window for a partner.
        """
        members = self._schedule_members()
        if not members and not self.swarm.anyone_else():
            self._outer_step_ended(request, False)
            self.report.outer_step(request.outer_step, (), scheduled=False, unpaired=True)
            log.debug("outer step %d: solo after 0.00s (no other trainer to pair with)", request.outer_step)
            return self._asked_count(request, ExchangeOutcome.solo(
                self._follow_the_swarm(request.outer_step, None)))
        began = trio.current_time()
        # With streaming fragments, this fragment's draw of the step (one fragment: the step's, as it was).
        keyed = {"fragment": request.fragment} if request.fragments > 1 else {}
        first, second = scheduled_partners(self.me, members, request.outer_step, self.swarm.speeds(), **keyed)
        if self.cfg.group_size < 4:
            second = None
        arrays = _arrays(request)
        pending = Round(
            request,
            arrays,
            began=began,
            scheduled=first,
            scheduled_until=began + SCHEDULED_SHARE * self.cfg.pair_window_s,
            next_partner=second,
        )
        self._last_publish_at = began
        log.debug("outer step %d published: the schedule gives %s", request.outer_step, first or "a bye")
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
                shift_s = stepping.phase_shift(pending.phase_gaps, self.swarm.pace())
            # A solo step follows the largest outer step that ready trainers showed us meanwhile (within our
            # gap), as an exchange does: the schedule is keyed by the outer step, and a node one step
            # behind the others would otherwise compute another matching than theirs at every step.
            group_outer_step = stepping.group_outer_step(request.outer_step, pending.largest_seen or None,
                                                         self.cfg.max_step_gap)
        else:
            group_outer_step = stepping.group_outer_step(request.outer_step, _stated(pending).outer_step,
                                                         self.cfg.max_step_gap)
            group_outer_step = stepping.meet_the_waiting(group_outer_step, request.outer_step,
                                                         pending.largest_seen or None, self.cfg.max_step_gap)
            partner_samples = self._credit(pending)[1]
            # Meet halfway: the one that waited longer published earlier and moves its next publish later.
            shift_s = (pending.waited_s - _stated(pending).waited_ms / 1000) / 2
            partners.append(str(pending.partner))
        if second is not None:
            size, group_outer_step = await self._second_round(request, arrays, pending if size >= 2 else None,
                                                              second, size, partners, group_outer_step)
            # The outputs hold weighted means (or a solo step's): no pair weighting is left to the worker.
            partner_samples = 0
        self.report.outer_step(request.outer_step, tuple(partners), scheduled=partners[:1] == [first] if first else False)
        for partner in partners:
            self._last_paired[partner] = self.report.stats["rounds"]
        continue_from = self._follow_the_swarm(request.outer_step, group_outer_step)
        self._last_outer_step = max(request.outer_step, continue_from or 0)
        self._outer_step_ended(request, size >= 2)
        log.debug("outer step %d: %s after %.2fs", request.outer_step,
                  f"averaged in a group of {size}" if size >= 2 else "solo", trio.current_time() - began)
        # The first round's preset (a second round, in groups of four, is always `none`).
        preset = get_compression(pending.compression if size >= 2 else "none")
        phi_range = preset.fragment_range(arrays.phi.size, pending.fragment) if preset.lossy else None
        # (A lossy preset needs pairs, so a group of four's exchange is never one: size 2 says it all.)
        own_exact = size == 2 and self._own_exact(str(pending.partner), preset.name, arrays.phi.size)
        return self._asked_count(request, ExchangeOutcome(
            size, continue_from, partner_samples, shift_s, preset.name, phi_range, own_exact=own_exact))

    def _outer_step_ended(self, request: ExchangeRequest, averaged: bool) -> None:
        """Count an exchange towards the outer steps averaged or not (`_since_averaged`, and the catch-up's
        `on_outer_step`). With streaming fragments an outer step is a period, one sync of each fragment:
        it is counted once, as averaged when any of the period's syncs was, so that the catch-up's "outer
        steps in a row not averaged" keeps its meaning instead of running F times as fast. A period ends
        with its last fragment's sync, or, where the worker skipped that slot (its previous sync still in
        flight), when a fragment of the next period comes."""
        if request.fragments > 1:
            if self._period_fragment is not None and request.fragment <= self._period_fragment:
                self._count_outer_step(self._period_averaged)  # the previous period ended without its last
                self._period_averaged = False
            self._period_fragment = request.fragment
            self._period_averaged = self._period_averaged or averaged
            if request.fragment != request.fragments - 1:
                return
            averaged, self._period_averaged, self._period_fragment = self._period_averaged, False, None
        self._count_outer_step(averaged)

    def _count_outer_step(self, averaged: bool) -> None:
        if averaged:
            self._since_averaged = 0
        elif self._since_averaged is not None:
            self._since_averaged += 1
        self.hooks.on_outer_step(averaged)

    async def _run_round(self, pending: Round) -> None:
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

    async def _second_round(self, request: ExchangeRequest, arrays: Tensors, first: Round | None, partner: str,
                            size: int, partners: list[str], group_outer_step: int) -> tuple[int, int]:
        """The second round of a group step (node/averaging/pairing.py, `schedule`): send what the first round gave
        (the pair's sample-weighted means, or our own values after a bye or a failed first round) to the
        second-round partner, receive its side's, and leave n times the group's weighted means in the
        outputs. Returns the group size and the group's outer step (`group_outer_step`: the first round's);
        a second round that does not happen or fails leaves the first round's result (a pair's weighted
        means, or a solo step). The arithmetic is node/averaging/group_mean.py's."""
        own_samples = max(0, request.samples)
        if first is not None:
            partner_samples = self._credit(first)[1]
            mine = self._group_mean.pair_means(arrays, own_samples, partner_samples)
            members, samples = 2, own_samples + partner_samples
            steps = max(request.inner_steps, self._credit(first)[0])
        else:
            mine = arrays
            members, samples, steps = 1, own_samples, request.inner_steps
        began = trio.current_time()
        # A bye's partner is still in its first round: it gets that round's window as well.
        window = self.cfg.pair_window_s * (2 if first is None and not partners else 1)
        pending = Round(request, mine, stage=2, members=members, samples=samples, inner_steps=steps,
                           window_s=window, open_phase=False, began=began, scheduled=partner,
                           scheduled_until=began + window)
        await self._run_round(pending)
        if pending.result < 2:
            if first is None:
                return size, group_outer_step
            # The transfer may have written into the outputs before it failed: the first round's result
            # is the pair's means, kept in `mine`.
            restore_pair(arrays, mine)
            return 2, group_outer_step
        partners.append(partner)
        theirs, stated = self._credit(pending)[1], _stated(pending)
        group = members + stated.members
        # The outputs hold the plain sum of the two sides' means; weight each side by its samples (by its
        # members where samples are unknown) and scale by the group size for the worker.
        weights = (samples, theirs) if samples > 0 and theirs > 0 else (members, stated.members)
        group_sums(arrays, mine, *weights, group)
        return group, stepping.group_outer_step(group_outer_step, stated.outer_step, self.cfg.max_step_gap)

    def _follow_the_swarm(self, outer_step: int, group_outer_step: int | None) -> int | None:
        """The outer step to continue from: the exchange's, or the swarm's where we fell far behind it
        (node/averaging/stepping.py, `follow_the_swarm`)."""
        return stepping.follow_the_swarm(self.me, outer_step, group_outer_step, self.swarm.swarm_steps(),
                                         self.cfg.max_step_gap)

    def _asked_count(self, request: ExchangeRequest, outcome: ExchangeOutcome) -> ExchangeOutcome:
        """`outcome` with the count the catch-up asked for (`follow`), once: ahead of where the round left
        us, as the outer step to follow; behind it, exactly, after a solo step only (a round that averaged
        was within its partner's gap, and moving back would break the pair's agreement). With streaming
        fragments, once for each fragment (each keeps its own count, and all of them must follow)."""
        outer_step, asked = request.outer_step, self._follow_to
        if asked is None:
            return outcome
        if request.fragments > 1 and request.fragment not in self._followed:
            self._followed.add(request.fragment)
            if len(self._followed) >= request.fragments:
                self._follow_to, self._followed = None, set()
        elif request.fragments > 1:
            return outcome  # this fragment followed already; the others have not
        else:
            self._follow_to = None
        current = max(outer_step, outcome.group_outer_step or 0)
        if asked > current:
            log.info("outer step %d: continuing from the swarm's outer step %d (the catch-up's count)",
                     outer_step, asked)
            self._last_outer_step = max(self._last_outer_step, asked)
            return replace(outcome, group_outer_step=asked)
        if asked < current and outcome.group_size < 2:
            log.info("outer step %d: going back to the swarm's outer step %d (the catch-up's count)",
                     outer_step, asked)
            self._last_outer_step = asked
            return replace(outcome, group_outer_step=None, exact_outer_step=asked)
        return outcome

    def follow(self, outer_step: int) -> None:
        """Continue from `outer_step` at the end of our next round, ahead of ours or behind it: the catch-up
        moves the count alone when the weights are fresh and a download would be dear (node/averaging/
        latejoin.py, `CatchUp.follow_instead`). The caller vouches for the step (the swarm's median from
        the member records, never one partner's word)."""
        self._follow_to, self._followed = outer_step, set()

    def typical_rate_bps(self) -> float | None:
        """Our typical rate each way over every partner measured (bytes/s over the seconds they flowed, `FlowRate`; None: never measured)."""
        return self._rate_bps

    def outer_period_s(self) -> float:
        """Seconds of one of our outer steps as far as we know them (0: unknown; the whole period, with
        streaming fragments too)."""
        return self._outer_period_s() * self.cfg.fragments

    def _schedule_members(self) -> list[str]:
        """The other trainers the schedule pairs us among: the eligible ones (the swarm state's view; other
        nodes' views may differ by a few members, which moves only a few partners)."""
        return sorted(set(self.swarm.eligible_partners()) - {self.me})

    def _busy_wait_s(self) -> float:
        return busy_wait_s(self.cfg.pair_window_s, max(self._transfers_s, default=None), self.cfg.max_transfer_s)

    async def _pair(self, pending: Round) -> None:
        while pending.open and trio.current_time() < self._round_ends(pending):
            if pending.in_scheduled_phase(trio.current_time()):
                await self._meet_scheduled(pending)
                if pending.open and self._wait_outlasted_window(pending):
                    await self._ask_another(pending)
                continue
            if not pending.open_phase:
                break
            partner = self._choose_partner()
            if partner is None:
                await trio.sleep(random.uniform(0.1, 0.4))
                continue
            self.misses.note(partner, await self._try_partner(pending, partner))
            if pending.open:
                await trio.sleep(random.uniform(0.05, 0.2))
        if pending.open:
            pending.close()

    async def _meet_scheduled(self, pending: Round) -> None:
        """One try at the scheduled partner: the smaller PeerID asks, the other waits for its request."""
        partner = pending.scheduled
        assert partner is not None
        if self.admission.banned(partner):
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
        if not pending.open:
            return
        if partner < self.me and outcome in (Attempt.NOT_READY, Attempt.BUSY):
            await trio.sleep(0.1)  # the probe: it will ask us (or its crossing request is on its way)
            return
        if outcome is Attempt.EXCHANGING and pending.window_s is None:
            # Still moving its previous outer step over a slow link: keep the schedule's pairing and wait
            # for it (`_busy_wait_s`), asking again at a pace that costs nothing next to such a transfer.
            if not pending.scheduled_busy:
                # From the first time it says so, not from our publish: a partner that began a transfer just
                # as we published (or as our scheduled phase ended, when we are the one that waits to be
                # asked) still has a whole one to go.
                pending.busy_until = trio.current_time() + self._busy_wait_s()
                pending.scheduled_until = max(pending.scheduled_until, pending.busy_until)
            pending.scheduled_busy = True
            if trio.current_time() < pending.scheduled_until:
                # (Never past the wait: the open phase after it has its whole length.)
                await trio.sleep(min(random.uniform(*SCHEDULED_RETRY_S) * 3,
                                     pending.scheduled_until - trio.current_time()))
                return
        if outcome is Attempt.NOT_READY:
            await trio.sleep(random.uniform(*SCHEDULED_RETRY_S))
        else:
            pending.scheduled_until = 0.0  # it refused, failed, or pairs with someone else: open phase

    def _wait_outlasted_window(self, pending: Round) -> bool:
        """Whether this round is in a wait for a busy scheduled partner (`_meet_scheduled`) that has run
        past the round's own pairing window: the stretch a slow link's transfer adds.

        Why it matters: within the window the wait keeps the schedule's pairing (the busy partner usually
        comes free by then, and the pair that ended first would otherwise go back to each other). Past it, a
        round without the wait would have ended, and its open phase taken anyone, the last partner included.
        bench/wan.py, one-slow at 0.4 Mbit/s (2026-11-27 10:31 run): the two fast trainers that had just
        averaged with each other each waited up to 15 s for a member of the slow pair (whose exchanges take
        8-10 s), refused each other as the last partner, and stepped solo side by side; one of them four
        outer steps running. Averaging with the last partner beats a solo step."""
        window = self.cfg.pair_window_s if pending.window_s is None else pending.window_s
        return pending.scheduled_busy and trio.current_time() >= pending.began + window

    def _asker_outlasted_window(self, req: avg.AvgRequest) -> bool:
        """Whether a first-round asker says it has looked for a partner for a whole pairing window: past it, a
        round ends in a solo step unless it is stretched (`_round_ends`), so our last partner is taken too.

        Why the asker's wait and not only ours: two trainers that had just averaged with each other publish
        seconds apart, and each took the other only once its own wait had outlasted its window. The one
        that published first asked while the other was still within its window and was refused; by the time
        the other's window was over, the first had stepped solo (bench/wan.py, one-slow at 0.4 Mbit/s,
        2026-11-27 14:37 debug run: two such solo steps side by side in 180 s). A peer that overstates its
        wait gains only a pairing with its last partner, which the open phase allows anyway."""
        return req.stage == 1 and req.waited_ms / 1000 >= self.cfg.pair_window_s

    async def _ask_another(self, pending: Round) -> None:
        """In a wait for a busy scheduled partner that outlasted the window: ask one other ready partner
        (the open phase's choice, the last partner included) between the asks of the scheduled one; the
        responder side of the same rule is in `_judge`."""
        partner = self._choose_partner(exclude=pending.scheduled)
        if partner is None:
            return
        self.misses.note(partner, await self._try_partner(pending, partner))

    def _may_punch(self, partner: str) -> bool:
        """Whether to open a punched side channel with `partner` where its listener (or ours) is behind a
        NAT: only with the side channel on and over a direct connection (a relayed one's remote address is
        the relay's, so a punch towards it could only fail)."""
        return self.cfg.datapath and self.swarm.path_of(partner) in DIRECT_PATHS

    def _last_partner(self) -> str | None:
        """The partner of our latest averaged exchange (None: none yet)."""
        return max(self._last_paired, key=self._last_paired.__getitem__, default=None)

    def _choose_partner(self, exclude: str | None = None) -> str | None:
        """A ready eligible partner for the open phase (never `exclude`): the least recently paired, random
        among ties (never paired counts as least recent), so that the fallback spreads partners too.

        Partners whose answer we wait for longer than `sync.handshake_timeout_s` (a link measured slow,
        `_answer_deadline_s`) are asked here only where every partner is such: outside the schedule such an
        ask almost never pairs (one slow trainer among fast ones is busy with its scheduled partner nearly
        all the time: 1 accept in 49 such asks, bench/wan.py one-slow at 0.4 Mbit/s, 2026-11-27 15:00), and
        while its answer waits in that link's queue we turn away every other asker ("asking someone
        else"); two fast trainers stepped solo side by side that way. The schedule still pairs it."""
        pool = {str(p) for p in self.host.get_connected_peers()} & set(self.swarm.eligible_partners())
        pool.discard(self.me)
        if exclude is not None:
            pool.discard(exclude)
        prompt = {p for p in pool if self._answer_deadline_s(p) <= self.cfg.handshake_timeout_s}
        if prompt:
            pool = prompt
        ready = [p for p in pool if self.admission.may_ask(p)]
        if not ready:
            return None
        oldest = min(self._last_paired.get(p, -1) for p in ready)
        return random.choice([p for p in ready if self._last_paired.get(p, -1) == oldest])

    def _answer_deadline_s(self, partner: str) -> float:
        """How long we wait for `partner` to answer a pairing request: `sync.handshake_timeout_s`, or longer
        where the link we measured with it is so slow that a queue's worth of its bulk data takes longer.

        Why: a partner busy transferring over a slow link has its answer to us queued behind that transfer's
        bytes. bench/wan.py, one-slow at 0.4 Mbit/s (2026-11-27 14:49 debug run): the 0.08 Mbit/s trainer's
        answers took over 5 s while it moved an exchange, each ask of it failed with "no answer within 5s",
        cost it an exponential back-off and the asker a solo step; the answer, when it came, said "busy" or
        "accept". A configured guess of the link must not rule out a slow one (issue #23); the rate is
        measured (`_learn_rate`), and the wait stays bounded (`MAX_ANSWER_WAIT_FACTOR`).

        Tried before (2026-11-26, docs/benchmarks.md) and not kept: a deadline doubled after each timeout, up
        to 40 s. It learned from failures, not from the link, so a dead or stalled peer came to cost 40 s; this
        one grows only with a rate measured while bytes flowed, and outside the schedule a partner measured
        slow is not asked at all while others are there (`_choose_partner`)."""
        link = self.admission.links.get(partner)
        base = self.cfg.handshake_timeout_s
        if link is None or not link.rate_bps:
            return base
        return max(base, min(QUEUED_BYTES / link.rate_bps, MAX_ANSWER_WAIT_FACTOR * base))

    def _busy_hold_s(self, partner: str) -> float:
        """After a partner we asked outside the schedule said it is exchanging with someone else: how long
        before asking it again. Half of what an exchange with it takes (its mean bytes over the rate we
        measured with it: where it is in its transfer is unknown); nothing measured, the usual second.

        Why: asking again a second later reached a slow-link partner still moving its transfer, whose
        answer then sat seconds in its link's queue while we, asking, turned away our own scheduled
        partner ("asking someone else"), and both stepped solo (bench/wan.py, one-slow at 0.4 Mbit/s)."""
        link = self.admission.links.get(partner)
        if link is None or not link.rate_bps or not link.rounds:
            return 0.0
        return 0.5 * link.bytes_sent / link.rounds / link.rate_bps

    def _transfer_limits(self) -> avg.TransferLimits:
        """A transfer runs as long as it moves (protocols/avg.py, `TransferLimits`): no deadline from a link
        rate, assumed or measured, can rule out a slow link that works."""
        return avg.TransferLimits(stall_s=self.cfg.stall_timeout_s, max_s=self.cfg.max_transfer_s)

    def _learn_rate(self, partner: str, progress: avg.Progress, *, completed: bool = False) -> None:
        """Fold this transfer's bytes and the time they flowed into the partner's link and our typical rate
        (`FlowRate`), whether it completed or not: a transfer that was cut still shows what the link does. A completed one too fast
        to time counts as a lower bound (`TIMED_FLOW_S`): without it a small probe on a fast link would
        teach nothing, and `auto` would probe again at every exchange."""
        if progress.rate_bps(TIMED_FLOW_S) is not None:
            assert progress.first is not None and progress.last is not None
            seconds = progress.last - progress.first
        elif completed and progress.bytes > 0:
            seconds = TIMED_FLOW_S
        else:
            return
        # Bytes over the seconds they flowed, across transfers (`FlowRate`): a probe that passed in a token
        # bucket's burst weighs its few milliseconds, not as much as a whole exchange. The round trips of
        # those seconds are no preset's doing and come out first (link_model.py): the same bandwidth must
        # give the same preset at 0 and 100 ms.
        each_way = progress.bytes / 2
        seconds = bandwidth_s(each_way, seconds, self._rtt_s(partner), floor_s=TIMED_FLOW_S)
        link = self.admission.link(partner)
        link.rate_bps = link.flow.add(each_way, seconds)
        self._rate_bps = self._flow.add(each_way, seconds)

    def _rtt_s(self, partner: str) -> float | None:
        """The round trip to `partner` as its connection measured it (None: unknown, or not to be had)."""
        try:
            rtt = self.swarm.rtt_s(partner)
        except Exception:  # the view's answer is a figure for a model, never a reason to fail an exchange
            log.debug("no round trip to %s", partner, exc_info=True)
            return None
        return float(rtt) if isinstance(rtt, (int, float)) and 0 < rtt < 60 else None

    def _outer_period_s(self) -> float:
        """Compute seconds of one of our outer steps as far as we know them (0: unknown); with streaming
        fragments, of one fragment's share of it (the period over F): `auto`'s budget for a transfer, since
        the F fragments' transfers share the link one after another (node/bridge/supervisor.py) and each
        must end before the next fragment's slot. A fragment of 1/F of the model in 1/F of the time: the
        preset `auto` picks is the whole vector's at the same link rate."""
        try:
            period = float(self.swarm.outer_period())
        except Exception:  # a period that cannot be computed is unknown, as before any speed was measured
            log.exception("the outer step's period could not be computed")
            return 0.0
        return period / self.cfg.fragments if period > 0 and period != float("inf") else 0.0

    def _compression_for(self, partner: str, pending: Round) -> str:
        """The preset we ask `partner` to exchange this round with (node/averaging/compression_choice.py)."""
        link = self.admission.link(partner)
        return preset_for(self.cfg.compression, stage=pending.stage, link_rate_bps=link.rate_bps,
                          typical_rate_bps=self._rate_bps, period_s=self._outer_period_s(),
                          numel=pending.tensors.phi.size, previous=self._previous(partner),
                          group_size=self.cfg.group_size, wire_dtype=self.cfg.wire_dtype)

    def _own_exact(self, partner: str, used: str, numel: int) -> bool:
        """Whether the worker applies its own Delta in full after this lossy exchange with `partner`
        (compression_choice.py `keeps_own_exact`): the link, measured by this very transfer, would already
        carry a less compressed preset."""
        own = keeps_own_exact(self.cfg.compression, used, rate_bps=self.admission.link(partner).rate_bps,
                              period_s=self._outer_period_s(), numel=numel, wire_dtype=self.cfg.wire_dtype)
        if own:
            log.debug("exchange with %s was %s only while the link was unknown: our own Delta applies in full",
                      partner, used)
        return own

    def _phi_is_the_swarms(self) -> bool:
        """Whether our phi is the swarm's model: the node's judge where it has one (the daemon's catch-up,
        which also knows of worker restarts and adopted snapshots), else averaged within our last
        `max(1, sync.max_step_gap)` outer steps."""
        if self.hooks.weights_fresh is not None:
            return self.hooks.weights_fresh()
        return self._since_averaged is not None and self._since_averaged <= max(1, self.cfg.max_step_gap)

    def _previous(self, partner: str) -> str | None:
        """The preset `preset_for` starts from with `partner`: the last one used or asked for with it,
        else, for a partner we never exchanged with, the floor our completed exchanges allow
        (`first_ask_floor`)."""
        link = self.admission.link(partner)
        if link.compression is not None or link.rate_bps is not None:
            return link.compression
        return first_ask_floor(self._widest)

    def _compression_wanted(self, partner: str, req: avg.AvgRequest) -> str:
        """The preset we would ask `partner` for in its request's round, as its responder (the same rule as
        `_compression_for`, on our view of the link): an `auto` responder takes that or more compressed."""
        if self.cfg.compression != AUTO:
            return self.cfg.compression
        link = self.admission.link(partner)
        return preset_for(AUTO, stage=req.stage, link_rate_bps=link.rate_bps, typical_rate_bps=self._rate_bps,
                          period_s=self._outer_period_s(), numel=req.numel, previous=self._previous(partner),
                          group_size=self.cfg.group_size, wire_dtype=req.wire_dtype)

    def _round_ends(self, pending: Round) -> float:
        """When this round stops looking for a partner (trio clock): its window, or its scheduled phase
        where a wait for a busy scheduled partner stretched it."""
        window = self.cfg.pair_window_s if pending.window_s is None else pending.window_s
        ends = max(pending.began + window, pending.scheduled_until)
        if pending.busy_until is not None and pending.open_phase:
            # After the wait for a busy scheduled partner, an open phase as long as a round's: the trainer
            # that waits beside us for the other member of that busy pair (our last partner, most often: it
            # was our partner because both pairs had one count) was not ours to take while we waited.
            ends = max(ends, pending.busy_until + (1 - SCHEDULED_SHARE) * window)
        if pending.saw_ready and pending.open_phase and pending.window_s is None:
            # Partners are in rounds of their own (busy, or waiting for theirs): one comes free within about
            # a transfer, and the worker trains on while we wait, so the round looks as long as a wait for a
            # busy scheduled partner would (`busy_wait_s`: the window itself on a fast link) before a solo step.
            ends = max(ends, pending.began + self._busy_wait_s())
        return ends

    def _request_of(self, pending: Round, compression: str, fragment: int) -> avg.Ask:
        return avg.Ask(
            self._contribution(pending),
            manifest_hash=self.swarm.manifest_hash() or "none",
            layout_hash=pending.request.layout_hash,
            wire=avg.Wire(self.cfg.wire_dtype, compression=compression, fragment=fragment),
            datapath=self.listener is not None,
            stage=pending.stage,
            stream_fragment=pending.request.fragment,
            stream_fragments=pending.request.fragments,
        )

    @staticmethod
    def _contribution(pending: Round) -> avg.Contribution:
        """What our values cover and how long we have waited: the partner's weights and phase."""
        waited = max(0.0, trio.current_time() - pending.began)
        samples = pending.request.samples if pending.samples is None else pending.samples
        return avg.Contribution(
            outer_step=pending.request.outer_step,
            inner_steps=min(max(0, pending.own_steps), 1 << 30),
            samples=min(max(0, samples), 1 << 40),
            waited_ms=min(int(waited * 1000), 1 << 30),
            members=pending.members,
        )

    def _session(self, remote_peer_id: bytes, handshake_timeout: float, progress: avg.Progress) -> avg.Session:
        """One exchange's ends and bounds (protocols/avg_call.py, `Session`), either side."""
        return avg.Session(self.host.get_id().to_bytes(), remote_peer_id, handshake_timeout,
                           self._transfer_limits(), progress)

    def _note_partner(self, pending: Round, message: avg.AvgRequest | avg.AvgAnswer) -> None:
        if isinstance(message, avg.AvgRequest):
            # The initiator chooses the preset and phi's fragment (`_judge` accepted the preset).
            pending.compression = message.compression
            pending.fragment = message.fragment
        # A partner cannot have waited longer than our window allows (its figure only moves our phase).
        pending.theirs = avg.Contribution(message.outer_step, message.inner_steps, message.samples,
                                          min(message.waited_ms, int(self.cfg.pair_window_s * 1000)), message.members)

    async def _try_partner(self, pending: Round, partner: str, *, scheduled: bool = False) -> Attempt:
        """Ask `partner` (`Attempt` says what came of it); the partner's answer is acted on by its code
        (protocols/avg.py, `AnswerCode`), never by its words, with one exception: an `auto` partner that
        refuses our preset as too little compressed for its link names the one it wants, and we ask again
        at once with it, within the round's window (node/averaging/compression_choice.py, `after_refusal`:
        always more compressed, so at most `len(ORDER) - 1` retries)."""
        compression = self._compression_for(partner, pending)
        outcome = Attempt.FAILED
        for _ in ORDER:
            outcome, retry = await self._ask(pending, partner, compression, scheduled=scheduled)
            if retry is None:
                break
            compression = retry
        return outcome

    async def _ask(self, pending: Round, partner: str, compression: str, *,
                   scheduled: bool) -> tuple[Attempt, str | None]:
        """One request to `partner` for preset `compression`: what came of it, and the preset to ask again
        with at once (None: none; `_try_partner`)."""
        pending.initiating_to = partner
        began = trio.current_time()
        claimed_here = False
        numel = pending.tensors.phi.size
        progress = avg.Progress()
        preset = get_compression(compression)
        fragment = preset.fragment_of(pending.request.outer_step) if preset.lossy else 0
        answered = False  # the partner's answer came: what fails after it is no handshake timeout
        deadline = self._answer_deadline_s(partner)
        result: avg.TransferResult | None = None
        clock = PhaseClock(time.monotonic())  # where this exchange's time goes (`sync.last_asked`)
        try:
            # The side channel's connect goes out with the request, to the port of our last exchange with
            # this partner (one listener per daemon): the answer names it a round trip later.
            link = self.admission.link(partner)
            hint = link.datapath_addr if self.cfg.datapath else None
            async with avg.preconnect(hint, timeout=avg.DATAPATH_CONNECT_S) as early:
                stream = None
                with trio.fail_after(deadline):
                    stream = await open_stream(self.host, ID.from_base58(partner), avg.PROTOCOL_IDS,
                                               optimistic=link.speaks_latest)  # the request rides with it
                clock.stream_open = time.monotonic()
                self.admission.saw(partner, avg.partner_ip(stream))

                def claim(answer: avg.AvgAnswer) -> bool:
                    nonlocal claimed_here, answered
                    answered = True
                    clock.answered = time.monotonic()
                    if not pending.open:
                        return False  # a crossing request claimed this step meanwhile
                    pending.claim(partner, trio.current_time())
                    self._note_partner(pending, answer)
                    ip = avg.partner_ip(stream)
                    link.datapath_addr = (ip, answer.datapath_port) if ip and answer.datapath_port else None
                    pending.compression, pending.fragment = compression, fragment
                    pending.progress = progress
                    claimed_here = True
                    log.debug("partner %s accepted %s after %.2fs", partner, compression, trio.current_time() - began)
                    return True

                try:
                    result = await avg.initiate(
                        stream,
                        self._request_of(pending, compression, fragment),
                        pending.tensors,
                        self._session(ID.from_base58(partner).to_bytes(), deadline, progress),
                        remote_ip=avg.partner_ip(stream),
                        on_accept=claim,
                        validate=self._values_judge(pending),
                        offer_punch=self._may_punch(partner),
                        early=early,
                    )
                finally:
                    link.speaks_latest = speaks(stream, avg.PROTOCOL_ID)  # refused: negotiate next time
                    await close_quietly(stream)
        except Declined as e:
            self.report.declined()
            retry = self._retry_compression(pending, partner, compression, e)
            if retry is not None:
                self.report.refused(partner, "partner", e.code, e.reason, pending.request.outer_step, e.outer_step)
                log.debug("partner %s wants more compression than %s: asking again with %s", partner,
                          compression, retry)
                return Attempt.REFUSED, retry
            not_ready = e.code.asks_again
            if e.code.busy and e.code is not AnswerCode.OTHER_FRAGMENT:
                # Busy or between outer steps, it shows where its count is (a refusal's may be far off;
                # another fragment's round shows that fragment's count, not ours).
                pending.largest_seen = max(pending.largest_seen, e.outer_step)
                pending.saw_ready = pending.saw_ready or not not_ready
            if not_ready and e.since_publish_ms > 0:
                their_publish = trio.current_time() - min(e.since_publish_ms / 1000, 86400.0)
                pending.phase_gaps.append((their_publish - pending.began, e.paired))
            if not scheduled:
                hold = self._busy_hold_s(partner) if e.code is AnswerCode.EXCHANGING else 0.0
                self.admission.back_off(partner, soft=True, at_least_s=hold)
            log.debug("partner %s declined: %s", partner, e)
            if not_ready:
                return Attempt.NOT_READY, None
            if e.code.busy:
                return (Attempt.EXCHANGING if e.code is AnswerCode.EXCHANGING else Attempt.BUSY), None
            ours = pending.request.outer_step
            self.report.refused(partner, "partner", e.code, e.reason, ours, e.outer_step)
            if e.code is AnswerCode.STEP_GAP:
                if e.outer_step > ours:
                    self.hooks.on_behind(e.outer_step)
                return Attempt.APART, None  # an honest state the catch-up ends: no missed round (partner_misses.py)
            return Attempt.REFUSED, None
        except Exception as e:  # ProtocolError, TooSlowError, and whatever libp2p raises for a dead stream
            self._learn_rate(partner, progress)
            if isinstance(e, trio.TooSlowError) and not answered:  # it said nothing: say which deadline
                why = ("sync.handshake_timeout_s" if deadline == self.cfg.handshake_timeout_s
                       else "longer than sync.handshake_timeout_s: the link with it was measured slow")
                e = trio.TooSlowError(f"no answer to the pairing request within {deadline:g}s ({why})")
            self._fail(partner, e, trio.current_time() - began)
            if claimed_here:  # our exchange owned this step and failed: solo, nothing applied
                pending.result = 1
                pending.done.set()
            return Attempt.FAILED, None
        finally:
            pending.initiating_to = None
        if result is None:  # never: each way out of the block above returns or raises; a guard, not a path
            log.error("exchange with %s ended without a result or an error", partner)
            return Attempt.FAILED, None
        self._learn_rate(partner, progress, completed=True)
        self._succeed(partner, result, numel, pending.compression, pending.request)
        self.report.stats["last_asked"] = asked_status(
            partner, clock.phases(progress.first, progress.last, time.monotonic()), self._rtt_s(partner))
        pending.result = 2
        pending.done.set()
        return Attempt.PAIRED, None

    def _retry_compression(self, pending: Round, partner: str, asked: str, refusal: Declined) -> str | None:
        """The preset to ask `partner` again with after its refusal (None: no retry): only an `auto`
        initiator's first round, refused for compression, with a more compressed preset to go to
        (`after_refusal`) and time left in the round. A preset the refusal named is kept as the partner's
        last one, so the next exchange starts there, and as a floor until a transfer measures the link
        again (`_compression_for`'s hysteresis relaxes it only then)."""
        if (refusal.code is not AnswerCode.COMPRESSION or self.cfg.compression != AUTO or pending.stage != 1
                or self.cfg.group_size != 2):
            return None
        wanted = wanted_in(refusal.reason)
        retry = after_refusal(asked, wanted)
        if retry is None:
            return None
        if wanted is not None:
            link = self.admission.link(partner)
            link.compression = retry
            # The partner measured this link slower than we did: our rate (often a probe that passed in a
            # token bucket's burst) is not evidence until a transfer measures it again, so the named preset
            # is a floor till then (`preset_for`). Without this a fast trainer asked the 0.08 Mbit/s one
            # for `medium` at every exchange, each a refusal and a retry through that link's queue.
            link.rate_bps = None
        if not pending.open or trio.current_time() >= self._round_ends(pending):
            return None
        return retry

    # --- the responder -----------------------------------------------------------------------------------

    async def _handle_stream(self, stream: Any, *, coded: bool = True) -> None:
        """Inbound requests, each read under the handshake deadline, as many at once as admission allows
        (node/averaging/admission.py, `Admission.inbound`: silent or slow peers cannot pile up tasks and
        buffers); extra ones are reset at once. `coded`: the asker speaks 1.3.0, whose answers carry a
        reason code (protocols/avg.py)."""
        with self.admission.inbound(per_ip_key(avg.partner_ip(stream))) as admitted:
            if not admitted:
                await close_quietly(stream, reset=True)
                return
            await self._serve_request(stream, coded=coded)

    async def _serve_request(self, stream: Any, *, coded: bool = True) -> None:
        arrived = trio.current_time()
        partner = str(stream.muxed_conn.peer_id)
        self.admission.saw(partner, avg.partner_ip(stream))
        try:
            request = await avg.read_request(stream, self.cfg.handshake_timeout_s)
        except (ProtocolError, trio.TooSlowError) as e:
            self._fail(partner, e, 0.0, count=isinstance(e, ProtocolError))
            await close_quietly(stream, reset=True)
            return
        pending = self._pending
        if pending is not None:
            pending.saw_ready = True  # whoever asks has published: our phase is not off everyone's
        verdict = self._judge(request, pending, partner)
        if (pending is not None and (verdict is None or verdict[0].busy)
                and (verdict is None or verdict[0] is not AnswerCode.OTHER_FRAGMENT)):
            # Only a trainer of our run (manifest, layout and step gap passed) shows us where the count is
            # (and only of our fragment: each streaming fragment keeps its own count).
            pending.largest_seen = max(pending.largest_seen, request.outer_step)
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
            self.report.refused(partner, "us", verdict[0], verdict[1], ours, request.outer_step)
            if verdict[0] is AnswerCode.STEP_GAP and request.outer_step > ours:
                self.hooks.on_behind(request.outer_step)  # the asker is ahead of us beyond the gap: we are behind
        if verdict is not None:
            # Between outer steps we say the last one we took: an asker that is behind learns the count.
            since = 0
            if pending is None and self._last_publish_at is not None:
                since = max(1, min(int((trio.current_time() - self._last_publish_at) * 1000), 1 << 31))
            await avg.answer(stream, verdict[0], verdict[1],
                             pending.request.outer_step if pending else self._last_outer_step, since,
                             paired=pending is None and self.report.last_step_averaged(), coded=coded)
            await close_quietly(stream)
            return
        assert pending is not None
        log.debug("accepting %s's request for %s (read in %.2fs)", partner, request.compression,
                  trio.current_time() - arrived)
        pending.claim(partner, trio.current_time())
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
                    self._session(stream.muxed_conn.peer_id.to_bytes(), self.cfg.handshake_timeout_s, progress),
                    self._contribution(pending),
                    listener=self.listener if self.swarm.reachable() else None,
                    validate=self._values_judge(pending),
                    allow_punch=self._may_punch(partner),
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
        self._learn_rate(partner, progress, completed=True)
        self._succeed(partner, result, pending.tensors.phi.size, pending.compression, pending.request)
        pending.result = 2
        pending.done.set()
        await close_quietly(stream)

    async def _await_round(self, stage: int, current: Round, arrived: float) -> Round | None:
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

    def _judge(self, req: avg.AvgRequest, pending: Round | None, partner: str) -> tuple[AnswerCode, str] | None:
        """None to accept, else why not: the code the asker acts on (its verdict, busy or refuse, goes with
        it) and the words it logs and shows."""
        if not self.cfg.allow_relay_bulk and self.swarm.path_of(partner) not in DIRECT_PATHS:
            return (AnswerCode.NO_DIRECT_PATH, "no direct path between us: bulk tensors do not go through relays")
        if self.admission.banned(partner):
            return (AnswerCode.BANNED, "banned for repeated invalid updates")
        ours = self.swarm.manifest_hash() or "none"
        if req.manifest_hash != ours:
            log.error("refusing %s: run manifest %s differs from ours %s", partner, req.manifest_hash[:12], ours[:12])
            return (AnswerCode.MANIFEST, f"manifest mismatch: yours {req.manifest_hash}, ours {ours}")
        cut = avg.fragment_refusal(req, self.cfg.fragments)
        if cut is not None:
            return (AnswerCode.FRAGMENTS, cut)
        if pending is None:
            return (AnswerCode.NOT_READY, "not ready (training between outer steps)")
        if req.stream_fragment != pending.request.fragment:
            # Partners publish a period's fragments in the same order: it reaches ours soon, or we its.
            return (AnswerCode.OTHER_FRAGMENT,
                    f"syncing fragment {pending.request.fragment}, not {req.stream_fragment}")
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
        # Error feedback and the fragment pull assume what the wire carried: a mix would be silently wrong.
        # With `auto`, a preset less compressed than our own choice for this initiator is refused too (the
        # slower side's view wins, node/averaging/compression_choice.py); the answer names the one we want.
        wants = self._compression_wanted(partner, req)
        if not accepts(self.cfg.compression, self.cfg.group_size, req.compression, wants):
            return (AnswerCode.COMPRESSION, refusal_reason(self.cfg.compression, self.cfg.group_size,
                                                           req.compression, wants))
        if not pending.open:
            return (AnswerCode.EXCHANGING, "already exchanging")
        if (pending.in_scheduled_phase(trio.current_time()) and partner != pending.scheduled
                and not (pending.scheduled_busy and (partner != self._last_partner()
                                                     or self._wait_outlasted_window(pending)
                                                     or self._asker_outlasted_window(req)))):
            # While the scheduled partner is busy transferring, another trainer may pair with us, just
            # not the one we last averaged with: the pair that ends its transfer first would go back to
            # each other step after step (fixed pairs, what the wait exists to prevent), while anyone
            # else mixes. bench/wan.py, one-slow at 0.4 Mbit/s: a fast trainer stepped solo after
            # "waiting for the partner the schedule gives it" from two free trainers, 8 times in 180 s.
            # Once the wait has outlasted the round's window, the last partner too (`_wait_outlasted_window`),
            # and once the asker's has (`_asker_outlasted_window`).
            return (AnswerCode.SCHEDULED, "waiting for the partner the schedule gives it")
        if pending.initiating_to is not None:
            if pending.initiating_to == partner and partner < self.me:
                return None  # crossing requests: the smaller PeerID's request wins
            if pending.initiating_to == partner:
                return (AnswerCode.CROSSING, "crossing request")
            return (AnswerCode.ASKING_OTHER, "asking someone else")
        return None

    # --- bookkeeping -------------------------------------------------------------------------------------

    def _succeed(self, partner: str, result: avg.TransferResult, numel: int = 0, compression: str = "none",
                 request: ExchangeRequest | None = None) -> None:
        self._transfers_s.append(result.duration_s)
        self.admission.succeeded(partner, sent=result.bytes_sent, received=result.bytes_received, path=result.path,
                                 compression=compression, clipped=result.clip.clipped)
        if compression in ORDER and (self._widest is None or ORDER.index(compression) < ORDER.index(self._widest)):
            self._widest = compression
        fragment = (request.fragment, request.fragments) if request is not None and request.fragments > 1 else None
        self.report.exchanged(partner, result, numel, compression, fragment)
        total = result.bytes_sent + result.bytes_received
        if self.metrics is not None:
            self.metrics.observe_round(result.duration_s, total, partner, True)
        self.hooks.on_transfer(partner, total, result.duration_s)
        log.debug("averaged with %s over the %s in %.2fs (%.1f MB)", partner, result.path, result.duration_s, total / 1e6)

    def _fail(self, partner: str, error: BaseException, duration: float, *, count: bool = True) -> None:
        text = f"{type(error).__name__}: {error}"[:300]
        offence = True
        if (isinstance(error, Rejected) and error.reason == "phi_distance" and not error.wild
                and not self._phi_is_the_swarms()):
            # Refused (its values are not applied) and backed off, but no offence: our phi is no swarm's
            # model yet, so a partner far from it says as much about us as about it. A fresh node beside a
            # trained swarm (its late join found no trained member in time) otherwise banned every honest
            # trainer for `ban_s` after three such refusals (tests/test_nat_swarm_lab.py, 2026-11-27); it
            # catches up instead (latejoin.py). A wild phi (farther than 4x our whole model's norm) and a
            # Delta out of bounds are offences whatever our phi.
            offence = False
            text += " (not counted as an offence: we have not averaged yet)"
        self.admission.failed(partner, error, count=count, offence=offence)
        self.report.failed(partner, text, count=count)
        if count and self.metrics is not None:
            self.metrics.observe_round(duration, 0, partner, False)
        log.warning("exchange with %s failed: %s", partner, text)


def _stated(pending: Round) -> avg.Contribution:
    """What the round's partner stated of its values (`_note_partner`); read once paired, when it has."""
    assert pending.theirs is not None, "the partner's request or answer has not come"
    return pending.theirs


def _arrays(request: ExchangeRequest) -> Tensors:
    """The request's four slots as flat float32 numpy arrays over the same memory (no copy; `ValueError`
    where that cannot be). The daemon's views of the shared memory are numpy arrays already
    (node/bridge/shm.py); CPU torch tensors, as tests and benches hand them in, are viewed without a copy too."""
    return Tensors(request.phi, request.delta, request.phi_out, request.delta_out).as_arrays()
