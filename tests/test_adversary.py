"""Hostile peers against the swarm's authority and its limits, made from the project's own modules.

One test (or a few) per attack of issue #13: a forged run manifest, a Sybil fill of the member table,
concurrent snapshot requests, world-readable checkpoints; and the per-subnet limits on connections and
on protocol streams. Each attacker is what a real one would run: its own key pairs, records signed with
node/swarm/crdt.py, sessions of protocols/state.py, libp2p hosts from p2p/host.py. The figures these tests
measure are recorded in docs/reliability.md (section "Authority and Sybil limits"). The hostile averaging
partners (phi, Delta) are in tests/test_adversary_avg.py.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterable, Mapping
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import multiaddr
import pytest
import torch
import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr

from node.config.home import Home
from node.swarm import crdt
from node.swarm.crdt import (
    ApplyResult,
    Delivery,
    Manifest,
    ManifestRecord,
    MemberRecord,
    SwarmState,
    peer_id_of,
    sign_record,
)
from node.swarm.manifest_trust import ManifestAuthority, read_manifest_pin, write_manifest_pin
from node.swarm.replicator import DeliveredReplica, ReplicationTiming, StateReplicator
from node.worker.checkpoint import CheckpointStore
from p2p.connmgr import PRUNE_GRACE_S, ConnManager
from p2p.fsutil import tighten_private_folders
from p2p.host import build_host
from p2p.netgroup import SubnetStreamLimits, group_of
from p2p.wire import LibP2PByteStream, TrioByteStream, recv_as, send_msg
from protocols import snapshot as snap
from protocols import state as protocol
from protocols.hlc import Timestamp
from protocols.state import LocalInfo
from starling_testing.fakes import FakeHost
from starling_testing.hosts import connected_pair

SWARM = "adversary"
MANIFEST = Manifest("stdlib-lm", "a" * 64, "b" * 64, 1)
LOOPBACK = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
ATTACKER_GROUP = group_of("203.0.113.9")  # TEST-NET-3: the attacker's one machine
NEWCOMER_GROUP = group_of("198.51.100.7")  # TEST-NET-2: an honest newcomer elsewhere


async def eventually(predicate: Callable[[], bool], what: str, *, timeout: float = 20.0) -> None:
    """Wait until ``predicate()`` holds (a hang guard, not a timed assertion)."""
    with trio.move_on_after(timeout):
        while not predicate():
            await trio.sleep(0.05)
        return
    pytest.fail(f"not within {timeout:.0f}s: {what}")


class Offer:
    """A rogue replica for one state session: offers fixed records (and says it holds them, so that a
    2.0.0 session's bucket hashes show the difference), takes nothing."""

    def __init__(self, records: Iterable[bytes]) -> None:
        self.records = list(records)

    def digest(self) -> Mapping[str, tuple[int, ...]]:
        signed = [crdt.Verifier().decode(r) for r in self.records]
        return {s.key: s.order for s in signed}

    def missing_for(self, their_digest: Mapping[str, tuple[int, ...]]) -> list[bytes]:
        return list(self.records)

    def apply(self, records: Iterable[bytes]) -> ApplyResult:
        return ApplyResult(unchanged=len(list(records)))


async def one_session(attacker: Any, victim: Any, attacker_info: LocalInfo, victim_info: LocalInfo) -> None:
    """One /starling/state session over an in-memory stream, the attacker initiating."""
    a, b = trio.testing.memory_stream_pair()

    async def side(fn: Any, stream: Any, replica: Any, local: LocalInfo) -> None:
        try:
            await fn(TrioByteStream(stream), replica, local, max_records=4096)
        finally:
            await stream.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(side, protocol.initiate, a, attacker, attacker_info)
        nursery.start_soon(side, protocol.respond, b, victim, victim_info)


def info(manifest_hash: str = "") -> LocalInfo:
    return LocalInfo("0.1.0", SWARM, manifest_hash)


def forged_manifest(key: KeyPair, *, model_hash: str = "f" * 64) -> bytes:
    """The hijack of issue #13: another run's manifest signed by a fresh key at HLC (0, 0), which the old
    lowest-HLC-wins rule preferred to every real founder's."""
    record = ManifestRecord(peer_id_of(key.public_key), Timestamp(0, 0), MANIFEST.task, model_hash, "b" * 64, 1)
    return sign_record(record, key).data


def member_record(key: KeyPair, now: float) -> bytes:
    record = MemberRecord(peer_id_of(key.public_key), Timestamp(int(now * 1000), 0), role="trainer",
                          heartbeat=now, addrs=("/ip4/203.0.113.9/tcp/4001",))
    return sign_record(record, key).data


# ---------------------------------------------------------------------------------------------------
# Manifest forgery


@dataclasses.dataclass
class Node:
    name: str
    host: Any
    state: SwarmState
    rep: StateReplicator


async def start_node(nursery: trio.Nursery, tmp_path: Path, name: str, *, manifest: Manifest | None,
                     authority: ManifestAuthority | None = None, key: KeyPair | None = None) -> Node:
    key = key or create_new_key_pair()
    host = build_host(key)
    state = SwarmState(key, suspect_after=30.0, gone_after=120.0, authority=authority)
    fields = {"role": "trainer" if manifest else "network-only", "version": "0.1.0",
              "manifest_hash": manifest.hash if manifest else ""}
    rep = StateReplicator(host, state, SWARM, path=tmp_path / f"{name}.state", pin_path=tmp_path / f"{name}.pin",
                          self_fields=lambda: dict(fields), local_manifest=lambda: manifest,
                          timing=ReplicationTiming(heartbeat_s=60.0, anti_entropy_s=0.5))

    async def serve(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with host.run(LOOPBACK):
            await nursery.start(rep.run)
            task_status.started()
            await trio.sleep_forever()

    await nursery.start(serve)
    return Node(name, host, state, rep)


async def connect(a: Node, b: Node) -> None:
    await a.host.connect(info_from_p2p_addr(b.host.get_addrs()[0]))
    a.rep.peer_connected(b.host.get_id())
    b.rep.peer_connected(a.host.get_id())


@pytest.mark.parametrize("rule", ["trust-on-first-use", "founder"])
async def test_a_forged_manifest_is_refused_everywhere_and_the_swarms_manifest_never_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, rule: str
) -> None:
    """A fresh key hands a trainer and the bootstrap node, over /starling/state sessions, another run's
    manifest signed at HLC (0, 0) (issue #13: within 8 s both carried it and the swarm split). Now both
    refuse it, log it with both hashes and the signer, and every node keeps the founder's manifest."""
    caplog.set_level(logging.WARNING, logger="starling.replicator")
    founder_key = create_new_key_pair()
    authority = ManifestAuthority(founder=peer_id_of(founder_key.public_key)) if rule == "founder" else None
    async with trio.open_nursery() as nursery:
        founder = await start_node(nursery, tmp_path, "founder", manifest=MANIFEST, authority=authority,
                                   key=founder_key)
        boot = await start_node(nursery, tmp_path, "boot", manifest=None, authority=authority)
        trainer = await start_node(nursery, tmp_path, "trainer", manifest=MANIFEST, authority=authority)
        await connect(founder, boot)
        await connect(trainer, boot)
        nodes = [founder, boot, trainer]
        await eventually(lambda: all(n.state.manifest == MANIFEST for n in nodes), "the swarm founded")
        assert {n.state.manifest_signer() for n in nodes} == {founder.state.peer_id}

        attacker_key = create_new_key_pair()
        attacker_pid = peer_id_of(attacker_key.public_key)
        forged = forged_manifest(attacker_key)
        forged_hash = dataclasses.replace(MANIFEST, model_hash="f" * 64).hash
        attacker = build_host(attacker_key)
        async with attacker.run(LOOPBACK):
            for victim in (trainer, boot):
                await attacker.connect(info_from_p2p_addr(victim.host.get_addrs()[0]))
                stream = await attacker.new_stream(victim.host.get_id(), [protocol.PROTOCOL_ID])
                with trio.fail_after(20):  # a fresh node's hello (no manifest) is compatible with any
                    await protocol.initiate(LibP2PByteStream(stream), Offer([forged]), info(), introduce=True)
                await stream.close()
            await eventually(lambda: all(v.state.rejected[crdt.MANIFEST_REFUSED] >= 1 for v in (trainer, boot)),
                             "the forgery reached both victims")
            await trio.sleep(2.0)  # a few anti-entropy rounds between the honest nodes after it
        assert all(n.state.manifest == MANIFEST for n in nodes)
        assert {n.state.manifest_signer() for n in nodes} == {founder.state.peer_id}
        assert all(not n.rep.incompatible_peers() for n in nodes)  # no split between trainers and boot
        refusals = [r.getMessage() for r in caplog.records if "refused run manifest" in r.getMessage()]
        assert refusals and all(forged_hash in m and MANIFEST.hash in m and attacker_pid in m for m in refusals)
        status = boot.rep.status()["swarm_totals"]
        assert status["manifest_founder"] == founder.state.peer_id and status["rejected"]["manifest_refused"] >= 1
        nursery.cancel_scope.cancel()
    if rule == "trust-on-first-use":  # the trusted manifest is pinned, private to the node
        pin = tmp_path / "boot.pin"
        assert read_manifest_pin(pin, SWARM) == MANIFEST.hash and stat.S_IMODE(pin.stat().st_mode) == 0o600


async def test_a_configured_founder_protects_a_node_that_has_never_seen_a_manifest() -> None:
    """The attacker reaches a newcomer before any honest node does. Trust on first use cannot help a node
    that holds nothing yet (it adopts the first manifest it gets: the measured gap, documented); with
    node.founder set the newcomer refuses the forgery and adopts the founder's manifest when it comes."""
    founder_key, attacker_key = create_new_key_pair(), create_new_key_pair()
    founder_state = SwarmState(founder_key)
    founded = founder_state.set_manifest(MANIFEST)
    assert founded is not None
    forged = forged_manifest(attacker_key)

    unprotected = SwarmState(create_new_key_pair())
    await one_session(Offer([forged]), unprotected, info(), info())
    assert unprotected.manifest is not None and unprotected.manifest.model_hash == "f" * 64

    newcomer = SwarmState(create_new_key_pair(),
                          authority=ManifestAuthority(founder=peer_id_of(founder_key.public_key)))
    await one_session(Offer([forged]), newcomer, info(), info())
    assert newcomer.manifest is None and newcomer.rejected[crdt.MANIFEST_REFUSED] == 1
    await one_session(Offer([founded.data]), newcomer, info(MANIFEST.hash), info())
    assert newcomer.manifest == MANIFEST


def test_a_pinned_manifest_outlives_the_state_file(tmp_path: Path) -> None:
    """Trust on first use is pinned to disk: a node whose state file was lost still refuses another run's
    manifest, however early it arrives; another swarm's pin is kept apart."""
    pin = tmp_path / "manifest.pin"
    write_manifest_pin(pin, SWARM, MANIFEST.hash)
    write_manifest_pin(pin, "other-swarm", "c" * 64)
    assert read_manifest_pin(pin, SWARM) == MANIFEST.hash and read_manifest_pin(pin, "nope") == ""
    restarted = SwarmState(create_new_key_pair(), authority=ManifestAuthority(pinned=read_manifest_pin(pin, SWARM)))
    assert not restarted.merge(forged_manifest(create_new_key_pair()))
    assert restarted.manifest is None
    assert restarted.merge(SwarmState(create_new_key_pair()).set_manifest(MANIFEST) or b"")
    assert restarted.manifest == MANIFEST


async def test_a_trainer_whose_manifest_differs_from_the_pinned_one_reports_it_and_founds_nothing(
    tmp_path: Path,
) -> None:
    """After its state file is lost, a node whose [train] settings changed must not found a new run: its
    pinned manifest is still the swarm's, and the mismatch is reported as one."""
    key = create_new_key_pair()
    state = SwarmState(key, authority=ManifestAuthority(pinned=MANIFEST.hash))
    mine = dataclasses.replace(MANIFEST, task="changed")
    rep = StateReplicator(build_host(key), state, SWARM, path=None, pin_path=tmp_path / "manifest.pin",
                          self_fields=dict, local_manifest=lambda: mine,
                          timing=ReplicationTiming(anti_entropy_s=0.01))
    await trio.sleep(0.05)  # past the lone node's grace period
    rep._check_manifest()
    assert state.manifest is None
    assert rep.manifest_error is not None and rep.manifest_error.swarm_hash == MANIFEST.hash


def test_a_bad_founder_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from node.cli import main

    assert main(["init", "--home", str(tmp_path / "h"), "--founder", "12D3KooWnotapeer"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "node.founder" in err[0] and "is not a PeerID" in err[0]
    assert not (tmp_path / "h").exists()


def test_init_prints_what_to_share_to_make_the_node_the_founder(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from node.cli import main

    assert main(["init", "--home", str(tmp_path / "h")]) == 0
    out = capsys.readouterr()
    peer_id = out.out.strip()
    assert f"--founder {peer_id}" in out.err and f'node.founder = "{peer_id}"' in out.err
    assert main(["init", "--home", str(tmp_path / "j"), "--founder", peer_id]) == 0
    assert f'founder = "{peer_id}"' in (tmp_path / "j" / "config.toml").read_text()


# ---------------------------------------------------------------------------------------------------
# Sybil fill of the member table


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


async def deliver_own(state: SwarmState, key: KeyPair, group: str, now: float) -> None:
    """An honest member syncs with the victim directly: its own record, from its own subnet."""
    pid = peer_id_of(key.public_key)
    await one_session(Offer([member_record(key, now)]), DeliveredReplica(state, Delivery(pid, group)), info(), info())


@pytest.mark.parametrize("max_per_subnet", [None, 1024], ids=["default-subnet-limit", "table-full"])
async def test_an_honest_newcomer_gets_in_after_a_sybil_fill_from_one_ip(max_per_subnet: int | None) -> None:
    """1,100 member records from fresh keys, delivered over one connection from one IP (issue #13: they
    filled the table at 1,024 and an honest newcomer was refused `capacity`). With the default limit the
    attacker's subnet gets a quarter of the table; with the limit raised to the whole table the Sybils
    fill it, and the newcomer takes the place of the newest Sybil. No established member is evicted."""
    clock = Clock()
    victim = SwarmState(create_new_key_pair(), clock=clock, max_per_subnet=max_per_subnet)
    victim.update_self()
    honest = [create_new_key_pair() for _ in range(5)]
    for i, key in enumerate(honest):
        await deliver_own(victim, key, group_of(f"192.0.2.{i + 1}") if i < 3 else group_of(f"10.{i}.0.1"), clock())
    clock.t += 200.0  # the honest members are established (held for longer than gone_after) ...
    for i, key in enumerate(honest):  # ... and alive
        await deliver_own(victim, key, group_of(f"192.0.2.{i + 1}") if i < 3 else group_of(f"10.{i}.0.1"), clock())

    attacker = create_new_key_pair()
    sybils = [create_new_key_pair() for _ in range(1100)]
    sybil_ids = {peer_id_of(k.public_key) for k in sybils}
    flood = [member_record(k, clock()) for k in sybils]
    via_attacker = DeliveredReplica(victim, Delivery(peer_id_of(attacker.public_key), ATTACKER_GROUP))
    await one_session(Offer(flood), via_attacker, info(), info())

    held = {m.peer_id for m in victim.members()}
    accepted = len(held & sybil_ids)
    if max_per_subnet is None:
        assert accepted == victim.max_per_subnet == 256
        assert victim.rejected[crdt.SUBNET_LIMIT] == 1100 - 256
    else:
        assert accepted == victim.max_members - 1 - len(honest)  # the table is full of Sybils
        assert victim.rejected[crdt.CAPACITY] == 1100 - accepted
    newcomer = create_new_key_pair()
    await deliver_own(victim, newcomer, NEWCOMER_GROUP, clock())
    held = {m.peer_id for m in victim.members()}
    assert peer_id_of(newcomer.public_key) in held
    assert {peer_id_of(k.public_key) for k in honest} <= held
    assert len(victim.members()) <= victim.max_members
    # Another Sybil cannot push the newcomer out: the newcomer's subnet is the rarer one.
    await one_session(Offer([member_record(create_new_key_pair(), clock())]), via_attacker, info(), info())
    assert peer_id_of(newcomer.public_key) in {m.peer_id for m in victim.members()}


def test_crowd_eviction_never_swaps_two_peers_of_one_subnet() -> None:
    """A full table of one subnet refuses a further identity from that subnet (no churn), and a record a
    peer delivers itself moves it to its own subnet."""
    clock = Clock()
    state = SwarmState(create_new_key_pair(), clock=clock, max_members=4, max_per_subnet=4)
    state.update_self()  # this node holds a place of its own
    relay = Delivery("relay", ATTACKER_GROUP)
    keys = [create_new_key_pair() for _ in range(4)]
    assert state.apply([member_record(k, clock()) for k in keys[:3]], delivery=relay).changed == 3
    assert not state.merge(member_record(keys[3], clock()), delivery=relay)
    assert state.rejected[crdt.CAPACITY] == 1
    own = Delivery(peer_id_of(keys[0].public_key), NEWCOMER_GROUP)
    clock.t += 1
    state.merge(member_record(keys[0], clock()), delivery=own)
    assert state.groups() == {ATTACKER_GROUP: 2, NEWCOMER_GROUP: 1, "": 1}


# ---------------------------------------------------------------------------------------------------
# Per-subnet limits on connections and protocol streams


async def test_connections_from_one_subnet_are_capped_and_loopback_is_exempt() -> None:
    sybils = {ID(f"sybil{i}".encode()): f"203.0.113.{i}" for i in range(20)}
    local = {ID(f"local{i}".encode()): "127.0.0.1" for i in range(20)}
    honest = {ID(b"honest"): "198.51.100.7"}
    host = FakeHost(peers={**sybils, **local, **honest})
    mgr = ConnManager(host, target=8, cap=64, max_per_subnet=16, ip_of=lambda p: host.peers.get(p))
    async with trio.open_nursery() as nursery:
        mgr._tick(nursery)
    assert len(host.disconnected) == 4 and set(host.disconnected) <= set(sybils)
    assert mgr.status()["subnet_pruned"] == 4


async def test_connections_over_the_cap_are_closed_and_counted() -> None:
    """`status`'s refusals count them (connections.cap_pruned): without a counter, a node at its cap closing
    the newest connections every tick looked the same as a quiet one. (Once past their grace period: see
    tests/test_joining.py.)"""
    peers = {ID(f"peer{i}".encode()): f"198.51.{i}.7" for i in range(10)}
    host = FakeHost(peers=peers)
    now = [0.0]
    mgr = ConnManager(host, target=4, cap=6, ip_of=lambda p: host.peers.get(p), clock=lambda: now[0])
    async with trio.open_nursery() as nursery:
        mgr._tick(nursery)
        now[0] += PRUNE_GRACE_S
        mgr._tick(nursery)
    assert len(host.disconnected) == 4
    assert mgr.status()["cap_pruned"] == 4 and mgr.status()["subnet_pruned"] == 0


def test_connection_candidates_are_bounded_and_bootstrap_peers_always_fit() -> None:
    from libp2p.peer.peerinfo import PeerInfo

    from p2p import connmgr

    mgr = ConnManager(FakeHost())
    addr = [multiaddr.Multiaddr("/ip4/203.0.113.9/tcp/1")]
    for i in range(1100):
        mgr.add_candidate(PeerInfo(ID(f"sybil{i}".encode()), addr), source="state")
    assert len(mgr.candidates) == connmgr.MAX_CANDIDATES
    mgr.add_candidate(PeerInfo(ID(b"boot"), addr), source="bootstrap", permanent=True)
    assert ID(b"boot") in mgr.candidates and len(mgr.candidates) == connmgr.MAX_CANDIDATES


class FakeStream:
    def __init__(self, ip: str) -> None:
        self.ip = ip
        self.was_reset = False

    def get_remote_address(self) -> tuple[str, int]:
        return (self.ip, 4001)

    async def reset(self) -> None:
        self.was_reset = True


async def test_concurrent_state_sessions_from_one_subnet_are_limited() -> None:
    """Eight /starling/state sessions at once from one /24 (the daemon allows 4 per subnet): four are
    served, four reset at once (no check-then-await race: all arrive together); loopback and another
    subnet still get through. (Averaging requests have their per-IP share in node/averaging/averager.py.)"""
    handlers: dict[str, Any] = {}

    class Host:
        def set_stream_handler(self, protocol_id: str, handler: Any) -> None:
            handlers[protocol_id] = handler

    host = Host()
    limits = SubnetStreamLimits({"/starling/state/1.0.0": 4})
    limits.install(host)
    release = trio.Event()
    inside = 0
    most = 0

    async def handler(stream: Any) -> None:
        nonlocal inside, most
        inside += 1
        most = max(most, inside)
        await release.wait()
        inside -= 1

    host.set_stream_handler("/starling/state/1.0.0", handler)
    streams = [FakeStream(f"203.0.113.{i}") for i in range(8)] + [FakeStream("127.0.0.1"), FakeStream("198.51.100.7")]
    async with trio.open_nursery() as nursery:
        for s in streams:
            nursery.start_soon(handlers["/starling/state/1.0.0"], s)
        await trio.testing.wait_all_tasks_blocked()
        assert most == 6 and sum(s.was_reset for s in streams) == 4
        assert not streams[8].was_reset and not streams[9].was_reset
        release.set()
    assert limits.status()["refused"] == {"/starling/state/1.0.0": 4}


def test_provider_records_for_random_dht_keys_are_bounded() -> None:
    """A peer announcing itself as provider of 1,100 random DHT keys: py-libp2p bounds providers per key
    (20) but not keys; the store now keeps at most MAX_PROVIDER_KEYS keys, and held keys keep working."""
    from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
    from libp2p.peer.peerinfo import PeerInfo

    from p2p import discovery

    dht = KadDHT(build_host(create_new_key_pair()), DHTMode.SERVER)
    discovery.bound_provider_store(dht.provider_store)
    spammer = PeerInfo(ID.from_pubkey(create_new_key_pair().public_key), [multiaddr.Multiaddr("/ip4/203.0.113.9/tcp/1")])
    for i in range(1100):
        dht.provider_store.add_provider(i.to_bytes(32, "big"), spammer)
    assert len(dht.provider_store.providers) == discovery.MAX_PROVIDER_KEYS
    honest = PeerInfo(ID.from_pubkey(create_new_key_pair().public_key), [multiaddr.Multiaddr("/ip4/198.51.100.7/tcp/1")])
    dht.provider_store.add_provider((0).to_bytes(32, "big"), honest)
    assert len(dht.provider_store.get_providers((0).to_bytes(32, "big"))) == 2


# ---------------------------------------------------------------------------------------------------
# Concurrent snapshot requests


async def test_max_serving_holds_under_eight_simultaneous_snapshot_requests() -> None:
    """Issue #13: with max_serving = 2, 8 simultaneous requests were all served (check, await, then
    increment). The checkpoint read is made slow here so that every request is in before any finishes."""
    snapshot = snap.Snapshot.of(torch.randn(snap.CHUNK_ELEMS), 10, 1, "L")
    gate = threading.Event()
    lock = threading.Lock()
    loading = {"now": 0, "most": 0}

    def slow_source() -> snap.Snapshot:
        with lock:
            loading["now"] += 1
            loading["most"] = max(loading["most"], loading["now"])
        gate.wait(30)
        with lock:
            loading["now"] -= 1
        return snapshot

    server = snap.SnapshotServer(slow_source, max_serving=2)
    verdicts: list[str] = []
    async with AsyncExitStack() as stack:
        donor, joiner = await connected_pair(stack, {snap.PROTOCOL_ID: server.handle})

        async def request() -> None:
            stream = await joiner.new_stream(donor.get_id(), [snap.PROTOCOL_ID])
            control = LibP2PByteStream(stream)
            await send_msg(control, snap.SnapRequest())
            meta = await recv_as(control, snap.SnapMeta, max_bytes=snap.MAX_META_BYTES)
            verdicts.append(meta.verdict)
            await stream.reset()

        with trio.fail_after(60):  # a hang guard
            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(request)
                await eventually(lambda: loading["now"] + server.refused_busy == 8 or loading["now"] > 2,
                                 "every request admitted or refused")
                concurrent = loading["most"]
                assert server.serving <= 2
                gate.set()
    assert concurrent == 2 and sorted(verdicts) == ["busy"] * 6 + ["ok"] * 2
    await eventually(lambda: server.serving == 0, "slots released")


# ---------------------------------------------------------------------------------------------------
# Checkpoint permissions


def test_checkpoints_and_downloaded_snapshots_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old_umask = os.umask(0o022)
    try:
        old_dir = tmp_path / "home" / "checkpoints" / "old-task"
        old_dir.mkdir(parents=True)  # as versions before this one left it: 0755, files 0644
        legacy = old_dir / "ckpt-000000000001.pt"
        legacy.write_bytes(b"x")
        assert tighten_private_folders(Home(tmp_path / "home").private_folders) == []  # what the daemon does at start
        store = CheckpointStore(tmp_path / "home" / "checkpoints" / "task-abc", keep=2)
        path = store.save({"phi": torch.zeros(3), "step": 5}, 5)
        download = snap.JoinDownload(tmp_path / "home" / "join" / "partial", snap.ModelShape("L", 1))
        trio.run(functools.partial(download.fetch, _no_stream, "donor", timeout_s=1.0))  # makes its folder, fails
        download._save(snap.DonorProgress("donor", meta={"snapshot_id": "x"}, have=0))
    finally:
        os.umask(old_umask)

    def mode(p: Path) -> int:
        return stat.S_IMODE(p.stat().st_mode)

    assert mode(path) == 0o600 and mode(legacy) == 0o600
    assert mode(store.directory) == 0o700 and mode(store.directory.parent) == 0o700 and mode(old_dir) == 0o700
    assert mode(download.directory) == 0o700 and mode(download.directory.parent) == 0o700
    assert [mode(p) for p in download.directory.iterdir()] == [0o600]


async def _no_stream(donor: str) -> Any:
    raise OSError("no donor here")


# ---------------------------------------------------------------------------------------------------
# Issue #14 item 5: no false manifest ERROR while joining


async def test_a_joining_trainer_answers_busy_without_a_false_manifest_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before the worker has said what it trains, an honest member's averaging request was refused with
    `ERROR refusing ...: run manifest ... differs from ours none` on every normal join. The joiner now
    compares with the swarm's manifest (answering busy: nothing to exchange yet), and members whose task
    is not loaded (no manifest in their record) are not asked at all."""
    from node.config.load import load_config
    from node.daemon import Daemon
    from protocols.avg import AvgRequest

    # gossip membership: the records injected below are alive by their age (with swim, SWIM's probes decide)
    cfg = load_config(tmp_path, overrides={"node.listen": ["/ip4/127.0.0.1/tcp/0"], "node.membership": "gossip"},
                      environ={})
    daemon = Daemon(cfg, tmp_path, create_new_key_pair(), train=True)
    assert daemon.averager is not None
    founder = SwarmState(create_new_key_pair())
    daemon.replicator.state.merge(founder.set_manifest(MANIFEST) or b"")
    request = AvgRequest(outer_step=3, manifest_hash=MANIFEST.hash, layout_hash="L", numel=10, wire_dtype="bf16",
                         int8_block=4096, chunk_elems=1024, pubkey=b"k" * 32)
    daemon.nat.path_of = lambda peer: "direct"  # type: ignore[method-assign]
    caplog.set_level(logging.INFO)
    verdict = daemon.averager.answer_for(request, founder.peer_id)  # between outer steps
    assert verdict is not None and verdict[0].busy
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]

    loading, ready = SwarmState(create_new_key_pair()), SwarmState(create_new_key_pair())
    daemon.replicator.state.merge(loading.update_self(role="trainer"))
    daemon.replicator.state.merge(ready.update_self(role="trainer", manifest_hash=MANIFEST.hash))
    daemon.partners.path_of = lambda peer: "direct"  # the policy's path seam: every member direct
    assert [m.peer_id for m in daemon.partners.possible()] == [ready.peer_id]
