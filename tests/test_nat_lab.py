"""NAT traversal: NatService on loopback hosts, then real NATs in the network lab.

The loopback tests check the relay mechanics (reservations, circuit addresses, relayed connections,
limits, configuration errors) in one process. The lab tests run one small program per network
namespace (public relays on the bridge, private hosts behind home or hostile NATs) and read what each
node prints: reachability verdicts, circuit addresses, and the path to the other peer.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import multiaddr
import pytest
import trio
from libp2p.abc import IHost
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import PeerInfo

from node.swarm.circuit import parse_circuit_addr
from node.swarm.holepunch import describe_punch_failure
from node.swarm.nat import NatConfig, NatService, RelayRefused
from p2p.connmgr import ConnManager
from p2p.host import build_host
from protocols.dialback import DialStatus
from starling_testing.netlab import Host, Lab, Proc

LOOPBACK = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")

# --------------------------------------------------------------------------------------------------
# Loopback: relay mechanics in one process
# --------------------------------------------------------------------------------------------------


@asynccontextmanager
async def nat_nodes(*configs: NatConfig) -> AsyncIterator[list[tuple[IHost, NatService]]]:
    """Running hosts on 127.0.0.1, each with a connection manager and a NatService."""
    nodes: list[tuple[IHost, NatService]] = []
    async with trio.open_nursery() as nursery:
        stop = trio.Event()

        async def run(config: NatConfig, task_status: trio.TaskStatus[None]) -> None:
            host = build_host(create_new_key_pair())
            connmgr = ConnManager(host)
            nat = NatService(host, connmgr, config)
            connmgr.on_connected = nat.peer_connected
            async with host.run([LOOPBACK]), trio.open_nursery() as inner:
                await inner.start(connmgr.run)
                await inner.start(nat.run)
                nodes.append((host, nat))
                task_status.started()
                await stop.wait()
                inner.cancel_scope.cancel()

        for config in configs:
            await nursery.start(run, config)
        try:
            yield nodes
        finally:
            stop.set()


async def wait_until(predicate, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.1)


RELAY = NatConfig(relay_service="on", relay_client="off", hole_punch=False)
CLIENT = NatConfig(relay_service="off", relay_client="always", hole_punch=False)
PLAIN = NatConfig(relay_service="off", relay_client="off", hole_punch=False)


async def test_a_reserved_peer_is_reachable_through_its_circuit_address_and_the_path_says_relayed() -> None:
    async with nat_nodes(RELAY, CLIENT, PLAIN) as [(relay, relay_nat), (a, a_nat), (b, b_nat)]:
        await a.connect(PeerInfo(relay.get_id(), relay.get_transport_addrs()))
        await wait_until(lambda: a_nat.relay_addrs())
        [circuit] = a_nat.relay_addrs()
        relay_addr = relay.get_transport_addrs()[0]
        assert circuit == f"{relay_addr}/p2p/{relay.get_id()}/p2p-circuit/p2p/{a.get_id()}"

        await b_nat.dial(PeerInfo(a.get_id(), [multiaddr.Multiaddr(circuit)]))
        assert b_nat.path_of(a.get_id()) == "relayed"
        assert a_nat.path_of(b.get_id()) == "relayed"
        assert b_nat.path_of(relay.get_id()) == "direct"
        assert relay_nat.status()["relay_clients"] == 1
        assert a_nat.status()["relays"] == [str(relay.get_id())]
        await wait_until(lambda: relay_nat.relay_circuits == 1)
        await wait_until(lambda: all(p["rtt_ms"] is not None for p in b_nat.peers_status()))
        b_nat.record_throughput(str(a.get_id()), 1_000_000, 0.5)  # what the averager reports
        row = next(p for p in b_nat.peers_status() if p["peer_id"] == str(a.get_id()))
        assert row["path"] == "relayed" and row["rtt_ms"] > 0 and row["throughput_mbps"] == 16.0


async def test_a_relayed_peer_that_is_directly_dialable_is_upgraded_and_reported_direct() -> None:
    """DCUtR's first step dials the peer's own addresses; that is a direct path, not a hole punch."""
    punching = NatConfig(relay_service="off", relay_client="always")
    async with nat_nodes(RELAY, punching, NatConfig(relay_service="off", relay_client="off")) as nodes:
        [(relay, _), (a, a_nat), (b, b_nat)] = nodes
        await a.connect(PeerInfo(relay.get_id(), relay.get_transport_addrs()))
        await wait_until(lambda: a_nat.relay_addrs())
        await b_nat.dial(PeerInfo(a.get_id(), [multiaddr.Multiaddr(a_nat.relay_addrs()[0])]))
        await wait_until(lambda: b_nat.path_of(a.get_id()) != "relayed")
        assert b_nat.path_of(a.get_id()) == "direct"


async def test_a_peer_that_is_not_a_relay_is_not_used_and_dialing_it_as_one_fails_clearly() -> None:
    async with nat_nodes(PLAIN, PLAIN, PLAIN) as [(not_relay, _), (a, a_nat), (_, b_nat)]:
        await a.connect(PeerInfo(not_relay.get_id(), not_relay.get_transport_addrs()))
        with pytest.raises(RelayRefused, match="is not a relay"):
            await a_nat.reserve(not_relay.get_id())
        fake = f"{not_relay.get_transport_addrs()[0]}/p2p/{not_relay.get_id()}/p2p-circuit/p2p/{a.get_id()}"
        with pytest.raises(ConnectionError, match="is not a relay"):
            await b_nat.dial(PeerInfo(a.get_id(), [multiaddr.Multiaddr(fake)]))
        assert b_nat.path_of(a.get_id()) == "none"


async def test_a_circuit_to_a_peer_without_a_reservation_is_refused_by_the_relay() -> None:
    async with nat_nodes(RELAY, PLAIN, PLAIN) as [(relay, _), (a, _), (_, b_nat)]:
        circuit = f"{relay.get_transport_addrs()[0]}/p2p/{relay.get_id()}/p2p-circuit/p2p/{a.get_id()}"
        with pytest.raises(ConnectionError, match="NO_RESERVATION"):
            await b_nat.dial(PeerInfo(a.get_id(), [multiaddr.Multiaddr(circuit)]))


async def test_the_relay_serves_no_more_reservations_than_its_limit() -> None:
    tiny_relay = NatConfig(relay_service="on", relay_client="off", hole_punch=False, relay_max_reservations=1)
    async with nat_nodes(tiny_relay, CLIENT, PLAIN) as [(relay, relay_nat), (a, a_nat), (b, b_nat)]:
        await a.connect(PeerInfo(relay.get_id(), relay.get_transport_addrs()))
        await wait_until(lambda: a_nat.relay_addrs())
        await b.connect(PeerInfo(relay.get_id(), relay.get_transport_addrs()))
        with pytest.raises(RelayRefused, match="RESOURCE_LIMIT_EXCEEDED"):
            await b_nat.reserve(relay.get_id())
        assert relay_nat.status()["relay_clients"] == 1


def test_circuit_addresses_are_parsed_and_bad_ones_rejected_with_the_address_quoted() -> None:
    relay, dest = (
        "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
        "12D3KooWJToofMUVWq5Nvop1k3f6egp9gnKoHdE9rtJkJQdtJbLd",
    )
    transport, relay_id, dest_id = parse_circuit_addr(
        f"/ip4/10.0.0.1/tcp/4001/p2p/{relay}/p2p-circuit/p2p/{dest}"
    )
    assert (str(transport), str(relay_id), str(dest_id)) == ("/ip4/10.0.0.1/tcp/4001", relay, dest)
    assert parse_circuit_addr(f"/p2p/{relay}/p2p-circuit/p2p/{dest}")[0] is None
    for bad in (
        "/ip4/10.0.0.1/tcp/4001",
        f"/ip4/1.2.3.4/tcp/1/p2p-circuit/p2p/{dest}",
        f"/p2p/{relay}/p2p-circuit/p2p/nope",
    ):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            parse_circuit_addr(bad)


def test_nat_config_rejects_bad_values_with_the_setting_named() -> None:
    with pytest.raises(ValueError, match="relay_service"):
        NatConfig(relay_service="maybe")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="relay_circuit_bytes"):
        NatConfig(relay_circuit_bytes=0)
    with pytest.raises(ValueError, match="max_reservations"):
        NatConfig(max_reservations=-1)
    assert NatConfig().relay_limits().data == 16 << 20


def test_a_punch_failure_names_the_most_telling_address_and_cause() -> None:
    from libp2p.peer.id import ID

    peer = ID.from_base58("12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN")
    errors = [
        ("/ip4/192.168.102.10/tcp/4001", DialStatus.UNREACHABLE, "no route to host"),
        ("/ip4/10.200.0.12/tcp/4001", DialStatus.REFUSED, "connection refused"),
    ]
    text = describe_punch_failure(peer, errors)
    assert "/ip4/10.200.0.12/tcp/4001 answered with RST" in text and text.endswith("staying relayed")
    assert "no direct address" in describe_punch_failure(peer, [])


# --------------------------------------------------------------------------------------------------
# The lab: real NATs
# --------------------------------------------------------------------------------------------------

PORT = 4001

# One Starling node's network layer: host + connection manager + NatService. Prints one line per change:
# "ready <peer id>", "reachability <verdict>", "relay_addrs <json>", "path <peer> <path> <rtt ms>",
# "reason <text>". Dials the circuit addresses that the test writes into argv[3] (a JSON list).
NODE = r"""
import json, logging, os, sys, trio, multiaddr
logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
logging.getLogger("starling").setLevel(logging.INFO)
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import PeerInfo
from p2p.addrs import parse_bootstrap
from p2p.connmgr import ConnManager
from p2p.host import build_host
from node.swarm.circuit import parse_circuit_addr
from node.swarm.nat import NatConfig, NatService

port, bootstrap, dial_file = int(sys.argv[1]), [b for b in sys.argv[2].split(",") if b], sys.argv[3]

async def main():
    host = build_host(create_new_key_pair())
    connmgr = ConnManager(host, target=8, cap=16, dial_timeout=10)
    nat = NatService(host, connmgr, NatConfig())
    connmgr.on_connected = nat.peer_connected
    for text in bootstrap:
        connmgr.add_candidate(parse_bootstrap(text), source="bootstrap", permanent=True)
    async with host.run([multiaddr.Multiaddr(f"/ip4/0.0.0.0/tcp/{port}")]), trio.open_nursery() as nursery:
        await nursery.start(connmgr.run)
        await nursery.start(nat.run)
        print("ready", host.get_id(), flush=True)
        shown, dialed = {}, False
        def show(key, line):
            if shown.get(key) != line:
                shown[key] = line
                print(line, flush=True)
        while True:
            show("reachability", f"reachability {nat.reachability}")
            show("relay_addrs", "relay_addrs " + json.dumps(sorted(nat.relay_addrs())))
            show("reason", f"reason {nat.reason}")
            for row in nat.peers_status():
                show(row["peer_id"], f"path {row['peer_id']} {row['path']} {row['rtt_ms']}")
            if not dialed and os.path.exists(dial_file):
                dialed = True
                addrs = [multiaddr.Multiaddr(a) for a in json.load(open(dial_file))]
                target = parse_circuit_addr(addrs[0])[2]
                try:
                    with trio.fail_after(20):
                        await nat.dial(PeerInfo(target, addrs))
                    print("dialed", target, flush=True)
                except Exception as e:
                    print("dial failed", e, flush=True)
            await trio.sleep(0.2)

trio.run(main)
"""


def start_node(host: Host, bootstrap: list[str], dial_file: Path) -> tuple[Proc, str]:
    proc = host.spawn_python(NODE, str(PORT), ",".join(bootstrap), str(dial_file), log=f"{host.name}.log")
    peer_id = proc.wait_for(r"^ready (\S+)", timeout=30).group(1)
    return proc, peer_id


def last_path(proc: Proc, peer_id: str) -> str:
    paths = re.findall(rf"^path {peer_id} (\S+)", proc.output(), flags=re.M)
    return paths[-1] if paths else "none"


@pytest.mark.slow
def test_behind_home_nats_peers_meet_through_a_relay_and_get_hole_punched(lab: Lab, tmp_path: Path) -> None:
    r1, r2 = lab.public_host("relay1"), lab.public_host("relay2")
    a = lab.private_host("a", lab.nat("nat1", style="home"))
    b = lab.private_host("b", lab.nat("nat2", style="home"))
    dial_file = tmp_path / "b-dials.json"
    p_r1, id_r1 = start_node(r1, [], tmp_path / "unused")
    boot = [f"/ip4/{r1.ip}/tcp/{PORT}/p2p/{id_r1}"]
    p_r2, id_r2 = start_node(r2, boot, tmp_path / "unused")
    boot.append(f"/ip4/{r2.ip}/tcp/{PORT}/p2p/{id_r2}")
    p_a, id_a = start_node(a, boot, tmp_path / "unused")
    p_b, id_b = start_node(b, boot, dial_file)

    for relay in (p_r1, p_r2):
        relay.wait_for(r"^reachability public", timeout=30)
    for private in (p_a, p_b):  # the helpers' SYNs to the NAT went unanswered
        private.wait_for(r"INFO reachability private: .* timeout", timeout=30)
    # A keeps slots on both relays and advertises one circuit address through each.
    circuits = json.loads(p_a.wait_for(r"^relay_addrs (\[\"[^,]+\", \"[^,]+\"\])$", timeout=30).group(1))
    assert {parse_circuit_addr(c)[1].to_base58() for c in circuits} == {id_r1, id_r2}
    assert all(c.endswith(f"/p2p-circuit/p2p/{id_a}") for c in circuits)

    dial_file.write_text(json.dumps(circuits))
    p_b.wait_for(rf"^dialed {id_a}", timeout=30)
    p_b.wait_for(rf"^path {id_a} hole-punched \d", timeout=30)  # with a measured RTT
    p_a.wait_for(rf"^path {id_b} hole-punched", timeout=30)
    for proc in (p_a, p_b):  # both ends ran the punch (DCUtR initiator and responder) and say so
        proc.wait_for(r"hole punching to \S+ succeeded: direct connection", timeout=20)
    for relay in (p_r1, p_r2):  # public nodes serve relays and hold no slots themselves
        assert 'relay_addrs ["' not in relay.output()


@pytest.mark.slow
def test_behind_hostile_nats_peers_stay_relayed_and_the_reason_says_why(lab: Lab, tmp_path: Path) -> None:
    r1 = lab.public_host("relay1")
    a = lab.private_host("a", lab.nat("nat1", style="hostile"))
    b = lab.private_host("b", lab.nat("nat2", style="hostile"))
    dial_file = tmp_path / "b-dials.json"
    p_r1, id_r1 = start_node(r1, [], tmp_path / "unused")
    boot = [f"/ip4/{r1.ip}/tcp/{PORT}/p2p/{id_r1}"]
    p_a, id_a = start_node(a, boot, tmp_path / "unused")
    p_b, _ = start_node(b, boot, dial_file)

    p_r1.wait_for(r"^reachability public", timeout=30)
    for private in (p_a, p_b):  # the NAT answered the helper's dial with RST
        private.wait_for(r"INFO reachability private: .* refused", timeout=30)
    circuits = json.loads(p_a.wait_for(r"^relay_addrs (\[\".+\"\])$", timeout=30).group(1))
    assert len(circuits) == 1  # one public relay in this swarm: one slot

    dial_file.write_text(json.dumps(circuits))
    p_b.wait_for(rf"^dialed {id_a}", timeout=30)
    p_b.wait_for(rf"^path {id_a} relayed", timeout=10)
    reason = p_b.wait_for(r"^reason (hole punching to .* failed: .*)$", timeout=45).group(1)
    assert "answered with RST" in reason and reason.endswith("staying relayed")
    assert last_path(p_b, id_a) == "relayed"
