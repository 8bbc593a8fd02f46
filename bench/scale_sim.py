"""Membership and pairing at 1,000 and 10,000 nodes, in-process: issue #24's simulation.

The real SWIM core (node/swarm/membership.py) on a simulated network (starling_testing/swim_sim.py: one-way
latency uniform in 20-200 ms, 1% of messages lost), every node holding a full view. The swarm starts
converged (every node knows every other: what a swarm looks like after its joins), warms up, and then runs
``--minutes`` simulated minutes with ``--churn`` of the nodes crashing each minute and as many fresh nodes
joining through a random live seed. Every node is a trainer that takes an outer step every ``--outer-s``
seconds (at its own phase) and publishes its progress.

Figures, per swarm size:
- membership messages and payload bytes each node sends per minute (mean, p99 over the nodes that lived
  through the window), and the bytes by message type;
- time for a death to reach 99% of the nodes that outlive the measurement, as *suspect or dead* (known) and
  as *dead* (confirmed), separately; time for a join to reach 99% (median and worst over the tracked events);
- progress: the share of (observer, member) pairs where the observer holds some progress of the member, and
  how many outer steps behind it is (a sample of observers at the end);
- pairing: at each outer step, a sample of trainers each computes its partner from *its own* view with
  `node.averaging.pairing.scheduled_partner(me, others, round_no)` (no speeds: equal machines), and the
  step counts as agreed when the partner's own view gives it back; distinct agreed partners per sampled
  trainer over the run; and the mixing the schedule intends on the true member list at the end, over 20
  outer steps: distinct partners per node and the spectral gap of the averaged pairing graph (1 - the
  second eigenvalue of mean (I + P_t) / 2, by power iteration).

Usage: python bench/scale_sim.py [--nodes 1000,10000] [--minutes 1.5] [--seed 1] [--churn 0.01]
                                 [--outer-s 30] [--sample 200] [--write-docs]
About 30 s at 1,000 nodes and 9 min at 10,000 for the default 2 simulated minutes (30 s warm-up + 1.5) on one
core; ~4.5 GB of RAM at 10,000 (every node's full view, and its broadcast queues once they fill).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import resource
import sys
import time
from array import array
from pathlib import Path

import numpy as np

from node.averaging.pairing import BYE, matching, scheduled_partner
from node.swarm.membership import ALIVE, DEAD, SUSPECT, UNKNOWN, MembershipConfig
from starling_testing.report import publish
from starling_testing.swim_sim import SimNet

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
SECTION = "## Scale: simulation"
WARMUP_S = 30.0
TRACK_EVENTS = 40  # deaths and joins followed, each
TAIL_S = 60.0  # events in the last minute are not followed (no time to spread)
WINDOW = 20  # outer steps over which the schedule's mixing is measured


class Tracker:
    """First times each observer held a followed member suspect-or-dead / dead / alive (hook of SimNet)."""

    def __init__(self) -> None:
        self.deaths: dict[int, tuple[float, int, array, array, array, array]] = {}
        self.joins: dict[int, tuple[float, int, array, array]] = {}

    def hook(self, observer: int, member: int, old: int, new: int, now: float) -> None:
        d = self.deaths.get(member)
        if d is not None and observer < d[1]:
            if old == ALIVE and new in (SUSPECT, DEAD):
                d[2].append(observer)
                d[3].append(now)
            if new == DEAD:
                d[4].append(observer)
                d[5].append(now)
            return
        j = self.joins.get(member)
        if j is not None and observer < j[1] and old == UNKNOWN and new == ALIVE:
            j[2].append(observer)
            j[3].append(now)


def _t99(t0: float, observers: array, times: array, eligible: set[int]) -> float:
    """Seconds until 99% of ``eligible`` observers knew (inf if they never did)."""
    first: dict[int, float] = {}
    for o, t in zip(observers, times, strict=True):
        if o in eligible and o not in first:
            first[o] = t
    need = math.ceil(0.99 * len(eligible))
    if need == 0 or len(first) < need:
        return math.inf
    return sorted(first.values())[need - 1] - t0


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, int(math.ceil(q * len(s))) - 1)]


def _view(net: SimNet, pid: int, cache: dict[int, list[str]]) -> list[str]:
    """The names of the members ``pid`` holds (itself left out), computed once per outer step."""
    if pid not in cache:
        cache[pid] = [net.registry.name(m) for m in net.nodes[pid].members() if m != pid]
    return cache[pid]


def _spectral_gap(graphs: list[np.ndarray], iters: int = 300, seed: int = 0) -> float:
    """1 - lambda_2 of mean_t (I + P_t) / 2, P_t a matching given as a partner index array (self: none)."""
    n = len(graphs[0])
    rng = np.random.default_rng(seed)
    v = rng.standard_normal(n)
    lam = 0.0
    for _ in range(iters):
        v -= v.mean()
        norm = np.linalg.norm(v)
        if norm == 0:
            return math.nan
        v /= norm
        w = sum((v + v[p]) / 2 for p in graphs) / len(graphs)
        lam = float(np.dot(v, w))
        v = w
    return 1.0 - lam


def run(n: int, minutes: float, seed: int, churn: float, outer_s: float, sample: int) -> dict:
    wall0 = time.time()
    tracker = Tracker()
    net = SimNet(seed=seed, config=MembershipConfig(), hook=tracker.hook)
    rng = random.Random(seed + 1)
    ids = net.start(n)
    names = net.registry
    live = set(ids)
    steps = {pid: 0 for pid in ids}
    phase = {pid: rng.randrange(int(outer_s)) for pid in ids}
    end = WARMUP_S + minutes * 60.0
    churn_every = 60.0 / (churn * n) if churn > 0 else math.inf
    next_churn = WARMUP_S + churn_every
    joined = 0
    pair_checks = pair_agreed = pair_byes = 0
    partners_seen: dict[int, set[int]] = {}
    sampled = rng.sample(ids, min(sample, n))
    base_msgs = base_bytes = None
    round_no = 0
    next_round = WARMUP_S + outer_s
    t = 0.0
    while t < end:
        t = min(t + 1.0, end)
        net.run_until(t)
        if t % 60 == 0:
            print(f"  {n} nodes: {t:.0f} of {end:.0f} simulated s after {time.time() - wall0:.0f} s",
                  file=sys.stderr, flush=True)
        # Trainers whose outer step falls in this second publish their progress.
        for pid in list(live):
            if int(t) % int(outer_s) == phase[pid]:
                steps[pid] += 1
                node = net.nodes[pid]
                node.set_progress(steps[pid], 3.0 / math.sqrt(1 + steps[pid]), 100.0, net.now)
                net.poke(pid)
        if base_msgs is None and t >= WARMUP_S:
            base_msgs, base_bytes = dict(net.sent_msgs), dict(net.sent_bytes)
            base_types = dict(net.bytes_by_type)
        while t >= next_churn and next_churn < end:
            victim = rng.choice(sorted(live))
            live.discard(victim)
            net.kill(victim)
            if len(tracker.deaths) < TRACK_EVENTS and next_churn < end - TAIL_S:
                tracker.deaths[victim] = (net.now, len(names), array("I"), array("d"), array("I"), array("d"))
            seed_pid = rng.choice(sorted(live))
            joined += 1
            pid = net.join(f"joiner{joined:06d}", seed_pid)
            live.add(pid)
            steps[pid] = max(steps.values())
            phase[pid] = rng.randrange(int(outer_s))
            if len(tracker.joins) < TRACK_EVENTS and next_churn < end - TAIL_S:
                tracker.joins[pid] = (net.now, len(names), array("I"), array("d"))
            next_churn += churn_every
        if t >= next_round:
            next_round += outer_s
            round_no += 1
            views: dict[int, list[str]] = {}
            for pid in sampled:
                if pid not in live:
                    continue
                me = names.name(pid)
                partner = scheduled_partner(me, _view(net, pid, views), round_no)
                if partner is BYE:
                    pair_byes += 1
                    continue
                pair_checks += 1
                other = names.intern(partner)
                if other in live and scheduled_partner(partner, _view(net, other, views), round_no) == me:
                    pair_agreed += 1
                    partners_seen.setdefault(pid, set()).add(other)
    window_min = (end - WARMUP_S) / 60.0
    survivors = [pid for pid in ids if pid in live]
    msgs = [(net.sent_msgs[p] - base_msgs[p]) / window_min for p in survivors]
    byts = [(net.sent_bytes[p] - base_bytes[p]) / window_min for p in survivors]
    by_type = {k: (v - base_types.get(k, 0)) / window_min / len(net.nodes) for k, v in net.bytes_by_type.items()}
    # Deaths and joins: 99% of the observers that were there at the event and lived to the end.
    suspect_t, dead_t, join_t = [], [], []
    for t0, bound, so, st, do, dt in tracker.deaths.values():
        eligible = {p for p in live if p < bound}
        suspect_t.append(_t99(t0, so, st, eligible))
        dead_t.append(_t99(t0, do, dt, eligible))
    for pid, (t0, bound, jo, jt) in tracker.joins.items():
        if pid in live:
            join_t.append(_t99(t0, jo, jt, {p for p in live if p < bound and p != pid}))
    # Progress: what a sample of observers holds of every live member's progress.
    held = behind = total = 0
    behinds: list[int] = []
    for obs in rng.sample(sorted(live), min(50, len(live))):
        node = net.nodes[obs]
        for m in live:
            if m == obs:
                continue
            total += 1
            p = node.progress_of(m)
            if p is not None:
                held += 1
                behinds.append(steps[m] - p.outer_step)
    behind = sum(behinds) / len(behinds) if behinds else math.nan
    # The schedule's mixing on the true member list at the end, over a window of WINDOW outer steps.
    truth = sorted(names.name(m) for m in live)
    index = {name: i for i, name in enumerate(truth)}
    graphs = []
    for r in range(round_no + 1, round_no + 1 + WINDOW):
        plan = matching(truth, r)
        graphs.append(np.array([index.get(plan.get(name) or name, i) for i, name in enumerate(truth)]))
    gap = _spectral_gap(graphs)
    per_node = np.stack(graphs, axis=1)
    distinct_window = [len(set(row.tolist()) - {i}) for i, row in enumerate(per_node)]
    distinct = [len(s) for s in partners_seen.values()]
    counters: dict[str, int] = {}
    for node in net.nodes.values():
        for k, v in node.counters.items():
            counters[k] = counters.get(k, 0) + v
    false_dead = sum(1 for obs in rng.sample(sorted(live), min(50, len(live)))
                     for m in live if net.nodes[obs].state_of(m) == DEAD)
    return {
        "nodes": n, "minutes": minutes, "churned": joined, "rounds": round_no,
        "msgs_mean": sum(msgs) / len(msgs), "msgs_p99": _pct(msgs, 0.99),
        "bytes_mean": sum(byts) / len(byts), "bytes_p99": _pct(byts, 0.99), "by_type": by_type,
        "suspect_t99": suspect_t, "dead_t99": dead_t, "join_t99": join_t,
        "progress_held": held / total if total else math.nan, "progress_behind": behind,
        "pair_checks": pair_checks, "pair_agreed": pair_agreed, "pair_byes": pair_byes,
        "distinct_partners": sum(distinct) / len(distinct) if distinct else 0.0,
        "distinct_of_rounds": round_no, "spectral_gap": gap, "false_dead_sample": false_dead,
        "window_distinct_mean": sum(distinct_window) / len(distinct_window),
        "window_distinct_min": min(distinct_window),
        "counters": counters, "wall_s": time.time() - wall0,
        "maxrss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


NOTES = (
    "Reading it. Each message carries at most 16 claims / 2 KiB; membership news (joins, suspicions, deaths, "
    "refutations) goes first and progress fills the rest, so the bytes per node are the budget at every size "
    "and N changes only how much of the others' progress a node holds, and how fresh (the progress row). "
    "With churn a fixed share of N, the membership news each node must carry grows with N; the budget is "
    "sized for 10,000 at 1% a minute, and a larger swarm would need a larger budget or partial views. "
    "Push-pull exchanges a 32-entry slice every 30 s (bounded, unlike memberlist's full-state push-pull); "
    "joiners page through the table by hash bucket, a different member per page (the `SyncReply` row). "
    "The pairing rows call `node.averaging.pairing.scheduled_partner` as merged (its rule: section "
    "\"Tolerating different member lists\"), each trainer on the member list its own SWIM view holds, so "
    "they measure the two together under churn."
)


def _fmt_t(values: list[float]) -> str:
    if not values:
        return "-"
    finite = [v for v in values if math.isfinite(v)]
    worst = max(values)
    med = _pct(values, 0.5)
    w = "never" if not math.isfinite(worst) else f"{worst:.1f} s"
    m = "never" if not math.isfinite(med) else f"{med:.1f} s"
    return f"{m} median, {w} worst ({len(finite)}/{len(values)} reached 99%)"


def render(results: list[dict], command: str, churn: float, outer_s: float, sample: int) -> str:
    head = "| | " + " | ".join(f"{r['nodes']:,} nodes" for r in results) + " |"
    sep = "|---|" + "---|" * len(results)

    def row(label: str, f) -> str:
        return f"| {label} | " + " | ".join(f(r) for r in results) + " |"

    kinds = sorted({k for r in results for k in r["by_type"]})
    lines = [
        SECTION, "",
        f"Command: `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
        f"{platform.machine()}, Python {platform.python_version()}). The SWIM membership core "
        "(node/swarm/membership.py, default settings: 1 s protocol period, 3 indirect probes, Lifeguard suspicion "
        "4 x log10 N periods at its shortest) in an in-process network (starling_testing/swim_sim.py): one-way "
        "latency uniform in 20-200 ms, 1% of messages lost, every node holding a full view. The swarm starts "
        f"converged, warms up {WARMUP_S:.0f} s, then runs the simulated minutes below with {churn:.0%} of the "
        f"nodes crashing per minute and as many fresh ones joining through a random live seed. Every node is a "
        f"trainer with an outer step every {outer_s:.0f} s (own phase) that publishes its progress. Bytes are "
        "message payloads as the wire would carry them (38-byte peer IDs, 64-byte signatures on every claim), "
        "without stream framing or TCP/IP headers. Deaths and joins: the first "
        f"{TRACK_EVENTS} of each, not in the last minute; 99% of the nodes that were there and lived to the end.",
        "", head, sep,
        row("simulated minutes (after warm-up) / wall-clock s", lambda r: f"{r['minutes']:g} / {r['wall_s']:.0f}"),
        row("nodes churned (crashed and joined)", lambda r: f"{r['churned']}"),
        row("membership messages sent per node per minute: mean / p99",
            lambda r: f"{r['msgs_mean']:.0f} / {r['msgs_p99']:.0f}"),
        row("payload bytes sent per node per minute: mean / p99",
            lambda r: f"{r['bytes_mean'] / 1024:.1f} KiB / {r['bytes_p99'] / 1024:.1f} KiB"),
    ]
    for k in kinds:
        lines.append(row(f"... of which `{k}` (KiB per node per minute)",
                         lambda r, k=k: f"{r['by_type'].get(k, 0.0) / 1024:.1f}"))
    lines += [
        row("a death known to 99% (suspect or dead)", lambda r: _fmt_t(r["suspect_t99"])),
        row("a death confirmed by 99% (dead)", lambda r: _fmt_t(r["dead_t99"])),
        row("a join known to 99% (alive)", lambda r: _fmt_t(r["join_t99"])),
        row("progress: share of members whose progress a node holds / outer steps behind (mean)",
            lambda r: f"{r['progress_held']:.0%} / {r['progress_behind']:.1f}"),
        row(f"outer steps where scheduled partners agreed ({sample} sampled trainers per step, "
            "`scheduled_partner` on each one's own view)",
            lambda r: f"{r['pair_agreed'] / max(1, r['pair_checks']):.1%} of {r['pair_checks']}"),
        row("distinct agreed partners per sampled trainer over the run", lambda r: f"{r['distinct_partners']:.1f} "
            f"in {r['distinct_of_rounds']} steps"),
        row(f"the schedule on the true member list, over {WINDOW} outer steps: distinct partners per node "
            "(mean / least), spectral gap of the averaged pairing graph",
            lambda r: f"{r['window_distinct_mean']:.1f} / {r['window_distinct_min']} / {r['spectral_gap']:.3f}"),
        row("live members a sample of 50 nodes holds dead at the end (false deaths)",
            lambda r: f"{r['false_dead_sample']}"),
        row("peak RSS of the simulation", lambda r: f"{r['maxrss_gb']:.1f} GB"),
        "",
        NOTES,
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1000,10000", help="swarm sizes, comma-separated (default 1000,10000)")
    parser.add_argument("--minutes", type=float, default=1.5,
                        help="simulated minutes after warm-up (default 1.5: the 10,000-node run takes ~9 min)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--churn", type=float, default=0.01, help="share of nodes replaced per minute (0.01)")
    parser.add_argument("--outer-s", type=int, default=30, help="seconds per outer step (default 30)")
    parser.add_argument("--sample", type=int, default=200, help="trainers checked per outer step (default 200)")
    parser.add_argument("--write-docs", action="store_true", help=f"write `{SECTION}` of docs/benchmarks.md")
    args = parser.parse_args()
    sizes = [int(s) for s in args.nodes.split(",") if s.strip()]
    if not sizes or min(sizes) < 8 or args.minutes <= 0 or not 0 <= args.churn < 1:
        parser.error("need --nodes >= 8 each, --minutes > 0, 0 <= --churn < 1")
    results = []
    for n in sizes:
        r = run(n, args.minutes, args.seed, args.churn, args.outer_s, args.sample)
        print(f"{n} nodes: {r['msgs_mean']:.0f} msgs/min, {r['bytes_mean'] / 1024:.1f} KiB/min per node; "
              f"wall {r['wall_s']:.0f} s; counters {r['counters']}", file=sys.stderr, flush=True)
        results.append(r)
    command = "python bench/scale_sim.py " + " ".join(sys.argv[1:])
    text = render(results, command.strip(), args.churn, args.outer_s, args.sample)
    publish(text, DOCS, SECTION, write=args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
