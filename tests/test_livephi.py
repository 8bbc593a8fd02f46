"""The worker's current slow weights as a snapshot source (node/bridge/livephi.py, issue #55): served only while
the worker cannot change them, never past a result that changes them, with the cost to the donor bounded."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from node.bridge.livephi import LivePhi
from protocols.snapshot import CHUNK_ELEMS, Snapshot

NUMEL = CHUNK_ELEMS * 2 + 5


def slot() -> np.ndarray:
    return np.random.default_rng(0).standard_normal(NUMEL, dtype=np.float32)


async def leased(**options: float) -> tuple[LivePhi, Snapshot]:
    """A LivePhi over a slot whose worker has reported it still, and one leased snapshot of it."""
    live = LivePhi(**options)
    live.attached(slot(), "L")
    live.metrics(0, step=1, outer_step=1)
    snap = await live.snapshot()
    assert snap is not None and snap.lease is not None
    return live, snap


async def test_nothing_is_served_until_the_worker_reports_every_sent_result_handled() -> None:
    live, phi = LivePhi(wait_s=0.2), slot()
    live.attached(phi, "L")
    assert await live.snapshot() is None  # a fresh worker copies its weights in before its first report
    live.metrics(0, step=40, outer_step=4)
    snap = await live.snapshot()
    assert snap is not None and snap.lease is not None
    assert (snap.step, snap.outer_step, snap.layout_hash) == (40, 4, "L")
    assert np.array_equal(snap.phi, phi) and snap.chunk_hashes == Snapshot.of(phi.copy(), 40, 4, "L").chunk_hashes
    assert np.shares_memory(snap.phi, phi)  # served from the slot itself: no model-sized copy for joiners
    snap.lease.release()
    await live.before_result()  # a result goes out: the worker may change phi from now on
    phi += 1
    live.metrics(0, step=45, outer_step=4)  # a report sent before the worker had the result says nothing
    assert await live.snapshot() is None
    live.metrics(1, step=50, outer_step=5)
    again = await live.snapshot()
    assert again is not None and again.outer_step == 5 and again.snapshot_id != snap.snapshot_id
    assert np.array_equal(again.phi, phi)


async def test_a_request_waits_for_the_weights_to_be_still_instead_of_failing() -> None:
    live, phi = LivePhi(wait_s=10), slot()
    live.attached(phi, "L")
    got: list[Snapshot | None] = []

    async def joiner() -> None:
        got.append(await live.snapshot())

    async with trio.open_nursery() as n:
        n.start_soon(joiner)
        await trio.sleep(0.3)
        assert not got
        live.metrics(0, step=1, outer_step=1)
    assert got[0] is not None and got[0].outer_step == 1


async def test_one_version_is_hashed_once_however_many_joiners_ask() -> None:
    live, a = await leased()
    b = await live.snapshot()
    assert b is not None and a.chunk_hashes is b.chunk_hashes and live.served == 2


async def test_a_result_waits_for_a_download_of_the_weights_it_changes_then_goes_out() -> None:
    live, snap = await leased(hold_s=10)
    assert snap.lease is not None
    sent_at: list[float] = []

    async def result() -> None:
        await live.before_result()
        sent_at.append(trio.current_time())

    async with trio.open_nursery() as n:
        n.start_soon(result)
        await trio.sleep(0.5)
        assert not sent_at and snap.lease.valid()  # held: the download reads memory the result would change
        released = trio.current_time()
        snap.lease.release()
    assert sent_at and sent_at[0] - released < 0.1
    assert live.held_s >= 0.5 and live.cut == 0


async def test_a_download_slower_than_the_hold_is_cut_and_the_result_goes_out_anyway() -> None:
    live, snap = await leased(hold_s=0.3)
    assert snap.lease is not None
    with trio.fail_after(2):
        await live.before_result()
    assert not snap.lease.valid() and live.cut == 1
    snap.lease.release()
    snap.lease.release()  # idempotent: a second release does not free another reader's place
    assert live._readers == 0


@pytest.mark.parametrize("event", ["attached", "detached"])
async def test_a_worker_that_starts_or_ends_invalidates_every_lease(event: str) -> None:
    live, snap = await leased(wait_s=0.2)
    assert snap.lease is not None
    if event == "attached":
        live.attached(slot(), "L")  # a restarted worker copies its checkpoint into the slot
    else:
        live.detached()  # a worker that died may have left an outer step half-applied
    assert not snap.lease.valid()
    assert await live.snapshot() is None
