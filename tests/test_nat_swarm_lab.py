"""Whole Starling daemons behind real NATs: discovery, relays, hole punching and averaging, end to end.

Each swarm lives in the network lab (starling_testing/netlab.py): a bootstrap node and a relay (both network-only)
and one trainer on the public segment, and two trainers, A and B, each behind its own NAT. Every node
is a real `starling run` process (plus its torch worker) in its own network namespace, so the only way
A and B can meet is the product's own: the DHT and the swarm state tell each about the other, the
circuit addresses in the members' records get them connected through a relay, and DCUtR may then
upgrade that connection to a direct one.

* Behind ``home`` NATs (drop unsolicited SYNs, keep ports) the punch works: A and B end up
  ``hole-punched`` and average with each other.
* Behind ``hostile`` NATs (answer with RST, random ports) it cannot: A and B stay ``relayed``, keep
  talking (swarm state, pings) through the relay, never move tensors over it, and both still train by
  averaging with the public trainer; their status says why they are stuck on the relay.

Every assertion reads what an operator reads: `starling status` (JSON, or the readable view).

The tiny model makes an outer step shorter than the pairing window, so on a shared 2-core machine the
trainers' outer-step counters drift apart quickly; `sync.max_step_gap` is raised so that the step-gap
rule (tested in test_swarm.py) does not decide who may average here: these tests are about paths.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from node.swarm.circuit import short_id
from starling_testing import netlab
from starling_testing.daemon import PORT, PYTHON, ROOT, TINY_TRAIN, LabDaemon, path_to, start_daemon
from starling_testing.netlab import Host, Lab, NatStyle

pytestmark = [pytest.mark.slow, pytest.mark.lab]

SWARM = "natlab"

TRAIN = [
    *TINY_TRAIN,
    "--set", "train.checkpoint_every=20", "--set", "train.threads=1", "--set", "sync.max_step_gap=1000",
]  # fmt: skip
COMMON = ["--set", "node.heartbeat_s=0.5"]


# --------------------------------------------------------------------------------------------------
# Daemons in the lab
# --------------------------------------------------------------------------------------------------


def cli_status(daemon: LabDaemon, *, as_json: bool) -> str:
    """What `starling status [--json]` prints for this daemon (run from the root namespace)."""
    argv = [PYTHON, "-m", "node.cli", "status", "--home", str(daemon.home)] + (["--json"] if as_json else [])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=ROOT, check=False)
    assert done.returncode == 0, f"`starling status` failed ({done.returncode}): {done.stderr}"
    return done.stdout


def peer_row(status: dict[str, Any], peer_id: str) -> dict[str, Any] | None:
    """The `peers` entry (path, rtt_ms, note) for `peer_id`, if connected."""
    return next((p for p in status.get("peers", []) if p["peer_id"] == peer_id), None)


def peer_note(status: dict[str, Any], peer_id: str) -> str:
    """Why a relayed peer is still relayed ('' when there is nothing to say)."""
    return (peer_row(status, peer_id) or {}).get("note", "")


def bulk_path_with(status: dict[str, Any], peer_id: str) -> str:
    """What carried the last exchange's bulk with `peer_id`: datapath (side channel) or stream (libp2p)."""
    return str(((status.get("sync") or {}).get("per_peer") or {}).get(peer_id, {}).get("path", ""))


def rounds_with(status: dict[str, Any], peer_id: str) -> int:
    """Averaging rounds this trainer completed with `peer_id` (sync.per_peer)."""
    return int(((status.get("sync") or {}).get("per_peer") or {}).get(peer_id, {}).get("rounds", 0))


@dataclass
class NatSwarm:
    """boot and relay (network-only) and trainer `pub` on the public segment; trainers A and B behind
    two NATs of one style."""

    boot: LabDaemon
    relay: LabDaemon
    pub: LabDaemon
    a: LabDaemon
    b: LabDaemon


def start(host: Host, root: Path, *args: str, train: bool) -> LabDaemon:
    """Start `starling run` in `host`'s namespace (HOME = root/<host>) and wait until it listens."""
    return start_daemon(host, root / host.name, ["--swarm", SWARM, *COMMON, *args, *(TRAIN if train else ["--no-train"])],
                        timeout=60)


def start_nat_swarm(lab: Lab, root: Path, style: NatStyle) -> NatSwarm:
    """Build the topology and start the daemons, bootstrap first (the others are given its address)."""
    boot_host = lab.public_host("boot")
    relay_host, pub_host = lab.public_host("relay"), lab.public_host("pub")
    a_host = lab.private_host("a", lab.nat("nat1", style=style))
    b_host = lab.private_host("b", lab.nat("nat2", style=style))
    boot = start(boot_host, root, train=False)
    join = ["--bootstrap", f"/ip4/{boot_host.ip}/tcp/{PORT}/p2p/{boot.peer_id}"]
    relay = start(relay_host, root, *join, train=False)
    pub = start(pub_host, root, *join, train=True)
    a = start(a_host, root, *join, train=True)
    b = start(b_host, root, *join, train=True)
    return NatSwarm(boot, relay, pub, a, b)


@pytest.fixture(scope="class")
def home_swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatSwarm]:
    """One swarm behind home NATs, shared by the tests of TestHomeNats, which only read it (saves a
    minute per test); class-scoped so that it is gone before another lab starts on these 2 cores."""
    reason = netlab.unavailable_reason()
    if reason is not None:
        pytest.skip(f"network lab unavailable: {reason}")
    root = tmp_path_factory.mktemp("home-nat")
    with Lab(log_dir=root / "lab-logs") as lab:
        yield start_nat_swarm(lab, root, "home")


# --------------------------------------------------------------------------------------------------
# Home NATs: hole punching
# --------------------------------------------------------------------------------------------------


class TestHomeNats:
    """Home routers (drop unsolicited SYNs, keep ports): hole punching works."""

    def test_behind_home_nats_trainers_meet_through_a_relay_get_hole_punched_and_average(
        self, home_swarm: NatSwarm
    ) -> None:
        swarm = home_swarm
        a, b = swarm.a, swarm.b

        # Truthful reachability: the public nodes were dialed back, the NATed ones could not be.
        for node in (swarm.boot, swarm.relay, swarm.pub):
            node.wait(lambda s: s["reachability"] == "public", timeout=60, what="reachability public")
        for node in (a, b):
            node.wait(
                lambda s: s["reachability"] == "private", timeout=60, what="reachability private"
            )

        # A and B learn of each other from the swarm (DHT + signed member records with circuit addresses),
        # connect through a relay and are upgraded to a direct path, on both ends.
        a.wait(lambda s: path_to(s, b.peer_id) == "hole-punched", timeout=90, what="B hole-punched")
        b.wait(lambda s: path_to(s, a.peer_id) == "hole-punched", timeout=30, what="A hole-punched")
        relayed_first = re.compile(
            rf"connected to ({short_id(a.peer_id)}|{short_id(b.peer_id)}) through relay", re.M
        )
        assert relayed_first.search(a.proc.output() + b.proc.output()), (
            "A and B never connected through a relay"
        )

        # They average with each other over that path, the bulk over a side channel they punched too.
        a.wait(lambda s: rounds_with(s, b.peer_id) >= 2, timeout=60, what="averaging rounds with B")
        b.wait(lambda s: rounds_with(s, a.peer_id) >= 2, timeout=30, what="averaging rounds with A")
        for node, other in ((a, b), (b, a)):
            node.wait(lambda s, other=other: bulk_path_with(s, other.peer_id) == "datapath", timeout=30,
                      what="bulk over the punched side channel")

        # What `starling status --json` says, every peer with its path and a measured RTT.
        for node in (a, b):
            node.wait(
                lambda s: all(p["rtt_ms"] is not None for p in s["peers"]),
                timeout=30,
                what="RTT of every peer",
            )
        st_a = json.loads(cli_status(a, as_json=True))
        st_boot = json.loads(cli_status(swarm.boot, as_json=True))
        assert (st_a["reachability"], st_boot["reachability"]) == ("private", "public")
        row = peer_row(st_a, b.peer_id)
        assert row is not None and row["path"] == "hole-punched" and row["rtt_ms"] > 0
        assert path_to(st_a, swarm.pub.peer_id) == "direct"  # A dialed the public trainer itself
        assert rounds_with(st_a, b.peer_id) >= 2
        assert len(st_a["nat"]["relays"]) >= 1 and st_a["nat"]["relay_addrs"]  # still reachable via relays
        assert st_boot["nat"]["relay_service"] == "serving"

    def test_the_readable_status_shows_reachability_and_each_peers_path(self, home_swarm: NatSwarm) -> None:
        a, b = home_swarm.a, home_swarm.b
        a.wait(lambda s: path_to(s, b.peer_id) == "hole-punched", timeout=120, what="B hole-punched")
        a.wait(lambda s: all(p["rtt_ms"] is not None for p in s["peers"]), timeout=30, what="RTTs")

        text = cli_status(a, as_json=False)
        assert re.search(r"\breachability private\b", text), text
        assert re.search(r"^\s+peer\s+path\s+rtt_ms\s*$", text, re.M), text
        assert re.search(rf"^\s+{re.escape(short_id(b.peer_id))}\s+hole-punched\s+\d+\.\d\s*$", text, re.M), (
            text
        )
        for public in (home_swarm.boot, home_swarm.relay, home_swarm.pub):
            assert re.search(
                rf"^\s+{re.escape(short_id(public.peer_id))}\s+direct\s+\d+\.\d\s*$", text, re.M
            ), text
        assert re.search(r"\breachability public\b", cli_status(home_swarm.boot, as_json=False))


# --------------------------------------------------------------------------------------------------
# Hostile NATs: relayed for control only
# --------------------------------------------------------------------------------------------------


def test_behind_hostile_nats_trainers_stay_relayed_and_average_only_with_the_public_trainer(
    lab: Lab, tmp_path: Path
) -> None:
    swarm = start_nat_swarm(lab, tmp_path, "hostile")
    a, b, pub = swarm.a, swarm.b, swarm.pub
    for node in (a, b):  # the NAT answered the dial-back helpers with RST
        st = node.wait(
            lambda s: s["reachability"] == "private", timeout=60, what="reachability private"
        )
        assert "refused" in st["nat"]["reachability_reason"], st["nat"]

    # They meet through the relay, the punch fails, and the status says why.
    punch_failed = re.compile(
        rf"^hole punching to {re.escape(short_id(b.peer_id))} failed: .* answered with RST .*; staying relayed$"
    )
    a.wait(
        lambda s: (
            path_to(s, b.peer_id) == "relayed" and punch_failed.match(peer_note(s, b.peer_id)) is not None
        ),
        timeout=90,
        what="B relayed, with a note on the failed hole punch",
    )
    a.wait(
        lambda s: punch_failed.match(s["nat"]["reason"]) is not None,
        timeout=60,
        what="the NAT reason naming the failed punch",
    )
    b.wait(lambda s: path_to(s, a.peer_id) == "relayed", timeout=30, what="A relayed")
    # Control traffic does flow over the relay: pings measure an RTT there.
    a.wait(
        lambda s: (peer_row(s, b.peer_id) or {}).get("rtt_ms") is not None, timeout=30, what="RTT to B"
    )

    # Both train by averaging with the public trainer (once each trains: a late join's download and a
    # worker's start take their time on a loaded 2-core machine, and are not what this test is about) ...
    for node in (a, b):
        node.wait(lambda s: (s.get("training") or {}).get("state") == "training", timeout=120, what="training")
    for node in (a, b):
        node.wait(lambda s: rounds_with(s, pub.peer_id) >= 3, timeout=90, what="rounds with pub")
    # ... and never with each other: tensors do not cross the relay.
    st_a, st_b = a.status(), b.status()
    assert st_a is not None and st_b is not None
    assert rounds_with(st_a, b.peer_id) == 0 and rounds_with(st_b, a.peer_id) == 0
    assert path_to(st_a, b.peer_id) == "relayed" and path_to(st_b, a.peer_id) == "relayed"
    assert st_a["training"]["exchanges"]["group"] >= 3
