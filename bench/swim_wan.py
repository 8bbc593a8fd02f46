"""Membership over the internet as it is: SWIM with real daemons behind long, jittery, lossy links (issue #50, part 4).

One bootstrap daemon and N-1 others (`starling run --no-train`, shipped defaults), each in its own network-lab
host whose link holds every packet RTT/4 (+- jitter/4) each way and loses each one with the chance that makes a
member-to-member path lose `--loss` each way (starling_testing/delayline.py: the kernel has no netem), so that
between two members the round trip is `--rtt-ms`. Measured:

1. the join: from the last start until every daemon holds every other as an alive member;
2. then `--minutes` of steady state, with a status round every `--poll` seconds: members shown suspect in
   any view at any poll, and, read once at the end from each daemon's `swim.recent_suspects` and
   `swim.suspects_seen`, the suspicions raised and refuted between polls; probes, indirect probes and the
   stretched waits (SWIM's waits learned from answers). The bar: no member that is alive shown suspect.

Run as root: ``make bench-swim-wan`` (16 daemons at 300 ms, 50 ms jitter, 1% loss for 10 minutes: about 13
minutes). Prints the section; ``--write-docs`` writes "Membership over long, lossy links" in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from starling_testing.daemon import PORT, LabDaemon, spawn_daemon, start_daemon  # noqa: E402
from starling_testing.netlab import Lab, bench_exit_code  # noqa: E402
from starling_testing.report import publish  # noqa: E402

DOCS = ROOT / "docs" / "benchmarks.md"
SECTION = "## Membership over long, lossy links"


def alive_view(status: dict[str, Any] | None) -> set[str]:
    """The members a daemon holds alive (its own record aside)."""
    if not status:
        return set()
    return {m["peer_id"] for m in status.get("members", []) if m.get("state") == "alive"} - {status.get("peer_id")}


def suspects(status: dict[str, Any] | None) -> set[str]:
    if not status:
        return set()
    return {m["peer_id"] for m in status.get("members", []) if m.get("state") == "suspect"}


def rss_mb(pid: int) -> float:
    """A daemon's resident memory (its process: `ip netns exec` execs into it), 0 where it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    return next((int(x.split()[1]) / 1024 for x in text.splitlines() if x.startswith("VmRSS:")), 0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--daemons", type=int, default=16)
    parser.add_argument("--rtt-ms", type=float, default=300.0)
    parser.add_argument("--jitter-ms", type=float, default=50.0)
    parser.add_argument("--loss", type=float, default=0.01, help="each way between two members (0.01 = 1%%)")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--poll", type=float, default=10.0, help="seconds between status rounds")
    parser.add_argument("--join-timeout", type=float, default=180.0)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    if (code := bench_exit_code()) is not None:
        return code
    if not 2 <= args.daemons <= 64:
        parser.error("--daemons: between 2 and 64")
    line = {"delay_ms": args.rtt_ms / 4, "jitter_ms": args.jitter_ms / 4, "loss": 1 - (1 - args.loss) ** 0.5}
    root = Path(tempfile.mkdtemp(prefix="swim-wan-"))
    command = "python bench/swim_wan.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    daemons: list[LabDaemon] = []
    shown: dict[str, set[str]] = {}  # member -> the daemons that showed it suspect at a poll
    try:
        with Lab(log_dir=root / "lab-logs") as lab, contextlib.ExitStack() as stop:
            stop.callback(lambda: [d.proc.stop() for d in daemons])
            hosts = [lab.public_host(f"m{i}") for i in range(args.daemons)]
            for host in hosts:
                lab.limit(host, None, **line)
            boot = start_daemon(hosts[0], root / "m0", ["--no-train", "--swarm", "wan"], name="m0", timeout=120)
            daemons.append(boot)
            join = ["--bootstrap", f"/ip4/{hosts[0].ip}/tcp/{PORT}/p2p/{boot.peer_id}"]
            for i, host in enumerate(hosts[1:], start=1):
                daemons.append(spawn_daemon(host, root / f"m{i}", ["--no-train", "--swarm", "wan", *join], name=f"m{i}"))
            t0 = time.monotonic()
            joined_s = None
            while time.monotonic() - t0 < args.join_timeout:
                time.sleep(2.0)
                views = [d.status(timeout=10.0) for d in daemons]
                for d, st in zip(daemons, views, strict=True):
                    for s in suspects(st):
                        shown.setdefault(s, set()).add(d.name)
                if all(len(alive_view(st)) == args.daemons - 1 for st in views):
                    joined_s = time.monotonic() - t0
                    break
            joined = f"{joined_s:.1f} s" if joined_s else f"NOT within {args.join_timeout:.0f} s"
            print(f"join: every view complete: {joined}", flush=True)
            join_shown = {k: set(v) for k, v in shown.items()}
            shown.clear()
            t1, rounds, incomplete = time.monotonic(), 0, 0
            while time.monotonic() - t1 < args.minutes * 60:
                time.sleep(args.poll)
                views = [d.status(timeout=15.0) for d in daemons]
                rounds += 1
                for d, st in zip(daemons, views, strict=True):
                    if st is None:
                        raise RuntimeError(f"{d.name} did not answer status:\n{d.tail()}")
                    for s in suspects(st):
                        shown.setdefault(s, set()).add(d.name)
                    incomplete += len(alive_view(st)) < args.daemons - 1
            end = [d.status(timeout=15.0) or {} for d in daemons]
            swim = [st.get("swim") or {} for st in end]
            since = time.time() - (time.monotonic() - t1)
            between = {p for s in swim for p, when in (s.get("recent_suspects") or {}).items() if when >= since}

            def total(key: str) -> int:
                return sum(int(s.get(key) or 0) for s in swim)

            rss = [rss_mb(d.proc.pid) for d in daemons]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    verdict = "met" if not shown and not between else "NOT met"
    text = "\n".join([
        SECTION, "",
        f"`{command}` (`make bench-swim-wan`), {started_at}, on this 2-core machine: {args.daemons} network-only "
        f"daemons (`starling run --no-train`, shipped defaults), one bootstrap node, each in its own lab host whose "
        f"link holds packets {args.rtt_ms / 4:g} ms (+- {args.jitter_ms / 4:g} ms) each way and loses "
        f"{line['loss']:.2%} of them: member to member {args.rtt_ms:g} ms of round trip (+- {args.jitter_ms:g} ms), "
        f"{args.loss:.1%} loss each way (the lab's delay line).", "",
        "| | |", "|---|---|",
        f"| join: every view complete | {joined} |",
        f"| members shown suspect in the join | {len(join_shown)} |",
        f"| steady state | {args.minutes:g} min, {rounds} status rounds of {args.daemons} ({incomplete} views incomplete) |",
        f"| members shown suspect at a poll | {len(shown)}{' (' + ', '.join(f'{k[-6:]} by {len(v)}' for k, v in shown.items()) + ')' if shown else ''} |",
        f"| members turned suspect between polls (`recent_suspects`) | {len(between)} |",
        f"| probes, indirect, acks (all daemons, since start) | {total('probes')}, {total('indirect_probes')}, {total('acks')} |",
        f"| suspicions raised, refutations, declared dead | {total('suspects_raised')}, {total('refutations')}, {total('declared_dead')} |",
        f"| waits stretched (answers learned slow) | {total('waits_stretched')}; answer wait per daemon median "
        f"{statistics.median(float(s.get('answer_wait_s') or 0) for s in swim):.2f} s |",
        f"| RSS per daemon, median | {statistics.median(rss) if rss else 0:.0f} MB |",
        "", f"No member that is alive shown suspect over the {args.minutes:g} minutes: **{verdict}**.", ""])  # fmt: skip
    publish(text, DOCS, SECTION, write=args.write_docs)
    return 0 if joined_s else 1


if __name__ == "__main__":
    sys.exit(main())
