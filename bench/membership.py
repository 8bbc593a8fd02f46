"""The swarm's own traffic: what a daemon that only keeps up membership sends, by protocol.

Starts one bootstrap daemon and N-1 daemons that know only its address, all network-only (`--no-train`)
processes on 127.0.0.1, lets them settle (connections, the DHT's first rounds, the first state sessions),
then counts for `--seconds` what each sends: bytes per negotiated protocol (gossipsub, the DHT, state
sessions, ...), Yamux frames (on a real link, about one TCP segment each, with its headers and an ACK)
and how many of them are window updates, and bytes on the TCP connections (after Noise and Yamux). The
counters are bench/traffic_probe/sitecustomize.py, loaded into each daemon through its PYTHONPATH.

Why it matters: on a slow link this traffic competes with every exchange, and it does not shrink with the
model (docs/benchmarks.md, "Over slow links"). Run it against other code from that tree's directory (the
daemons run ``python -m node.cli``, which looks in the working directory first):
``cd /path/to/old/tree && PYTHONPATH=$PWD python /path/to/bench/membership.py``.

Usage: python bench/membership.py [--nodes 5] [--settle 20] [--seconds 60] [--set SECTION.OPTION=VALUE ...]
                                  [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from node.config.home import Home
from node.ops.launcher import stop_all
from p2p.identity import create_identity, peer_id_of
from starling_testing.daemon import DaemonError, DaemonProc, free_port
from starling_testing.report import publish

PROBE = Path(__file__).resolve().parent / "traffic_probe"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
SECTION = "## The swarm's own traffic"
SUMMARY = ("tcp bytes", "frames", "window updates", "gossip rpcs with a peer record")


class LoopbackSwarm:
    """Network-only daemons on 127.0.0.1 with the traffic probe loaded, for this bench and bench/scale.py.

    Each daemon's identity is made here and its port picked here before it starts, so that every
    daemon's full address (``/ip4/127.0.0.1/tcp/PORT/p2p/ID``) is known without asking anyone, and a
    daemon can be given the addresses of others that have not started yet (they retry with back-off).
    A daemon listens once its ``node.addr_file`` exists: a file check, where polling ``status`` would cost
    the daemons CPU. Restarting one (:meth:`restart`) keeps its HOME, identity and port, as a restarted
    node does.
    """

    def __init__(self, root: Path, swarm: str, sets: list[str] = [], *, probe: bool = True,  # noqa: B006
                 env: dict[str, str] | None = None) -> None:
        self.root = root
        self.swarm = swarm
        self.sets = list(sets)
        self.probe = probe
        self.env = dict(env or {})
        self.daemons: dict[int, DaemonProc] = {}
        self.addrs: dict[int, str] = {}
        self.bootstrap: dict[int, list[str]] = {}

    def addr(self, i: int) -> str:
        """Daemon ``i``'s address (its identity and port are made on first use)."""
        if i not in self.addrs:
            key = create_identity(Home(self.root / f"n{i}").identity)
            self.addrs[i] = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{peer_id_of(key)}"
        return self.addrs[i]

    def spawn(self, i: int, bootstrap: list[str], log_level: str = "warning") -> DaemonProc:
        """Start daemon ``i``, given ``bootstrap`` addresses; does not wait."""
        self.bootstrap[i] = list(bootstrap)
        home, listen = self.root / f"n{i}", self.addr(i).rsplit("/p2p/", 1)[0]
        (home / "addr").unlink(missing_ok=True)
        args = ["--no-train", "--listen", listen, "--swarm", self.swarm, "--log-level", log_level,
                "--addr-file", str(home / "addr"), *(a for b in bootstrap for a in ("--bootstrap", b)),
                *(a for s in self.sets for a in ("--set", s))]
        env = dict(self.env)
        if self.probe:
            env["PYTHONPATH"] = os.pathsep.join([str(PROBE), *filter(None, [os.environ.get("PYTHONPATH")])])
            env["STARLING_TRAFFIC_OUT"] = str(self.root / f"n{i}.json")
        d = DaemonProc(home, args, env).start(log=self.root / f"n{i}.log", append_log=True)
        self.daemons[i] = d
        return d

    def restart(self, i: int) -> DaemonProc:
        return self.spawn(i, self.bootstrap[i])

    def listening(self, i: int) -> bool:
        return (self.root / f"n{i}" / "addr").exists()

    def wait_listening(self, indices: list[int], timeout: float) -> None:
        """Wait until every daemon in ``indices`` listens; DaemonError if one exits or the time runs out."""
        deadline = time.monotonic() + timeout
        waiting = list(indices)
        while waiting:
            for i in [i for i in waiting if self.listening(i)]:
                waiting.remove(i)
            for i in waiting:
                if self.daemons[i].exited():
                    raise DaemonError(f"n{i}: daemon exited before listening\n{self.daemons[i].tail()}")
            if waiting and time.monotonic() > deadline:
                raise DaemonError(f"{len(waiting)} daemons not listening within {timeout:.0f} s (n{waiting[0]} first)")
            time.sleep(0.2)

    def traffic(self, i: int) -> dict:
        """Daemon ``i``'s probe counters: ``{"t": monotonic seconds, "counts": {...}}``."""
        return json.loads((self.root / f"n{i}.json").read_text())

    def stop(self) -> None:
        stop_all(self.daemons.values())


def measure(n: int, settle: float, seconds: float, sets: list[str], root: Path) -> dict[str, float]:
    """Per-host means over the N daemons: each counter's increase per second over the window."""
    swarm = LoopbackSwarm(root, f"traffic{n}", sets)
    try:
        swarm.spawn(0, [])
        swarm.wait_listening([0], 60)
        for i in range(1, n):
            swarm.spawn(i, [swarm.addr(0)])
        swarm.wait_listening(list(range(n)), 120)
        time.sleep(settle)
        before = [swarm.traffic(i) for i in range(n)]
        time.sleep(seconds)
        after = [swarm.traffic(i) for i in range(n)]
        alive = [sum(m["state"] == "alive" for m in (d.status(timeout=5) or {}).get("members", []))
                 for d in swarm.daemons.values()]
    finally:
        swarm.stop()
    rates: dict[str, float] = {}
    for b, a in zip(before, after, strict=True):
        dt = a["t"] - b["t"]
        for key, value in a["counts"].items():
            rates[key] = rates.get(key, 0.0) + (value - b["counts"].get(key, 0)) / dt / n
    rates["alive members known (min)"] = float(min(alive))
    return rates


def render(rates: dict[str, float], n: int, command: str) -> str:
    protocols = sorted((k for k in rates if k.startswith("bytes ")), key=lambda k: -rates[k])
    lines = [SECTION, "",
             f"Command: `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
             f"{platform.machine()}). {n} network-only daemons on 127.0.0.1 (one bootstrap node, the others given "
             "only its address), default settings; what each sends per second once settled, mean over the "
             "daemons. Frames are Yamux frames: on a real link about one TCP segment each (plus its headers, "
             "~66 bytes, and an ACK from the other end). The TCP bytes are what Noise and Yamux put on the "
             "connection; link-level figures (bench/wan.py) add the TCP/IP headers.", "",
             "| sent per daemon | per second |", "|---|---|"]
    for key in SUMMARY:
        unit = " B" if key == "tcp bytes" else ""
        lines.append(f"| {key} | {rates.get(key, 0.0):,.0f}{unit} |")
    for key in protocols:
        protocol = key.removeprefix("bytes ")
        lines.append(f"| `{protocol}` | {rates[key]:,.0f} B in {rates.get('writes ' + protocol, 0.0):.1f} writes |")
    lines.append(f"| members alive in each daemon's table at the end (least; itself included) | "
                 f"{rates['alive members known (min)']:.0f} of {n} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=5, help="daemons, the bootstrap node included (default 5)")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds before counting (default 20)")
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds counted (default 60)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.OPTION=VALUE",
                        help="a config option for every daemon, as `starling run --set`")
    parser.add_argument("--write-docs", action="store_true", help=f"write `{SECTION}` of docs/benchmarks.md")
    args = parser.parse_args()
    if args.nodes < 2 or args.seconds <= 0 or args.settle < 0:
        parser.error("need --nodes >= 2, --seconds > 0 and --settle >= 0")
    command = "python bench/membership.py " + " ".join(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="starling-traffic-") as tmp:
        rates = measure(args.nodes, args.settle, args.seconds, args.set, Path(tmp))
    text = render(rates, args.nodes, command.strip())
    publish(text, DOCS, SECTION, write=args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
