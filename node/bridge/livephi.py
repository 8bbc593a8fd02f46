"""The worker's current slow weights, served to joiners straight from the shared phi slot (issue #55).

Why: a late joiner, or a trainer that drifted out of reach, needs the swarm's slow weights *now*. Served from
the newest checkpoint file only, a donor with checkpoints off (or not yet due) had nothing to give, and a
checkpoint a period old put the joiner out of `sync.max_step_gap` again. The worker keeps phi in the shared
slot (`Trainer.share_phi`), so the daemon already holds the current weights; what it needs is to know when
they are *still*: phi is written only while the worker handles a result (an outer step, an adopted snapshot)
and when a worker starts (its checkpoint copied into the slot). Hence:

- phi is *stable* once the worker has reported (`Metrics.results`) that it handled every result the daemon
  sent it in this worker's life, and stays so until the daemon sends the next one;
- a snapshot (`snapshot`) is taken only while stable: its chunk hashes are computed from the slot in a thread,
  and it holds a `LiveLease` while it is served;
- before a result goes out (`before_result`), the supervisor waits for the leases to end, at most `hold_s`
  (the worker trains on meanwhile when `train.overlap` is on: only its outer step comes later), then ends the
  version: a lease still open turns invalid, and the server, which copies each chunk out of the slot before
  it checks its lease, stops at the first chunk the worker may have changed. No model-sized copy is made:
  the chunks are read from the memory the daemon already maps.

The cost to the donor is bounded: at most `max_serving` downloads at once (protocols/snapshot.py), one hashing
pass per version however many joiners ask, and a result held at most `hold_s`; `held_s` and `cut` count it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import trio

from protocols.snapshot import Snapshot

log = logging.getLogger("starling.livephi")

HOLD_S = 10.0  # the longest a result waits for a download of the weights it will change (train.overlap on)
HOLD_NO_OVERLAP_S = 1.0  # ... with train.overlap off, where the worker idles while it waits
WAIT_S = 20.0  # the longest a joiner's request waits for the weights to be still (a result being applied)


def hold_for(overlap: bool) -> float:
    """How long a result may wait for downloads: with `train.overlap` the worker trains on meanwhile."""
    return HOLD_S if overlap else HOLD_NO_OVERLAP_S


@dataclass
class _Version:
    """One stable phi: the counters it goes with, and its snapshot once a joiner asked for it."""

    generation: int
    step: int
    outer_step: int
    snapshot: Snapshot | None = None


class LiveLease:
    """A download's hold on one version of the slot: `valid()` until the worker may change it."""

    def __init__(self, owner: LivePhi, generation: int) -> None:
        self._owner = owner
        self._generation = generation
        self._open = True

    def valid(self) -> bool:
        return self._open and self._owner.generation == self._generation

    def release(self) -> None:
        if self._open:
            self._open = False
            self._owner._release()


class LivePhi:
    """The daemon's view of the worker's phi slot as a source of snapshots (see the module docstring).

    The supervisor tells it of the worker's life (`attached`, `detached`), of its reports (`metrics`) and of
    every result before it goes out (`before_result`); the snapshot server asks it for a `snapshot`."""

    def __init__(self, *, hold_s: float = HOLD_S, wait_s: float = WAIT_S) -> None:
        self.hold_s = hold_s
        self.wait_s = wait_s
        self.generation = 0  # bumped whenever the slot may change: a lease of an older one is invalid
        self._phi: np.ndarray | None = None
        self._layout_hash = ""
        self._sent = 0  # results sent to the current worker
        self._version: _Version | None = None  # the stable phi, None while it may change
        self._readers = 0
        self._changed = trio.Event()  # set (and replaced) whenever readers end or a version begins
        self.served = 0  # leases handed out
        self.held_s = 0.0  # seconds results waited for downloads
        self.cut = 0  # downloads whose version ended before they did

    # -- the supervisor's side --

    def attached(self, phi: np.ndarray, layout_hash: str) -> None:
        """A new worker is attaching to `phi` (it is about to copy its own weights in): nothing is stable
        until it reports."""
        self._end_version()
        self._phi, self._layout_hash, self._sent = phi, layout_hash, 0

    def detached(self) -> None:
        """The worker is gone (it may have died half-way through an outer step): the slot is not served."""
        self._end_version()
        self._phi = None

    def metrics(self, results: int, step: int, outer_step: int) -> None:
        """A worker's report: `results` handled in its life, at inner step `step` and outer step `outer_step`."""
        if self._phi is None or results != self._sent or self._version is not None:
            return
        self._version = _Version(self.generation, step, outer_step)
        self._wake()

    async def before_result(self) -> None:
        """Call just before a result goes to the worker: wait (at most `hold_s`) for the downloads of the
        current weights to end, then end the version (a download still running is cut at its next chunk)."""
        self._version = None  # no new downloads of what is about to change
        if self._readers:
            began = trio.current_time()
            with trio.move_on_after(self.hold_s):
                while self._readers:
                    await self._changed.wait()
            self.held_s += trio.current_time() - began
        if self._readers:
            self.cut += self._readers
            log.info("a result waited %.0f s for %d snapshot download(s); they are cut", self.hold_s, self._readers)
        self._end_version()
        self._sent += 1

    # -- the snapshot server's side --

    async def snapshot(self) -> Snapshot | None:
        """The current weights as a leased snapshot (`Snapshot.lease`), waiting at most `wait_s` for them to
        be still; None if they were not, or if they changed while they were hashed."""
        with trio.move_on_after(self.wait_s):
            while self._version is None or self._phi is None:
                await self._changed.wait()
        version, phi = self._version, self._phi
        if version is None or phi is None:
            return None
        self._readers += 1
        lease = LiveLease(self, version.generation)
        try:
            snap = version.snapshot
            if snap is None:
                # Hashing reads the whole slot (seconds for a large model): in a thread, as a reader, so a
                # result waits for it too; a version that ended meanwhile hashed a moving target.
                snap = await trio.to_thread.run_sync(
                    Snapshot.of, phi, version.step, version.outer_step, self._layout_hash)
                if not lease.valid():
                    lease.release()
                    return None
                version.snapshot = snap
        except BaseException:
            lease.release()
            raise
        self.served += 1
        return Snapshot(snap.phi, snap.step, snap.outer_step, snap.layout_hash, snap.chunk_hashes, snap.snapshot_id,
                        lease=lease)

    # -- internals --

    def _release(self) -> None:
        self._readers -= 1
        self._wake()

    def _end_version(self) -> None:
        self._version = None
        self.generation += 1

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
