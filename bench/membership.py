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

from node.ops.launcher import stop_all
from starling_testing.daemon import DaemonProc
from starling_testing.report import replace_section

PROBE = Path(__file__).resolve().parent / "traffic_probe"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
SECTION = "## The swarm's own traffic"
SUMMARY = ("tcp bytes", "frames", "window updates", "gossip rpcs with a peer record")


def measure(n: int, settle: float, seconds: float, sets: list[str], root: Path) -> dict[str, float]:
    """Per-host means over the N daemons: each counter's increase per second over the window."""
    path = os.pathsep.join([str(PROBE), *filter(None, [os.environ.get("PYTHONPATH")])])
    common = ["--no-train", "--listen", "/ip4/127.0.0.1/tcp/0", "--swarm", f"traffic{n}", "--log-level", "warning",
              *(arg for s in sets for arg in ("--set", s))]
    daemons: list[DaemonProc] = []

    def spawn(i: int, extra: list[str]) -> DaemonProc:
        home = root / f"n{i}"
        env = {"PYTHONPATH": path, "STARLING_TRAFFIC_OUT": str(root / f"n{i}.json")}
        d = DaemonProc(home, [*common, *extra], env).start(log=root / f"n{i}.log", append_log=False)
        daemons.append(d)
        return d

    def snapshot() -> list[dict]:
        return [json.loads((root / f"n{i}.json").read_text()) for i in range(n)]

    try:
        boot = spawn(0, []).wait(lambda s: bool(s["addrs"]), 60, "a listen address", 0.2)["addrs"][0]
        for i in range(1, n):
            spawn(i, ["--bootstrap", boot])
        for d in daemons:
            d.wait(lambda s: bool(s["addrs"]), 60, "a listen address", 0.2)
        time.sleep(settle)
        before = snapshot()
        time.sleep(seconds)
        after = snapshot()
        alive = [sum(m["state"] == "alive" for m in (d.status(timeout=5) or {}).get("members", [])) for d in daemons]
    finally:
        stop_all(daemons)
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
    print(text)
    if args.write_docs:
        replace_section(DOCS, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
