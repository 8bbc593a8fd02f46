"""What one averaging exchange costs in round trips (section "An exchange's round trips" of docs/benchmarks.md).

Two network-lab hosts, each link holding packets RTT/4 each way (so RTT between them; the lab's delay line,
starling_testing/delayline.py), run protocols/avg.py's exchange as paired daemons do
(starling_testing/exchange_lab.py): one libp2p connection, then `--exchanges` exchanges of a tiny model
(1,000 parameters: an empty exchange, its fixed cost alone), 0.5 s apart. Reported per RTT: the first
exchange (the side channel dialled after the answer) and the median of the later ones (dialled with the
request, to the port of the last answer), in seconds and in round trips, with the phases' ends: the
stream's protocol chosen, the answer, the result. Issue #50's bar: an empty exchange at most 3 RTT + 50 ms
at 100 and 300 ms.

`--before REF` runs the same harness against a checkout of REF (a git worktree under /tmp, removed after)
in the same run and the same lab, for the figures before and after side by side.

Run as root: ``make bench-exchange-rtt`` (about 2 minutes; `--before` doubles it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from starling_testing import exchange_lab  # noqa: E402
from starling_testing.netlab import Host, Lab, bench_exit_code  # noqa: E402
from starling_testing.report import publish  # noqa: E402

DOCS = ROOT / "docs" / "benchmarks.md"
SECTION = "## An exchange's round trips"
PATHS = [(0, 0, 0.0), (100, 0, 0.0), (300, 0, 0.0), (300, 50, 0.01)]  # rtt ms, jitter ms, loss each way


def run_tree(lab: Lab, a: Host, b: Host, tree: Path, port: int, exchanges: int) -> list[dict]:
    """The harness's lines from one responder/initiator pair whose code comes from `tree`."""
    harness = Path(tempfile.mkdtemp(prefix="exchange-lab-")) / "exchange_lab.py"
    shutil.copy(exchange_lab.__file__, harness)  # run by path, so `tree` alone is on the import path
    env = {"PYTHONPATH": str(tree)}
    try:
        responder = lab._spawn(b, [sys.executable, str(harness), "respond", str(port)], log=None, env=env, cwd=tree)
        peer = responder.wait_for(exchange_lab.READY + r" (\S+)", timeout=120)[1]
        initiator = lab._spawn(a, [sys.executable, str(harness), "initiate", str(b.ip), str(port), peer, "1000",
                                   str(exchanges)], log=None, env=env, cwd=tree)  # fmt: skip
        initiator.wait(60 + exchanges * 30)
        responder.stop()
        return [json.loads(line[len(exchange_lab.RESULT):]) for line in initiator.output().splitlines()
                if line.startswith(exchange_lab.RESULT)]  # fmt: skip
    finally:
        shutil.rmtree(harness.parent, ignore_errors=True)


def row(label: str, rtt_ms: float, results: list[dict]) -> str:
    good = [r for r in results if "seconds" in r]
    errors = len(results) - len(good)
    if not good:
        return f"| {label} | - | - | - | - | {errors} |"
    rtt = rtt_ms / 1000

    def cell(rs: list[dict]) -> str:
        if not rs:
            return "-"
        med = statistics.median(r["seconds"] for r in rs)
        phases = "/".join(f"{statistics.median(r[k] for r in rs) * 1000:.0f}" for k in ("stream_s", "answer_s"))
        rts = f", {med / rtt:.2f} RTT" if rtt else ""
        return f"{med * 1000:.0f} ms{rts} (stream/answer at {phases} ms)"

    later = good[1:]
    bar = "-"
    if rtt and later:
        med = statistics.median(r["seconds"] for r in later)
        limit = 3 * rtt + 0.05
        bar = f"met ({med * 1000:.0f} <= {limit * 1000:.0f} ms)" if med <= limit else \
            f"NOT met ({med * 1000:.0f} > {limit * 1000:.0f} ms)"
    return f"| {label} | {cell(good[:1])} | {cell(later)} | {bar} | {sum(r.get('preconnected', False) for r in good)} | {errors} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exchanges", type=int, default=6, help="exchanges per path (the first dials late)")
    parser.add_argument("--before", default=None, metavar="REF", help="also run the harness on a checkout of REF")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    if (code := bench_exit_code()) is not None:
        return code
    if args.exchanges < 2:
        parser.error("--exchanges: at least 2 (the first one dials after the answer)")
    trees: list[tuple[str, Path]] = [("this tree", ROOT)]
    worktree = None
    if args.before:
        worktree = Path(tempfile.mkdtemp(prefix="exchange-before-"))
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), args.before],
                       check=True, capture_output=True, timeout=60)  # fmt: skip
        trees.append((f"before ({args.before})", worktree))
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          timeout=10).stdout.strip()  # fmt: skip
    command = "python bench/exchange_rtt.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    lines = [SECTION, "",
             f"`{command}` (`make bench-exchange-rtt`), {time.strftime('%Y-%m-%d')}, tree {head}, on this 2-core "
             "machine. Two lab hosts, each link holding packets RTT/4 each way (the lab's delay line), run the "
             f"averaging exchange as paired daemons do over one libp2p connection: {args.exchanges} exchanges of "
             "1,000 parameters (the fixed cost alone), 0.5 s apart. First: the side channel dialled after the "
             "answer; later: dialled with the request to the port of the last answer (median). Stream/answer: "
             "when the stream's protocol was chosen and when the answer came, from the exchange's start. "
             "Issue #50's bar: at most 3 RTT + 50 ms.", "",
             "| path, code | first exchange | later exchanges | <= 3 RTT + 50 ms | dialled early | failed |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    try:
        with Lab() as lab:
            a, b = lab.public_host("a"), lab.public_host("b")
            for rtt, jitter, loss in PATHS:
                for host in (a, b):
                    if rtt or loss:
                        lab.limit(host, None, delay_ms=rtt / 4, jitter_ms=jitter / 4, loss=1 - (1 - loss) ** 0.5)
                    else:
                        lab.unlimit(host)
                path = f"{rtt} ms" + (f" +- {jitter} ms, {loss:.0%} loss each way" if jitter or loss else "")
                for k, (label, tree) in enumerate(trees):
                    results = run_tree(lab, a, b, tree, 4100 + k, args.exchanges)
                    lines.append(row(f"{path}, {label}", rtt, results))
                    print(lines[-1], flush=True)
    finally:
        if worktree is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)],
                           capture_output=True, timeout=60, check=False)  # fmt: skip
    lines.append("")
    publish("\n".join(lines), DOCS, SECTION, write=args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
