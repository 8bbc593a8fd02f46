"""How long N local daemons take to become fully connected through DHT discovery.

Starts one bootstrap daemon, then N-1 daemons that know only the bootstrap address, all as separate
processes on 127.0.0.1, and records two moments for the swarm: every node has *discovered* every other
one (DHT provider lookups), and every node is *connected* to every other one. `node.target_peers` is set
to N-1 so that a full mesh is the goal (the default target of 8 would stop short of it at N = 16).

Usage: python bench/discovery.py [--sizes 8 16] [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from node.ops.launcher import stop_all
from starling_testing.daemon import DaemonProc
from starling_testing.report import replace_section


def run_once(n: int, root: Path, timeout: float = 120.0) -> dict[str, float]:
    daemons: list[DaemonProc] = []
    homes = [root / f"n{i}" for i in range(n)]
    common = ["--no-train", "--listen", "/ip4/127.0.0.1/tcp/0", "--swarm", f"bench{n}",
              "--set", f"node.target_peers={min(32, n - 1)}", "--log-level", "warning"]

    def spawn(home: Path, extra: list[str]) -> DaemonProc:
        d = DaemonProc(home, [*common, *extra]).start(log=home / "log", append_log=False, stdout_to_log=False)
        daemons.append(d)
        return d

    try:
        boot = spawn(homes[0], []).wait(lambda s: bool(s["addrs"]), timeout, "a listen address", 0.1)["addrs"][0]
        t0 = time.monotonic()
        for home in homes[1:]:
            spawn(home, ["--bootstrap", boot])
        t_discovered = t_connected = None
        while time.monotonic() - t0 < timeout and (t_connected is None or t_discovered is None):
            sts = [d.status(timeout=5) for d in daemons]
            if all(sts):
                ids = {s["peer_id"] for s in sts}
                # A node knows a member once the member's signed record reached it (DHT lookups, gossip or
                # anti-entropy: whichever came first).
                if t_discovered is None and all(
                    ids - {s["peer_id"]} <= {m["peer_id"] for m in s.get("members", []) if m["state"] == "alive"}
                    for s in sts
                ):
                    t_discovered = time.monotonic() - t0
                if t_connected is None and all(ids - {s["peer_id"]} <= set(s["connected_peers"]) for s in sts):
                    t_connected = time.monotonic() - t0
            time.sleep(0.2)
        if t_discovered is None and all(sts):
            print("  alive members known per node:",
                  [sum(m["state"] == "alive" for m in s.get("members", [])) for s in sts], flush=True)
        return {"n": n, "discovered_s": t_discovered or float("nan"), "connected_s": t_connected or float("nan")}
    finally:
        stop_all(daemons)


def write_docs(rows: list[dict[str, float]], command: str) -> None:
    path = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
    section = ["## Discovery", "",
               f"`{command}` on {os.cpu_count()} cores ({platform.machine()}), {time.strftime('%Y-%m-%d')}.",
               "Daemons start together (processes, loopback), only the bootstrap address is given; time from start "
               "until every node knows every other as an alive member (its signed record arrived, by whichever "
               "path), and until the mesh is complete. `node.target_peers` = N-1.", "",
               "| daemons | all members known (s) | fully connected (s) |", "|---|---|---|"]
    section += [f"| {r['n']} | {r['discovered_s']:.1f} | {r['connected_s']:.1f} |" for r in rows]
    replace_section(path, "## Discovery", "\n".join(section) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 16])
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()
    rows = []
    for n in args.sizes:
        root = Path(tempfile.mkdtemp(prefix=f"starling-disc{n}-"))
        try:
            r = run_once(n, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        rows.append(r)
        print(f"{n:3d} daemons: all members known in {r['discovered_s']:.1f}s, fully connected in {r['connected_s']:.1f}s",
              flush=True)
    if args.write_docs:
        write_docs(rows, "python bench/discovery.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
