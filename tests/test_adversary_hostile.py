"""Hostile peers below the averaging layer (issue #26): donors, clocks and fake trainers.

One test (or a few) per attack, each made from the project's own modules as a real attacker would run
them: libp2p hosts from p2p/host.py, snapshot messages of protocols/snapshot.py, records signed with
node/swarm/crdt.py. The figures are in docs/reliability.md (section "Hostile peers below the averaging layer").
"""

from __future__ import annotations

import hashlib
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import multiaddr
import numpy as np
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr

from node.averaging import latejoin
from node.averaging.partner_misses import Attempt
from node.bridge.ckptfile import read_phi
from node.config.home import Home
from node.swarm import crdt
from node.swarm.crdt import Manifest, MemberRecord, SwarmState, peer_id_of, sign_record
from p2p.host import build_host
from p2p.wire import LibP2PByteStream, PlainFrameChannel, close_quietly, recv_as, send_msg
from protocols import snapshot as snap
from protocols.codec import tensor_bytes
from protocols.hlc import MAX_LEAD_S, Timestamp

LOOPBACK = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
MANIFEST = Manifest("stdlib-lm", "a" * 64, "b" * 64, 1)


def randn(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n, dtype=np.float32)


# ---------------------------------------------------------------------------------------------------
# Item 4: a hostile late-join donor fills the joiner's disk

NUMEL = snap.CHUNK_ELEMS * 2 + 1000  # the joiner's own model: 3 chunks
OURS = snap.ModelShape("L", NUMEL)
HUGE = snap.MAX_CHUNKS * snap.CHUNK_ELEMS  # 2^34 values: a 64 GiB file, the most a meta may claim


class DiskWatch:
    """The largest size (apparent and allocated) any file under `directory` reached while it was looked at."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.largest = 0
        self.allocated = 0

    def look(self) -> None:
        for path in self.directory.glob("*") if self.directory.is_dir() else ():
            try:
                st = path.stat()
            except OSError:
                continue
            self.largest = max(self.largest, st.st_size)
            self.allocated = max(self.allocated, st.st_blocks * 512)


def hostile_donor(watch: DiskWatch, *, chunks: int = 8) -> Any:
    """A donor that claims the largest model a meta may (our layout hash, 2^34 values) and sends chunks
    of zeros that match their hashes, as the attack of issue #26 did; before it lets go it looks at what
    the joiner has on disk."""
    zeros = bytes(snap.FRAME)
    digest = hashlib.sha256(zeros).digest()
    meta = snap.SnapMeta(verdict="ok", snapshot_id="f" * 32, step=10_000, outer_step=10, layout_hash="L",
                         numel=HUGE, chunk_hashes=[digest] * snap.MAX_CHUNKS)

    async def handle(stream: Any) -> None:
        control = LibP2PByteStream(stream)
        try:
            await recv_as(control, snap.SnapRequest)
            await send_msg(control, meta, max_bytes=snap.MAX_META_BYTES)
            channel = PlainFrameChannel(control, max_frame_size=snap.FRAME)
            for _ in range(chunks):
                await channel.send(zeros)
        except Exception:
            pass  # the joiner hung up on us
        await trio.sleep(0.5)  # the joiner writes what it received
        watch.look()
        await stream.reset()

    return handle


async def serve(stack: AsyncExitStack, handlers: list[Any]) -> tuple[Any, list[str]]:
    """A joiner host connected to one donor host per handler; returns the joiner and the donors' ids."""
    joiner = build_host(create_new_key_pair())
    await stack.enter_async_context(joiner.run(LOOPBACK))
    ids = []
    for handler in handlers:
        donor = build_host(create_new_key_pair())
        await stack.enter_async_context(donor.run(LOOPBACK))
        donor.set_stream_handler(snap.PROTOCOL_ID, handler)
        await joiner.connect(info_from_p2p_addr(donor.get_addrs()[0]))
        ids.append(str(donor.get_id()))
    return joiner, ids


async def test_a_donor_claiming_a_larger_model_makes_the_joiner_write_nothing_beyond_its_own_size(
    tmp_path: Path,
) -> None:
    """Before, the joiner sized its file from the donor's meta: numel = 2^34 made a 64 GiB sparse file,
    and every hashed chunk of zeros was written into it. Now the meta is checked against the joiner's own
    model before a byte is allocated; the hostile donor (and one of another layout) is refused, and the
    joiner starts from the two honest donors."""
    a, b = randn(NUMEL, 1), randn(NUMEL, 2)
    watch = DiskWatch(Home(tmp_path).join.partial)
    other_layout = snap.Snapshot.of(randn(NUMEL, 3), 100, 10, "X")
    handlers = [snap.SnapshotServer(lambda: snap.Snapshot.of(a, 100, 10, "L")).handle,
                snap.SnapshotServer(lambda: snap.Snapshot.of(b, 120, 12, "L")).handle,
                hostile_donor(watch),
                snap.SnapshotServer(lambda: other_layout).handle]
    status: dict[str, Any] = {}
    offences: list[str] = []
    async with AsyncExitStack() as stack:
        joiner, ids = await serve(stack, handlers)
        with trio.fail_after(60):
            joined = await latejoin.late_join(joiner, tmp_path, lambda: ids, model=OURS, max_donors=4, wait_s=1,
                                              timeout_s=20, status=status, on_refused=offences.append)
    assert watch.largest <= NUMEL * 4 and watch.allocated <= NUMEL * 4 + (1 << 20), vars(watch)
    assert joined and status["state"] == "done"
    assert sorted(status["donors"]) == sorted(ids[:2])
    assert sorted(status["refused"]) == sorted(offences) == sorted(ids[2:])  # each refusal is an offence
    state = read_phi(Home(tmp_path).join.snapshot)
    assert np.array_equal(np.asarray(state.phi), (a + b) / 2) and state.layout_hash == "L"


async def test_a_join_whose_only_donor_lies_about_the_model_starts_a_fresh_model_and_writes_nothing(
    tmp_path: Path,
) -> None:
    watch = DiskWatch(Home(tmp_path).join.partial)
    status: dict[str, Any] = {}
    async with AsyncExitStack() as stack:
        joiner, ids = await serve(stack, [hostile_donor(watch)])
        with trio.fail_after(60):
            joined = await latejoin.late_join(joiner, tmp_path, lambda: ids, model=OURS, max_donors=3, wait_s=1,
                                              timeout_s=20, status=status)
    assert not joined and "fresh model" in status["state"] and status["refused"] == ids
    assert watch.largest == 0 and not Home(tmp_path).join.snapshot.exists()
    assert not any(Home(tmp_path).join.partial.glob("*.bin"))


async def test_a_late_join_whose_donor_stops_mid_download_looks_again_and_starts_from_another(
    tmp_path: Path,
) -> None:
    """Issue #55: donors are trainers, and one can stop mid-download. Before, the join then started a fresh
    model at once (seen in `bench/chaos.py --wipe`: a wiped node trained alone for 280 outer steps)."""
    b = randn(NUMEL, 2)
    dying = snap.Snapshot.of(randn(NUMEL, 1), 100, 10, "L")

    async def stops_after_one_chunk(stream: Any) -> None:
        control = LibP2PByteStream(stream)
        await recv_as(control, snap.SnapRequest)
        await send_msg(control, dying.meta(), max_bytes=snap.MAX_META_BYTES)
        await PlainFrameChannel(control, max_frame_size=snap.FRAME).send(tensor_bytes(dying.phi)[: snap.FRAME])
        await stream.close()

    status: dict[str, Any] = {}
    async with AsyncExitStack() as stack:
        joiner, ids = await serve(stack, [stops_after_one_chunk,
                                          snap.SnapshotServer(lambda: snap.Snapshot.of(b, 120, 12, "L")).handle])
        # The first look finds the donor that stops; the second, the one left.
        with trio.fail_after(60):
            joined = await latejoin.late_join(
                joiner, tmp_path, lambda: ids[:1] if "attempt" not in status else ids[1:], model=OURS,
                max_donors=3, wait_s=1, timeout_s=20, status=status)
    assert joined and status["state"] == "done" and status["attempt"] == 2 and status["donors"] == ids[1:]
    assert np.array_equal(np.asarray(read_phi(Home(tmp_path).join.snapshot).phi), b)


async def test_a_resumed_download_of_another_model_is_not_resumed(tmp_path: Path) -> None:
    """A progress file an earlier version saved from a lying donor (numel 2^34) is dropped, not resumed:
    its file would be sized from it again."""
    directory = tmp_path / "dl"
    directory.mkdir()
    earlier = snap.JoinDownload(directory, snap.ModelShape("L", HUGE))
    earlier._save(snap.DonorProgress("donor", meta={"snapshot_id": "f" * 32, "layout_hash": "L", "numel": HUGE,
                                                    "step": 1, "outer_step": 1, "chunk_hashes": []}, have=3))
    assert snap.JoinDownload(directory, OURS)._load("donor").meta is None


def test_late_join_donors_are_the_members_whose_record_carries_our_manifest() -> None:
    """Donors were chosen without a manifest check: any member that claimed the trainer role and an outer
    step was asked for a snapshot. Now only members whose signed record carries our run's manifest are
    (node/averaging/latejoin.py, `choose_donors`); with no run known, none is."""
    from node.averaging.latejoin import choose_donors

    view = SwarmState(create_new_key_pair())
    ours, foreign, unloaded, fresh = (SwarmState(create_new_key_pair()) for _ in range(4))
    view.merge(ours.update_self(role="trainer", manifest_hash=MANIFEST.hash, outer_step=5))
    view.merge(foreign.update_self(role="trainer", manifest_hash="f" * 64, outer_step=5))
    view.merge(unloaded.update_self(role="trainer", outer_step=5))
    view.merge(fresh.update_self(role="trainer", manifest_hash=MANIFEST.hash, outer_step=0))  # nothing to give
    members = [(m.state, m.record) for m in view.members()]
    anyone = lambda peer, reachability: True  # noqa: E731
    assert [r.peer_id for r in choose_donors(members, view.peer_id, MANIFEST.hash, 5, anyone)] == [ours.peer_id]
    assert choose_donors(members, ours.peer_id, MANIFEST.hash, 5, anyone) == []  # never itself
    assert choose_donors(members, view.peer_id, None, 5, anyone) == []


def test_late_join_donors_are_dialable_from_the_addresses_their_records_carry(tmp_path: Path) -> None:
    """A joiner picks its donors a second after it met the bootstrap node, before the connection manager has
    dialled any of them: every download failed with "no known addresses" and a fresh identity joining a
    churned swarm started a fresh model (bench/chaos.py check (f)). The donors' own signed records carry
    their addresses: the join's choice puts them where a download's dial finds them."""
    from libp2p.peer.id import ID
    from libp2p.peer.peerstore import PeerStoreError

    from node.config.load import load_config
    from node.daemon import Daemon

    # gossip membership: the records injected below are alive by their age (with swim, SWIM's probes decide)
    cfg = load_config(tmp_path, overrides={"node.listen": ["/ip4/127.0.0.1/tcp/0"], "node.membership": "gossip"},
                      environ={})
    daemon = Daemon(cfg, tmp_path, create_new_key_pair(), train=True)
    daemon.replicator.state.merge(SwarmState(create_new_key_pair()).set_manifest(MANIFEST) or b"")
    donor = SwarmState(create_new_key_pair())
    addr = "/ip4/127.0.0.1/tcp/4242"
    daemon.replicator.state.merge(donor.update_self(role="trainer", manifest_hash=MANIFEST.hash, outer_step=5,
                                                    addrs=[addr, "not an address"]))

    def known() -> list[str]:  # what a dial of the donor would try
        try:
            return [str(a) for a in daemon.host.get_peerstore().addrs(ID.from_base58(donor.peer_id))]
        except PeerStoreError:  # py-libp2p's "no such peer"
            return []

    assert known() == []
    assert daemon._join_donors() == [donor.peer_id]
    assert known() == [addr]


def test_late_join_donors_leave_out_trainers_that_say_they_sit_behind_a_nat(tmp_path: Path) -> None:
    """A joiner behind a hostile NAT took a trainer behind another NAT as a donor: the download dialled its
    addresses for 27 s before it failed, while the joiner did not train (tests/test_nat_swarm_lab.py). Such
    a donor is reachable only through a relay, and bulk never crosses one unless `sync.allow_relay_bulk`."""
    from node.config.load import load_config
    from node.daemon import Daemon

    def joiner(**overrides: object) -> tuple[Daemon, dict[str, str]]:
        cfg = load_config(tmp_path, overrides={"node.listen": ["/ip4/127.0.0.1/tcp/0"],
                                               "node.membership": "gossip", **overrides}, environ={})
        daemon = Daemon(cfg, tmp_path, create_new_key_pair(), train=True)
        daemon.replicator.state.merge(SwarmState(create_new_key_pair()).set_manifest(MANIFEST) or b"")
        ids = {}
        for reachability in ("public", "unknown", "private", "relayed"):
            member = SwarmState(create_new_key_pair())
            daemon.replicator.state.merge(member.update_self(role="trainer", manifest_hash=MANIFEST.hash,
                                                             outer_step=5, reachability=reachability))
            ids[reachability] = member.peer_id
        return daemon, ids

    daemon, ids = joiner()
    assert sorted(daemon._join_donors()) == sorted([ids["public"], ids["unknown"]])
    assert daemon._may_download_from(ids["public"]) and not daemon._may_download_from(ids["private"])
    daemon, ids = joiner(**{"sync.allow_relay_bulk": True})
    assert sorted(daemon._join_donors()) == sorted(ids.values())


async def test_the_start_up_check_describes_the_model_exactly_as_the_worker_will(tmp_path: Path) -> None:
    """The late join's donors are checked against what the start-up check says of our model: it must be
    what the worker's hello will say, or every honest donor would be refused."""
    import torch

    from node.bridge.supervisor import check_task
    from node.config.train import TrainConfig
    from node.worker.trainer import Trainer

    cfg = TrainConfig(d_model=32, n_layers=1, n_heads=2, seq_len=32, batch_size=4, data_bytes=100_000,
                      eval_batches=1)
    checked = await check_task(cfg, "peer", describe=True, timeout=120)
    torch.set_num_threads(1)
    trainer = Trainer(cfg, tmp_path, "peer")
    assert checked is not None
    assert (checked.name, checked.model_hash, checked.layout_hash, checked.numel) == (
        trainer.task.name, trainer.model_hash, trainer.layout_hash, trainer.numel)
    plain = await check_task(cfg, "peer", timeout=120)
    assert plain is not None and plain.name == trainer.task.name and plain.numel == 0


# ---------------------------------------------------------------------------------------------------
# Item 6: a record dated just inside the skew limit dragged the victim's clock with it

T0 = 1_700_000_000.0


def test_a_record_599_s_ahead_moves_the_victims_clock_no_more_than_the_bound() -> None:
    """Before, a record dated 599.9 s ahead (inside the 600 s skew limit) was accepted and its HLC adopted:
    the victim's own records then carried +599.9 s, and a node whose clock ran 1 s behind refused every
    one of them as skewed (and saw a healthy node as gone after 61 s). Now the record is kept, but the
    victim's clock moves at most MAX_LEAD_S past its own time."""
    now = [T0]
    victim = SwarmState(create_new_key_pair(), clock=lambda: now[0])
    behind = SwarmState(create_new_key_pair(), clock=lambda: now[0] - 1.0)  # an honest clock 1 s slow
    attacker = create_new_key_pair()
    future = sign_record(MemberRecord(peer_id_of(attacker.public_key), Timestamp(int((T0 + 599.9) * 1000), 0)),
                         attacker)
    assert victim.merge(future) is True  # inside the skew limit: the record is kept
    assert victim.member(peer_id_of(attacker.public_key)) is not None and victim.clock_capped == 1
    own = victim.update_self(role="trainer")
    assert own.record.hlc.wall_ms <= int((T0 + MAX_LEAD_S) * 1000)
    assert behind.merge(own) is True and behind.rejected[crdt.CLOCK_SKEW] == 0
    now[0] += 30  # the victim's next heartbeat, too
    assert behind.merge(victim.update_self()) is True and behind.rejected[crdt.CLOCK_SKEW] == 0


def test_a_remote_record_a_little_ahead_is_still_followed() -> None:
    """Within the bound the clock is an HLC as before: our next timestamp sorts after what we saw."""
    now = [T0]
    victim = SwarmState(create_new_key_pair(), clock=lambda: now[0])
    peer = create_new_key_pair()
    ahead = Timestamp(int((T0 + MAX_LEAD_S / 2) * 1000), 7)
    assert victim.merge(sign_record(MemberRecord(peer_id_of(peer.public_key), ahead), peer)) is True
    assert victim.update_self().record.hlc > ahead and victim.clock_capped == 0


# ---------------------------------------------------------------------------------------------------
# Item 3: a fake trainer (a member record, no averaging) stalls real ones; a ban did not end it


async def test_a_fake_trainer_stops_costing_the_pairing_window_once_it_missed_its_bound() -> None:
    """Before, a record claiming the trainer role and our manifest, from a host with no averaging handler,
    counted as a possible partner for good, so every outer step waited out the whole window for it (95 ->
    2.5 inner steps/s). Now it misses MISS_LIMIT rounds and sits out: the next outer step is solo at once."""
    import torch

    from node.averaging.partner_misses import MISS_LIMIT
    from node.bridge.exchange import ExchangeRequest

    window = 1.0
    n = 1000
    async with AsyncExitStack() as stack:
        honest, fake = build_host(create_new_key_pair()), build_host(create_new_key_pair())
        for h in (honest, fake):
            await stack.enter_async_context(h.run(LOOPBACK))
        averager, nursery = await _victim_of(stack, honest, fake, window)  # fake: a host that never averages
        fake_id = str(fake.get_id())
        took = []
        for step in range(MISS_LIMIT + 2):
            request = ExchangeRequest(step, torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n),
                                      [("w", (n,))], "L", inner_steps=5, samples=20)
            began = trio.current_time()
            with trio.fail_after(30):
                assert (await averager.exchange(request)).group_size == 1
            took.append(trio.current_time() - began)
        nursery.cancel_scope.cancel()
    assert all(t >= window * 0.9 for t in took[:MISS_LIMIT]), took  # it is given the window MISS_LIMIT times
    assert all(t < 0.1 for t in took[MISS_LIMIT:]), took  # then solo at once
    assert averager.sits_out(fake_id) and averager.status()["unpaired_rounds"] == 2


@pytest.mark.parametrize("wire", ["1.3.0", "1.2.0"], ids=["coded", "words-only"])
@pytest.mark.parametrize("fake_asks_first", [True, False], ids=["fake-has-the-smaller-id", "victim-has-the-smaller-id"])
async def test_a_fake_trainer_that_answers_not_ready_to_everything_sits_out_after_its_bound(
    fake_asks_first: bool, wire: str
) -> None:
    """Before, a fake with an averaging handler that answers "not ready" to every request (as an honest
    trainer between outer steps does) was never a miss, so it counted as a possible partner for good and
    every outer step waited out the whole window for it. An honest partner that says "not ready" asks us
    when it publishes (the schedule pairs it with us too); this one never does, so after NOT_READY_GRACE
    rounds its "not ready" counts as a miss and after MISS_LIMIT misses it sits out: solo at once. Both
    sides of the schedule: the victim asks the fake itself, or waits for it to ask and asks once at the end
    of the scheduled phase.

    "Not ready" is its code (protocols/avg.py, `AnswerCode`): a 1.3.0 fake whose words say something else
    is not ready all the same (the asker used to read the words, and took this one for a busy partner, a
    miss at once); a 1.2.0 fake, which serves only the old protocol id and sends only the words, is read
    by its words, as 1.2.0 nodes were."""
    import torch

    from node.averaging.partner_misses import MISS_LIMIT, NOT_READY_GRACE
    from node.bridge.exchange import ExchangeRequest
    from protocols import avg

    window = 1.0
    n = 1000
    asked = [0]

    async def never_ready(stream: Any) -> None:  # what a trainer between outer steps answers, every time
        try:
            request = await avg.read_request(stream, 5.0)
            asked[0] += 1
            if wire == "1.3.0":
                await avg.answer(stream, avg.AnswerCode.NOT_READY, "training, come back later", request.outer_step,
                                 since_publish_ms=1, paired=True)
            else:
                await avg.answer(stream, avg.AnswerCode.NOT_READY, "not ready (training between outer steps)",
                                 request.outer_step, since_publish_ms=1, paired=True, coded=False)
        finally:
            await close_quietly(stream)

    keys = [create_new_key_pair(), create_new_key_pair()]
    keys.sort(key=lambda k: peer_id_of(k.public_key), reverse=not fake_asks_first)  # the smaller PeerID asks
    async with AsyncExitStack() as stack:
        fake, honest = build_host(keys[0]), build_host(keys[1])
        for h in (honest, fake):
            await stack.enter_async_context(h.run(LOOPBACK))
        assert (str(fake.get_id()) < str(honest.get_id())) == fake_asks_first
        fake.set_stream_handler(avg.PROTOCOL_ID if wire == "1.3.0" else avg.PROTOCOL_ID_1_2, never_ready)
        averager, nursery = await _victim_of(stack, honest, fake, window)
        fake_id = str(fake.get_id())
        bound = NOT_READY_GRACE + MISS_LIMIT
        took = []
        for step in range(bound + 2):
            request = ExchangeRequest(step, torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n),
                                      [("w", (n,))], "L", inner_steps=5, samples=20)
            began = trio.current_time()
            with trio.fail_after(30):
                assert (await averager.exchange(request)).group_size == 1
            took.append(trio.current_time() - began)
        nursery.cancel_scope.cancel()
    assert asked[0] >= bound  # it was asked, and said "not ready", in every round it was given
    assert all(t >= window * 0.9 for t in took[:bound]), took  # it is given the window `bound` times
    assert all(t < 0.1 for t in took[bound:]), took  # then solo at once
    assert averager.sits_out(fake_id) and averager.status()["unpaired_rounds"] == 2
    assert averager.status()["sitting_out"]["peers"].keys() == {fake_id}


def test_a_scheduled_partner_that_says_not_ready_but_asks_us_between_our_rounds_never_sits_out() -> None:
    """The honest side of the bound: a partner out of phase with us (or much slower) says "not ready" in
    every one of our rounds, yet it asks us when it publishes (the schedule pairs it with us too), and that
    request clears its count however long the streak; "not ready" outside the schedule never counts."""
    from node.averaging.partner_misses import MISS_LIMIT, NOT_READY_GRACE, PartnerMisses

    now = [0.0]
    misses = PartnerMisses(clock=lambda: now[0])
    for _ in range(10 * (NOT_READY_GRACE + MISS_LIMIT)):
        for _ in range(NOT_READY_GRACE + MISS_LIMIT - 1):  # our rounds between two of its publishes
            misses.begin_round()
            misses.note("slow", Attempt.NOT_READY, scheduled=True)
            misses.end_round("slow")
            misses.begin_round()
            misses.note("other", Attempt.NOT_READY)  # asked in the open phase only
            misses.end_round(None)
        misses.heard("slow")  # it published and asked us (we answered "not ready": no refusal)
        now[0] += 1.0
    assert not misses.sits_out("slow") and not misses.sits_out("other")
    assert misses.status()["exclusions"] == 0
    for _ in range(NOT_READY_GRACE + MISS_LIMIT):  # the same partner, never asking: the bound
        misses.begin_round()
        misses.note("slow", Attempt.NOT_READY, scheduled=True)
        misses.end_round("slow")
    assert misses.sits_out("slow")


async def test_a_banned_trainer_is_not_a_possible_partner(tmp_path: Path) -> None:
    """Before, a partner banned for poisoned updates still counted as a possible partner, and the victim
    stayed at the pairing window's pace."""
    from node.config.load import load_config
    from node.daemon import Daemon

    # gossip membership: the records injected below are alive by their age (with swim, SWIM's probes decide)
    cfg = load_config(tmp_path, overrides={"node.listen": ["/ip4/127.0.0.1/tcp/0"], "node.membership": "gossip"},
                      environ={})
    daemon = Daemon(cfg, tmp_path, create_new_key_pair(), train=True)
    assert daemon.averager is not None
    founder = SwarmState(create_new_key_pair())
    daemon.replicator.state.merge(founder.set_manifest(MANIFEST) or b"")
    poisoner = SwarmState(create_new_key_pair())
    daemon.replicator.state.merge(poisoner.update_self(role="trainer", manifest_hash=MANIFEST.hash, outer_step=5))
    daemon.partners.path_of = lambda peer: "direct"  # the policy's path seam: every member direct
    assert [m.peer_id for m in daemon.partners.possible()] == [poisoner.peer_id]
    for _ in range(cfg.sync.ban_after):
        daemon.averager.note_offence(poisoner.peer_id, "delta_too_large")
    assert daemon.averager.status()["banned"] == [poisoner.peer_id]
    assert daemon.partners.possible() == [] and daemon.partners.eligible() == []


async def test_the_daemons_status_view_and_metrics_show_a_capped_clock_and_a_fake_trainer_sitting_out(
    tmp_path: Path,
) -> None:
    """Both defences leave a trace an operator can see: the record whose clock was not followed is counted in
    `swarm_totals.clock_capped` and `refusals.clocks_capped` (the `refused:` line), the fake trainer that
    missed its rounds is in `sync.sitting_out` (the `sitting out:` line), and both reach the metrics."""
    import time

    from node.averaging.partner_misses import MISS_BACKOFF_S, MISS_LIMIT
    from node.config.load import load_config
    from node.daemon import Daemon
    from node.ops.metrics import Metrics
    from node.ops.status_view import render_status, short
    from tests.test_metrics import samples_of, value

    cfg = load_config(tmp_path, overrides={"node.listen": ["/ip4/127.0.0.1/tcp/0"]}, environ={})
    daemon = Daemon(cfg, tmp_path, create_new_key_pair(), train=True)
    assert daemon.averager is not None
    attacker = create_new_key_pair()
    ahead = Timestamp(int((time.time() + 599.9) * 1000), 0)
    assert daemon.replicator.state.merge(sign_record(MemberRecord(peer_id_of(attacker.public_key), ahead), attacker))
    fake = peer_id_of(create_new_key_pair().public_key)
    for _ in range(MISS_LIMIT):
        daemon.averager.misses.begin_round()
        daemon.averager.misses.note(fake, Attempt.FAILED)
        daemon.averager.misses.end_round(None)

    st = daemon.status()
    assert st["swarm_totals"]["clock_capped"] == st["refusals"]["clocks_capped"] == 1
    sitting_out = st["sync"]["sitting_out"]
    assert sitting_out["count"] == sitting_out["exclusions"] == 1
    assert list(sitting_out["peers"]) == [fake] and 0 < sitting_out["peers"][fake] <= MISS_BACKOFF_S
    lines = render_status(st).splitlines()
    assert "refused: 1 record's clock not followed (over 5 s ahead)" in lines
    assert any(x.startswith(f"sitting out: 1 partner after missed averaging rounds (seconds left): {short(fake)} ")
               for x in lines), lines
    metrics = Metrics()
    metrics.update_from_status(st)
    s = samples_of(metrics.render()[0].decode())
    assert value(s, "starling_refusals_total", kind="clocks_capped") == 1
    assert value(s, "starling_swarm_clock_capped_total") == 1
    assert value(s, "starling_sync_partners_sitting_out") == 1


def test_a_peer_that_missed_sits_out_for_a_back_off_then_gets_one_try_and_a_success_clears_it() -> None:
    from node.averaging.partner_misses import PartnerMisses

    now = [0.0]
    misses = PartnerMisses(limit=3, backoff_s=30.0, clock=lambda: now[0])

    def round_(outcome: Attempt | None, scheduled: str | None = None) -> None:
        misses.begin_round()
        if outcome is not None:
            misses.note("p", outcome)
        misses.end_round(scheduled)

    # "Not ready" (a phase question) is no miss, nor "busy" outside the schedule (busy with its own partner).
    for outcome in (Attempt.FAILED, Attempt.BUSY, Attempt.NOT_READY, Attempt.REFUSED):
        assert not misses.sits_out("p")
        round_(outcome)
    assert not misses.sits_out("p")
    misses.begin_round()
    misses.note("p", Attempt.BUSY, scheduled=True)  # the partner the schedule gave us: it should be waiting for us
    misses.end_round(None)
    assert misses.sits_out("p")
    now[0] = 31.0
    assert not misses.sits_out("p")  # one try after the back-off ...
    round_(None, scheduled="p")  # ... a scheduled partner that never showed up is a miss
    assert misses.sits_out("p") and not misses.sits_out("q")
    now[0] = 31.0 + 61.0  # the back-off doubled
    assert not misses.sits_out("p")
    round_(Attempt.PAIRED)
    round_(Attempt.FAILED)
    round_(Attempt.FAILED)
    assert not misses.sits_out("p")  # a success cleared its count


def test_status_counts_the_peers_sitting_out_and_names_the_longest_back_offs_first() -> None:
    """`sync.sitting_out` (node/averaging/partner_misses.py): how many sit out now, each named one's seconds left, the
    exclusions so far; a Sybil crowd of fakes is counted whole but only `shown` of them are named."""
    from node.averaging.partner_misses import PartnerMisses
    from node.status_schema import SittingOutStatus
    from tests.test_status_schema import schema_errors

    now = [0.0]
    misses = PartnerMisses(limit=1, backoff_s=30.0, clock=lambda: now[0])
    assert misses.status() == {"count": 0, "exclusions": 0, "peers": {}}
    for peer in ("a", "b", "c"):
        misses.begin_round()
        misses.note(peer, Attempt.FAILED)
        misses.end_round(None)
        now[0] += 5.0  # a sits out until 30, b until 35, c until 40
    misses.begin_round()
    misses.note("c", Attempt.PAIRED)  # c took part after all: cleared
    misses.end_round(None)
    st = misses.status()
    assert schema_errors(st, SittingOutStatus) == []
    assert st == {"count": 2, "exclusions": 3, "peers": {"b": 20.0, "a": 15.0}}
    assert misses.status(shown=1) == {"count": 2, "exclusions": 3, "peers": {"b": 20.0}}
    now[0] = 32.0
    assert misses.status() == {"count": 1, "exclusions": 3, "peers": {"b": 3.0}}
    now[0] = 36.0
    assert misses.status() == {"count": 0, "exclusions": 3, "peers": {}}


async def _victim_of(stack: AsyncExitStack, honest: Any, fake: Any, window: float) -> tuple[Any, trio.Nursery]:
    """An honest averager on `honest`, connected to `fake`, whose only possible partner is the fake until it
    sits out (as the daemon's `Partners.possible` filters its member records); running in a nursery of
    `stack` (returned, to cancel)."""
    from node.averaging.averager import Averager
    from node.config.sync import SyncConfig
    from starling_testing.averaging import FakeSwarm

    await honest.connect(info_from_p2p_addr(fake.get_addrs()[0]))
    fake_id = str(fake.get_id())
    averager: Averager | None = None

    def possible() -> list[str]:
        return [p for p in [fake_id] if averager is None or not averager.sits_out(p)]

    averager = Averager(honest, SyncConfig(pair_window_s=window, datapath=False),
                        FakeSwarm(honest, manifest="m", partners=possible, others=lambda: bool(possible())))
    nursery = await stack.enter_async_context(trio.open_nursery())
    await nursery.start(averager.run)
    return averager, nursery
