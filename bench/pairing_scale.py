"""Pairing as the swarm grows and member lists differ: the list-seeded permutation against the local trie rule.

Issue #24: each trainer computes the outer step's matching from its own member list, and lists differ while a
join or a death spreads. The rule before issue #24 (frozen below as `old_matching`, node/averaging/pairing.py
at commit 83301fd) seeded a permutation with the whole sorted list, so two lists one member apart gave
unrelated matchings. The landed rule (node/averaging/pairing.py) matches the members' per-step hashes through a
binary trie and changes only O(log2 N) partners per differing member. Both are measured here in one run.

Agreement: the share of nodes whose scheduled partner names them back (node/ops/islands.py, `mutual_share`),
mean over 20 outer steps, when half the nodes (drawn per outer step) hold the old list and half the new one;
newcomers know the new list. "1 joined": a newcomer; "1 left": a departed member that half still list;
"4 differ": 2 joined and 2 left; "1% differ": N/100 members (at least 2), half joined, half left.

Mixing: all lists equal, windows of 20 outer steps: distinct partners per node (mean, least) and the
spectral gap of the window's averaged mixing matrix (node/ops/islands.py, `window_mixing`), mean of 5 windows.

Cost: the time to compute one outer step's schedule (all partners, both rounds) for N members, best of 3.

`python bench/pairing_scale.py` (about a minute on 2 cores; run it under `flock /tmp/starling-heavy.lock`
where others measure beside it) prints the tables of docs/benchmarks.md's "Tolerating different member lists".
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.averaging.pairing import matching, schedule  # noqa: E402
from node.ops.islands import mutual_share, window_mixing  # noqa: E402

Rule = Callable[[Iterable[str], int], dict[str, str | None]]
WINDOW = 20
WINDOWS = 5  # windows the mixing figures are averaged over (one window's gap varies by about 0.02 at 16)


def _old_rng(*parts: object) -> random.Random:
    return random.Random(hashlib.sha256("/".join(map(str, ("starling/pairing/v2", *parts))).encode()).digest())


def old_matching(members: Iterable[str], round_no: int) -> dict[str, str | None]:
    """The first round of node/averaging/pairing.py's `schedule` before issue #24 (commit 83301fd), for one
    speed tier: byes in a rotation drawn from the list, then a permutation seeded by the step and the list."""
    names = sorted(set(members))
    partner: dict[str, str | None] = {}
    if len(names) % 2:
        order = list(names)
        _old_rng("byes", *names).shuffle(order)
        bye = order[round_no % len(order)]
        names.remove(bye)
        partner[bye] = None
    _old_rng("round", round_no, *names).shuffle(names)
    for a, b in zip(names[0::2], names[1::2], strict=True):
        partner[a], partner[b] = b, a
    return partner


RULES: dict[str, Rule] = {"old (list-seeded permutation)": old_matching, "new (trie of step hashes)": matching}


def _names(n: int, prefix: str = "12D3KooWpeer") -> list[str]:
    return [f"{prefix}{i:05d}" for i in range(n)]


def agreement(rule: Rule, n: int, joined: int, left: int, rounds: int = WINDOW) -> float:
    """Mean share of nodes named back by their partner over `rounds` outer steps, half the old members (drawn
    afresh each step) holding the old list, the rest and the newcomers the new one."""
    base = _names(n)
    shares = []
    for r in range(rounds):
        rng = random.Random(f"{n}/{joined}/{left}/{r}")
        gone = set(rng.sample(base, left))
        new = [f"12D3KooWnew{r}-{j}" for j in range(joined)]
        new_list = [m for m in base if m not in gone] + new
        aware = set(rng.sample(base, n // 2))
        old_plan, new_plan = rule(base, r), rule(new_list, r)
        partner_of = {m: (new_plan if m in aware else old_plan)[m] for m in base if m not in gone}
        partner_of.update({m: new_plan[m] for m in new})
        shares.append(mutual_share(partner_of))
    return statistics.mean(shares)


def schedule_ms(rule: Callable[[list[str], int], object], n: int) -> float:
    members = _names(n)
    best = float("inf")
    for r in range(3):
        t = time.perf_counter()
        rule(members, r)
        best = min(best, time.perf_counter() - t)
    return best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 1000, 10_000])
    args = parser.parse_args()
    began = time.time()
    print("Agreement: share of nodes whose scheduled partner names them back (mean over 20 outer steps; half "
          "the nodes hold the old list)\n")
    print("| N | rule | 1 joined | 1 left | 4 differ | 1% differ |")
    print("|---|---|---|---|---|---|")
    for n in args.sizes:
        pct = max(2, n // 100)
        for name, rule in RULES.items():
            cells = [agreement(rule, n, 1, 0), agreement(rule, n, 0, 1), agreement(rule, n, 2, 2),
                     agreement(rule, n, pct // 2, pct - pct // 2)]
            print(f"| {n} | {name} | " + " | ".join(f"{c:.1%}" for c in cells[:3])
                  + f" | {cells[3]:.1%} ({pct}) |", flush=True)
    print(f"\nMixing over {WINDOW} outer steps, all lists equal (mean of {WINDOWS} windows; least: over all)\n")
    print("| N | rule | distinct partners per node, mean (least) | spectral gap of the averaged mixing matrix |")
    print("|---|---|---|---|")
    for n in args.sizes:
        for name, rule in RULES.items():
            mixes = [window_mixing([rule(_names(n), r) for r in range(w * WINDOW, (w + 1) * WINDOW)])
                     for w in range(WINDOWS)]
            print(f"| {n} | {name} | {statistics.mean(m.distinct_mean for m in mixes):.1f} "
                  f"({min(m.distinct_min for m in mixes)}) "
                  f"| {statistics.mean(m.spectral_gap for m in mixes):.3f} |", flush=True)
    print("\nCost of one outer step's schedule (ms, best of 3)\n")
    print("| N | old: first round | new: first round | new: both rounds (`schedule`) |")
    print("|---|---|---|---|")
    for n in args.sizes:
        print(f"| {n} | {schedule_ms(old_matching, n):.2f} | {schedule_ms(matching, n):.2f} "
              f"| {schedule_ms(schedule, n):.2f} |", flush=True)
    print(f"\n({time.time() - began:.0f} s)")


if __name__ == "__main__":
    main()
