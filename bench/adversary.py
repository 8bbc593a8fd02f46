"""`make bench-adversary`: hostile peers against a real victim, three scenarios.

- averaging: hostile averaging partners (starling_testing/adversary.py says what each attack does;
  tests/test_adversary_avg.py asserts the bounds); about 1 min.
- directions: how aligned, round after round, the contributions are that the victim clips, from honest
  partners (in step, and far apart: a late starter) and from the drift attacks: what a persistent-direction
  check beside the clip would have to tell apart (docs/reliability.md); about 1.5 min.
- window-flood: a peer that writes 1 GiB of Yamux DATA past a refused stream's receive window into a real
  `starling run` daemon, reconnecting after each close (starling_testing/window_flood.py); about 1.5 min.

    python bench/adversary.py --write-docs                          # all three, into docs/reliability.md
    python bench/adversary.py --scenario window-flood --write-docs  # the "Stream receive windows" figures
"""

from __future__ import annotations

import argparse
import sys

from starling_testing import adversary, window_flood

SCENARIOS = ("averaging", "directions", "window-flood")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", choices=("all", *SCENARIOS), default="all")
    ap.add_argument("--write-docs", action="store_true", help=f"record the figures in {adversary.DOCS}")
    ap.add_argument("--attacks", default=None, help="averaging: comma-separated attacks (default: all)")
    ap.add_argument("--flood-mib", type=int, default=window_flood.GIB >> 20,
                    help="window-flood: MiB to offer past the window (default: 1 GiB)")
    ap.add_argument("--flood-attempts", type=int, default=200,
                    help="window-flood: connections at most (the victim closes each one)")
    args = ap.parse_args(argv)
    rc = 0
    if args.scenario in ("all", "averaging"):
        forwarded = [*(["--attacks", args.attacks] if args.attacks is not None else []),
                     *(["--write-docs"] if args.write_docs else [])]
        rc = adversary.main(forwarded)
    if rc == 0 and args.scenario in ("all", "directions"):
        rc = adversary.directions_main(args.write_docs)
    if rc == 0 and args.scenario in ("all", "window-flood"):
        result = window_flood.run_flood(args.flood_mib << 20, args.flood_attempts)
        print(window_flood.report(result))
        if args.write_docs:
            window_flood.write_docs(result)
        if not result.held:
            print(f"NOT HELD: the victim grew by {result.peak_growth >> 20} MiB (bound "
                  f"{window_flood.GROWTH_BOUND >> 20} MiB) or kept a flooded connection", file=sys.stderr)
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
