"""Late join and catch-up: a trainer takes the swarm's weights instead of its own.

Late join: before the worker's first inner step, a daemon with no checkpoint looks for alive trainers
that have made outer steps, downloads the slow weights and step counters of up to `sync.join_donors` of
them at once (chunked, hashed, resumable: `protocols/snapshot.py`), and leaves their mean in
`HOME/join/snapshot.pt` (a hashed checkpoint file). The worker starts from it when it has no checkpoint
of its own, keeping its own data shard and a fresh inner optimizer. Donors serve their worker's current
slow weights from the shared phi slot while they are still (node/bridge/livephi.py), else their newest
verified checkpoint (`snapshot_source`).

Catch-up (`CatchUp`): a trainer that has drifted more than `sync.max_step_gap` outer steps from the
swarm has nobody to average with, and averaging is what would bring it back. After
`sync.catch_up_after` outer steps in a row that were not averaged (at once when a partner refuses it as
too far behind: `CatchUp.behind`), the daemon downloads the same
kind of snapshot from donors near the swarm's median outer step, while training goes on, and the worker
adopts it at its next outer step (`node.worker.trainer.Trainer.adopt_snapshot`). A trainer that is off
only in its outer-step count, behind or ahead (it averaged within the last `max_step_gap` outer steps,
so its weights are the swarm's), and whose link would take longer than an outer step to download the
snapshot moves its count to the swarm's instead (`CatchUp.follow_instead`): the count carries no weights, and over a slow link the
download is what kept such a trainer out of every exchange.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import trio
from libp2p.peer.id import ID

from node.bridge.ckptfile import CheckpointError, read_phi, write_phi
from node.config.home import Home
from node.config.sync import SyncConfig
from node.status_schema import ProgressStatus
from p2p.fsutil import private_dir
from protocols.record import MemberRecord
from protocols.snapshot import PROTOCOL_ID, JoinDownload, ModelShape, Snapshot, combine

if TYPE_CHECKING:
    from node.bridge.ipc import Adopted

log = logging.getLogger("starling.latejoin")

CATCH_UP_INTERVAL_S = 30.0  # the least time between two catch-up attempts
SNAPSHOT_BYTES_PER_PARAM = 4  # a donor serves its slow weights as float32 (protocols/snapshot.py)
ALONE_GRACE_S = 1.0  # a late join's wait for donors when this node knows of no one at all
DONOR_SETTLE_S = 3.0  # after the first donor appears, how long the wait goes on for more (none new: done)
# Downloads tried before a late join gives up and starts a fresh model: donors are trainers, and a trainer can
# stop mid-download (a replaced machine, a chaos run), while others still could serve.
JOIN_ATTEMPTS = 3
RETRY_PAUSE_S = 2.0


def _checkpoint_files(home: Path) -> list[Path]:
    """Every checkpoint under HOME/checkpoints/<task>-<model>/, newest first (by modification time)."""
    files = [p for _, p in Home(home).checkpoint_files() if p.is_file()]
    return sorted(files, key=lambda p: p.stat().st_mtime, reverse=True)


def has_checkpoint(home: Path) -> bool:
    return bool(_checkpoint_files(home))


def snapshot_source(home: Path) -> Callable[[], Snapshot | None]:
    """What a donor serves when its live weights are not to be had (protocols/snapshot.py `SnapshotServer`):
    its newest checkpoint's slow weights, cached until a newer one appears.

    Called in a worker thread (reading and hashing a checkpoint takes a while for a large model).
    """
    cache: dict[str, Any] = {"path": None, "snapshot": None}

    def source() -> Snapshot | None:
        for path in _checkpoint_files(home):
            if cache["path"] == path:
                return cache["snapshot"]
            try:
                # Only phi and the counters, without torch (node/bridge/ckptfile.py): a checkpoint of an older
                # version (format 1) is not served until the worker writes its next one.
                state = read_phi(path)
                snap = Snapshot.of(state.phi, state.step, state.outer_step, state.layout_hash)
            except (CheckpointError, KeyError, TypeError, ValueError) as e:
                log.debug("not serving %s: %s", path, e)
                continue
            cache.update(path=path, snapshot=snap)
            return snap
        return None

    return source


def near_the_swarm(steps: dict[str, int], gap: int) -> list[str]:
    """Of the trained trainers `steps` (peer id -> outer step), those within `gap` outer steps of the upper
    median of their outer steps: a late join's donors. The mean of donors far apart is no model anyone
    trains (`combine` takes their low median step, so it also starts the joiner at the one behind): a
    founder that ran ahead alone and a second node still catching up made a joiner start from the mean of
    outer steps 179 and 22, at 22. As in the catch-up, the upper median is the majority's position, and
    between two the one further ahead."""
    if not steps:
        return []
    target = statistics.median_high(steps.values())
    return [peer for peer, step in steps.items() if abs(step - target) <= gap]


def choose_donors(members: Iterable[tuple[str, MemberRecord]], me: str, manifest_hash: str | None, max_gap: int,
                  may_download_from: Callable[[str, str | None], bool]) -> list[MemberRecord]:
    """A late join's donors among `members` ((state, signed record) as this node shows them): alive trainers
    other than `me` that have made outer steps and whose record carries `manifest_hash`, the run the joiner
    checked at start-up or else the swarm's (None: no run known, no donor). A member of another run (or one
    that claims none) trains another model, and its snapshot would be refused at its meta. Of those, the ones
    near the swarm's position (`near_the_swarm`: not a mean of far-apart models) that a snapshot may come
    from (`may_download_from(peer, reachability)`: the daemon's rule for bulk tensors over a relay)."""
    if manifest_hash is None:
        return []
    trained = [record for state, record in members
               if state == "alive" and record.role == "trainer" and record.outer_step > 0
               and record.manifest_hash == manifest_hash and record.peer_id != me]
    near = set(near_the_swarm({r.peer_id: r.outer_step for r in trained}, max_gap))
    return [r for r in trained if r.peer_id in near and may_download_from(r.peer_id, r.reachability)]


async def _more_donors(donors: Callable[[], list[str]], found: list[str], max_donors: int, deadline: float) -> list[str]:
    """Once a first donor is known, give the others `DONOR_SETTLE_S` to appear (while fewer than
    `max_donors` are known), and return the longest list seen.

    Why: donors are alive trainers, and with SWIM membership (the default) a joiner holds members alive one
    by one: its seed (the bootstrap node) at once, the others as its join pulls the seed's table and its
    probes reach them, a second or two later. Taking the first list would take the bootstrap node alone
    and start from one replica instead of the swarm's mean."""
    settle_until = min(deadline, trio.current_time() + DONOR_SETTLE_S)
    while len(found) < max_donors and trio.current_time() < settle_until:
        await trio.sleep(0.5)
        now = donors()
        if len(now) > len(found):
            found = now
            settle_until = min(deadline, trio.current_time() + DONOR_SETTLE_S)
    return found


async def late_join(
    host: Any,
    home: Path,
    donors: Callable[[], list[str]],
    *,
    model: ModelShape | None,
    max_donors: int,
    wait_s: float,
    timeout_s: float,
    status: dict[str, Any],
    on_refused: Callable[[str], None] | None = None,
    alone: Callable[[], bool] | None = None,
) -> bool:
    """Download a starting point from the swarm if this node has no checkpoint. True if one was written.

    `alone()`: whether this node knows of no one at all (no bootstrap peer configured, no connection, no
    member): then the wait for donors ends after `ALONE_GRACE_S` (time for a peer that dials us), not
    `wait_s`. Every first start of a swarm's founder waited out `sync.join_wait_s` for donors that could
    not exist.

    `model`: our own model (the start-up check's); a donor's snapshot must be exactly that. None (the
    check did not say in time) starts a fresh model: without our size, a donor's claim would decide how
    much we write to disk. `on_refused(donor)`: a donor whose snapshot was not our model (an offence).

    A download that no chosen donor completed (they stopped, were busy, or had nothing still to serve) looks
    for donors again, up to `JOIN_ATTEMPTS` in all, keeping what arrived: a restarted machine whose donors
    were themselves restarting started a fresh model and trained alone, hundreds of outer steps."""
    folder = Home(home).join
    target = folder.snapshot
    if has_checkpoint(home) or target.exists():
        status["state"] = "not needed"
        return False
    if model is None:
        status["state"] = "own model not known: starting a fresh model"
        log.warning("the start-up check did not say this node's model in time: no late join, starting from a "
                    "fresh model")
        return False
    for attempt in range(1, JOIN_ATTEMPTS + 1):
        status["state"] = "looking for donors"
        # Donors that lied about the model are not asked again.
        honest = functools.partial(_without, donors, frozenset(status.get("refused") or ()))
        found = await _find_donors(honest, max_donors, wait_s, alone)
        if isinstance(found, str):  # alone, or nobody within wait_s
            if attempt > 1:
                found = "no donors left after a failed download: starting a fresh model"
            status["state"] = found
            log.info("late join: %s", found)
            return False
        chosen = random.sample(found, min(max_donors, len(found)))
        status.update(state="downloading", donors=chosen, attempt=attempt)
        try:
            state = await fetch_swarm_snapshot(host, folder.partial, chosen, target, model=model,
                                               timeout_s=timeout_s, status=status, on_refused=on_refused)
        except (OSError, ValueError) as e:  # a full disk, or donors whose snapshots cannot be combined
            status["state"] = f"download failed ({e}): starting a fresh model"
            log.warning("late join failed: %s; starting from a fresh model", e)
            return False
        if state is not None:
            status.update(state="done", step=state["step"], outer_step=state["outer_step"], donors=state["donors"])
            log.info("joined the swarm at outer step %d from the mean of %d donors", state["outer_step"],
                     len(state["donors"]))
            return True
        # Every chosen donor left, was busy or had nothing still to serve: others may (what arrived is kept).
        log.info("late join: no download from %s completed (attempt %d of %d)", ", ".join(chosen), attempt,
                 JOIN_ATTEMPTS)
        await trio.sleep(RETRY_PAUSE_S)  # a busy donor is not asked again the same instant
    status["state"] = f"download failed {JOIN_ATTEMPTS} times: starting a fresh model (will resume the download next start)"
    return False


def _without(donors: Callable[[], list[str]], refused: frozenset[str]) -> list[str]:
    return [d for d in donors() if d not in refused]


async def _find_donors(donors: Callable[[], list[str]], max_donors: int, wait_s: float,
                       alone: Callable[[], bool] | None) -> list[str] | str:
    """The donors to download from, once some are known (and the others given `DONOR_SETTLE_S`), or why none:
    this node knows of no one at all (after `ALONE_GRACE_S`), or nobody trained within `wait_s`."""
    deadline = trio.current_time() + wait_s
    alone_after = trio.current_time() + min(ALONE_GRACE_S, wait_s)
    while trio.current_time() < deadline:
        found = donors()
        if found:
            return await _more_donors(donors, found, max_donors, deadline)
        if alone is not None and trio.current_time() >= alone_after and alone():
            log.info("no bootstrap peer configured and no swarm member known: starting from a fresh model "
                     "without waiting sync.join_wait_s for donors")
            return "alone: starting a fresh model"
        await trio.sleep(0.5)
    log.info("no trained swarm members found within %.0fs; starting from a fresh model", wait_s)
    return "no donors: starting a fresh model"


async def fetch_swarm_snapshot(
    host: Any, directory: Path, donors: list[str], target: Path, *, model: ModelShape, timeout_s: float,
    status: dict[str, Any], on_refused: Callable[[str], None] | None = None,
) -> dict[str, Any] | None:
    """Download the snapshots of `donors` at once into `directory` (resuming what is there), write their
    robust mean (`protocols.snapshot.combine`) to `target` as a hashed checkpoint file and return it; None
    if no download completed within `timeout_s` (the parts that arrived are kept for a resume); ValueError
    (the downloads deleted) if what the donors sent cannot be combined.

    A donor whose meta is not `model` is refused before anything of it is written (`status["refused"]`
    names it, and `on_refused` is told); the others go on without it."""
    download = JoinDownload(directory, model)
    if directory.is_dir():
        download.prune(donors)
    status["progress"] = download.progress

    async def open_stream(donor: str) -> Any:
        return await host.new_stream(ID.from_base58(donor), [PROTOCOL_ID])

    async with trio.open_nursery() as nursery:
        for donor in donors:
            nursery.start_soon(functools.partial(download.fetch, open_stream, donor, timeout_s=timeout_s))
    complete = download.complete()
    refused = [p.donor for p in download.progress.values() if p.refused]
    if refused:
        status["refused"] = refused
        for donor in refused:
            if on_refused is not None:
                on_refused(donor)
    for p in download.progress.values():
        if not p.done and not p.refused:
            log.warning("snapshot download from %s incomplete: %s", p.donor, p.error or "stopped")
    if not complete:
        return None
    try:
        state = await trio.to_thread.run_sync(combine, complete)
    except ValueError:
        download.clear()  # what these donors sent cannot be combined: resuming it would only fail again
        raise
    private_dir(target.parent)
    # phi and the counters only, in the checkpoint format the worker reads (node/bridge/ckptfile.py), without torch.
    await trio.to_thread.run_sync(functools.partial(
        write_phi, target, state["phi"], state["step"], state["outer_step"], state["layout_hash"],
        donors=state["donors"]))
    download.clear()
    return state


class CatchUp:
    """Re-syncs this trainer from the swarm once it has drifted out of every partner's reach.

    Trigger: `sync.catch_up_after` outer steps in a row that were not averaged (the averager reports each
    outer step to `note_outer_step`), or at once a partner's refusal as too far behind (`behind`), while alive trainers of our run exist outside the gap, and this
    node's outer step is more than the gap from the swarm's median. The median (upper median, over every
    alive trainer of the run, this node included) is the majority's position: a lone runaway node comes
    back to the swarm, never the swarm to it; between two nodes the one further ahead is the reference.
    A node at the median does nothing: the others come to it.

    Download: the snapshots of up to `sync.join_donors` (at least one) donors whose outer step is within
    the gap of the median and that we reach without a relay (`may_download_from`), nearest first, under the `sync.join_timeout_s` deadline; training goes on
    meanwhile. The mean goes to `HOME/catchup/snapshot.pt` and `deliver(path, swarm_outer_step)` hands it
    to the worker for its next outer step, where it also continues from the swarm's then-current outer
    step. A failed download is retried after another `catch_up_after` outer steps without a partner.
    Attempts are at least `CATCH_UP_INTERVAL_S` apart: where outer steps are much shorter than a heartbeat
    (tiny models), the member records lag behind and an eager node would download again and again; a
    refusal as too far behind, or our own outer step going back (a worker restarted from an older
    checkpoint), is fresh evidence and lifts that interval.

    Or no download, only the count (`follow_instead`): where this node is off the swarm, averaged within
    its last `max_step_gap` outer steps (and its worker has not gone back to an older checkpoint since),
    and the snapshot would take longer than an outer step over its link (`link_rate_bps`, the rate its
    exchanges measured; `period_s`, the swarm's pace), `follow(target)` moves its outer-step count to the
    swarm's at its next outer step. Why: over a slow link a trainer falls behind in *count* because its
    exchanges stretch its outer steps, not because its weights drift (bench/wan.py, one-slow: the 10 kB/s
    trainer averaged 8 of 13 outer steps, then spent the rest of the run downloading three donors' float32
    weights while every pairing request and SWIM ping over its link timed out). The count carries no
    weights (node/averaging/stepping.py); the next exchange's pull keeps the weights together, as it did.
    """

    def __init__(
        self,
        host: Any,
        home: Path,
        cfg: SyncConfig,
        *,
        own_outer_step: Callable[[], int],
        trainers: Callable[[], dict[str, int]],
        deliver: Callable[[Path, Callable[[], int | None]], None],
        model: Callable[[], ModelShape | None],
        on_refused: Callable[[str], None] | None = None,
        link_rate_bps: Callable[[], float | None] = lambda: None,
        period_s: Callable[[], float] = lambda: 0.0,
        follow: Callable[[int], None] | None = None,
        worker_restarts: Callable[[], int] = lambda: 0,
        may_download_from: Callable[[str], bool] = lambda peer: True,
    ) -> None:
        self.host = host
        # Whether a trainer may serve us a snapshot: not one we reach only through a relay (bulk never
        # crosses a relay). It still counts towards where the swarm is.
        self.may_download_from = may_download_from
        # For `follow_instead`: our link's measured rate each way (bytes/s, None: never measured), the
        # seconds of an outer step (0: unknown), and how to move our outer-step count (None: never).
        self.link_rate_bps = link_rate_bps
        self.period_s = period_s
        self.follow = follow
        # How many times the daemon restarted its worker: a restart resumes older weights (a checkpoint),
        # whatever the outer step it resumes at says.
        self.worker_restarts = worker_restarts
        self._restarts_when_fresh = 0  # `worker_restarts()` when our weights were last the swarm's
        # Our worker's model (None before its hello): a donor's snapshot must be exactly that.
        self.model = model
        self.on_refused = on_refused  # told of a donor whose snapshot was not our model (an offence)
        self.home = home
        self.cfg = cfg
        self.own_outer_step = own_outer_step
        self.trainers = trainers  # alive trainers of our run (not us): peer id -> outer step
        self.deliver = deliver
        self.unpaired = 0  # outer steps in a row that were not averaged
        self.catch_ups = 0  # snapshots the worker adopted
        self.follows = 0  # times the count alone moved to the swarm's, without a download
        # Outer steps since the last averaged one (None: none since this daemon or its worker started, or
        # since the worker went back to an older checkpoint): how fresh our weights are.
        self.since_averaged: int | None = None
        self.status: dict[str, Any] = {"state": "idle"}
        self._wake = trio.Event()
        self._delivered = False  # a snapshot waits for the worker's next outer step
        self._next_allowed = -math.inf  # trio time before which no new attempt starts
        self._refused_at: int | None = None  # a partner's outer step when it refused us as too far behind
        self._last_own: int | None = None  # our outer step at the previous outer step (or adoption)
        self._following_back: int | None = None  # a count below ours that we asked to move to (`_follow`)

    def note_outer_step(self, had_partner: bool) -> None:
        """Called by the averager at the end of every outer step: `had_partner`, whether it was averaged.

        Our outer step lower than at the previous call, without a catch-up in between: the worker was
        restarted from an older checkpoint (a crash, `kill -9`). That is news about our own position, not
        a member record's lag, so it lifts `CATCH_UP_INTERVAL_S`: a restart within 30 s of a catch-up
        stepped solo beside its partner for the rest of those 30 s."""
        own = self.own_outer_step()
        went_back = self._last_own is not None and own < self._last_own
        # A count we asked to move back (`_follow`) is no restart: it is what we asked for.
        followed_back = went_back and self._following_back is not None and own >= self._following_back
        restarted = went_back and not followed_back
        if went_back:
            self._following_back = None
        if restarted:
            self._next_allowed = -math.inf
        self._last_own = own
        self.unpaired = 0 if had_partner else self.unpaired + 1
        if had_partner:
            self.since_averaged = 0
            self._restarts_when_fresh = self.worker_restarts()
        elif restarted or self.since_averaged is None:
            self.since_averaged = None  # weights of an older checkpoint (or never averaged): not the swarm's
        else:
            self.since_averaged += 1
        if self.cfg.catch_up_after and self.unpaired >= self.cfg.catch_up_after:
            self._wake.set()

    def behind(self, partner_step: int) -> None:
        """A partner refused us as too far behind: its outer step is `partner_step`. Catch up now, without
        waiting out `catch_up_after` more unaveraged outer steps (each a whole pairing window): a worker
        restarted after a crash resumes from a checkpoint up to `train.checkpoint_every` outer steps back
        while its partner went on, and one step beyond the gap is enough for every request to be refused.
        `plan()` still decides from the member records. The refusal is fresh evidence (the records that
        `CATCH_UP_INTERVAL_S` guards against lag a heartbeat), so it lifts that interval: a restart soon
        after a catch-up would otherwise wait it out."""
        if self.cfg.catch_up_after and partner_step - self.own_outer_step() > self.cfg.max_step_gap:
            self.unpaired = max(self.unpaired, self.cfg.catch_up_after)
            self._refused_at = partner_step
            self._next_allowed = -math.inf
            self._wake.set()

    def _others(self) -> dict[str, int]:
        """The other alive trainers that have made an outer step: peer id -> outer step. One at outer step
        0 has not trained yet (a late joiner still downloading, a worker still loading its task) and is no
        part of where the swarm is: counted, a joiner made the median of {22, 179, 0} this node's own 22,
        and a catch-up planned towards 179 was delivered at outer step 22."""
        return {peer: step for peer, step in self.trainers().items() if step > 0}

    def swarm_outer_step(self) -> int | None:
        """The upper median of the alive trainers' outer steps, ours included (None when we are alone)."""
        others = list(self._others().values())
        return statistics.median_high([self.own_outer_step(), *others]) if others else None

    def plan(self) -> tuple[int, list[str]] | None:
        """(the swarm's outer step, donors) if this node should catch up now, else None."""
        others = self._others()
        own = self.own_outer_step()
        gap = self.cfg.max_step_gap
        if not any(abs(step - own) > gap for step in others.values()):
            return None  # alone, or only partners within reach (busy or not yet connected)
        target = statistics.median_high([own, *others.values()])
        if abs(own - target) <= gap:
            return None
        near = sorted((abs(step - target), peer) for peer, step in others.items()
                      if abs(step - target) <= gap and self.may_download_from(peer))
        donors = [peer for _, peer in near[: max(1, self.cfg.join_donors)]]
        return (target, donors) if donors else None

    def weights_fresh(self) -> bool:
        """Whether our weights are the swarm's: averaged (or caught up) within the last `max(1,
        sync.max_step_gap)` outer steps, by the worker that still runs. A worker restarted since resumed a
        checkpoint: older weights even where its outer step did not go back (tests/test_diagnostics_daemons.py:
        killed a second after a catch-up, it resumed the catch-up's own checkpoint, at the same outer step,
        while the tiny swarm ran on by 9 outer steps). The averager asks too (`AveragerHooks.weights_fresh`):
        a node whose weights are not the swarm's does not count a far phi as an offence."""
        return (self.since_averaged is not None and self.since_averaged <= max(1, self.cfg.max_step_gap)
                and self.worker_restarts() == self._restarts_when_fresh)

    def follow_instead(self, target: int, donors: int) -> str | None:
        """Why to move only our outer-step count to the swarm's `target` instead of downloading `donors`
        snapshots, or None to download. All of: a way to follow; our weights are fresh (averaged within the
        last `max_step_gap` outer steps, `since_averaged`: the spread of progress the gap rule lets partners
        average across anyway, so only the count is off, behind the swarm's or ahead of it; a node whose
        count moved and that still does not average for `catch_up_after` more outer steps is past it and
        downloads); and the download is dear (its float32 bytes over our measured rate take longer than
        an outer step). Unknown rate or period: download, as before. Ahead happens too: over the slow link
        in bench/wan.py a trainer whose exchanges failed stepped solo at its compute pace while its
        partners' steps waited on their exchanges, and its count ran 5 past the swarm's in 150 s."""
        own = self.own_outer_step()
        if self.follow is None or target == own or not self.weights_fresh():
            return None
        model, rate, period = self.model(), self.link_rate_bps(), self.period_s()
        if model is None or rate is None or not rate > 0 or not period > 0:
            return None
        nbytes = SNAPSHOT_BYTES_PER_PARAM * model.numel * donors
        seconds = nbytes / rate
        if seconds <= period:
            return None  # cheap: take the swarm's weights exactly
        return (f"averaged {self.since_averaged} outer steps ago, and {donors} snapshots ({nbytes / 1e6:.1f} MB) "
                f"would take about {seconds:.0f} s at this link's {rate / 1e3:.1f} kB/s, against "
                f"{period:.1f} s per outer step")

    def adopted(self, report: Adopted) -> None:
        """The worker's answer to a delivered snapshot: count and log the catch-up (or why it failed)."""
        self._delivered = False
        if report.error:
            self.status.update(state="not adopted", error=report.error)
            log.warning("the worker did not adopt the swarm snapshot: %s", report.error)
            return
        self.catch_ups += 1
        self.unpaired = 0
        self.since_averaged = 0  # the swarm's weights now
        self._restarts_when_fresh = self.worker_restarts()
        self._last_own = report.outer_step  # a catch-up of a runaway moves back too: no restart
        self.status.update(state="done", outer_step=report.outer_step, step=report.step, error="")
        log.info(
            "caught up with the swarm from %d donors: outer step %d -> %d, inner step %d -> %d",
            len(report.donors), report.previous_outer_step, report.outer_step, report.previous_step, report.step,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            if self._delivered:
                continue
            if trio.current_time() < self._next_allowed:
                continue  # right after a catch-up the swarm's records still show our old step
            plan = self.plan()
            if plan is None:
                self._refused_at = None
                continue
            self.unpaired = 0  # a retry needs another `catch_up_after` outer steps without a partner
            reason = self.follow_instead(plan[0], len(plan[1]))
            if reason is not None:
                self._follow(plan[0], reason)
                continue
            self._next_allowed = trio.current_time() + CATCH_UP_INTERVAL_S
            await self._attempt(*plan)

    def _follow(self, target: int, reason: str) -> None:
        """Move our count to the swarm's `target` at our next outer step (`follow_instead` says why). No
        `CATCH_UP_INTERVAL_S` after it: it costs nothing, and the next refusal may need it again."""
        assert self.follow is not None
        own = self.own_outer_step()
        self._refused_at = None
        self.follows += 1
        self._following_back = target if target < own else None
        self.follow(target)
        log.info("outer step %d is %d %s the swarm's %d: following its count without a download (%s)",
                 own, abs(target - own), "behind" if target > own else "ahead of", target, reason)
        self.status = {"state": "followed the swarm's outer step without a download", "from_outer_step": own,
                       "swarm_outer_step": target, "error": ""}

    async def _attempt(self, target: int, donors: list[str]) -> None:
        model = self.model()
        if model is None:
            return  # the worker has not said what it trains: nothing to catch up yet
        own = self.own_outer_step()
        why = (f"a partner at outer step {self._refused_at} refused it as too far behind" if self._refused_at
               is not None else f"its last {self.cfg.catch_up_after} outer steps were not averaged")
        self._refused_at = None
        log.info("outer step %d is %d from the swarm's %d and %s: catching up from %d donors",
                 own, abs(own - target), target, why, len(donors))
        self.status = {"state": "downloading", "donors": donors, "from_outer_step": own, "swarm_outer_step": target}
        folder = Home(self.home).catchup
        path = folder.snapshot
        try:
            state = await fetch_swarm_snapshot(self.host, folder.partial, donors, path,
                                               model=model, timeout_s=self.cfg.join_timeout_s, status=self.status,
                                               on_refused=self.on_refused)
        except (OSError, ValueError) as e:  # a full disk, or no donor's layout to combine
            log.warning("catch-up failed: %s", e)
            state = None
        if state is None:
            self.status["state"] = "download failed: will retry"
            return
        self.status.update(state="waiting for the next outer step", snapshot_outer_step=state["outer_step"])
        self._delivered = True
        self.deliver(path, self.swarm_outer_step)


def progress_view(status: dict[str, Any]) -> ProgressStatus:
    """The JSON-friendly `join` section of status."""
    out = {k: v for k, v in status.items() if k != "progress"}
    progress = status.get("progress")
    if progress:
        out["downloads"] = {
            d: {"have_chunks": p.have, "done": p.done, "bytes": p.bytes, "error": p.error} for d, p in progress.items()
        }
    return cast("ProgressStatus", out)  # its keys follow the join's state
