"""hivemind's side of `bench/sync.py` part 3: two DecentralizedAveragers averaging in groups of 2.

Runs inside `bench/.venv-hivemind` (hivemind 1.1.12 and torch's CPU wheel, created by bench/sync.py), never
in the project's venv: it imports nothing from Starling. Two peers on 127.0.0.1, each a hivemind DHT (its
own p2pd daemon from the hivemind wheel) plus a DecentralizedAverager (its own process), average `phi`
and `Delta` of `--numel` fp32 parameters with no compression, one round per `step` line read from stdin
(so that bench/sync.py can interleave them with Starling's rounds), until end of input.

For each round it prints one JSON line: the whole `step()` call (matchmaking through the DHT, then the
all-reduce) as the slower of the two peers saw it, and the all-reduce alone (`_aggregate_with_group`,
timed inside the averager processes). It checks that both peers end with the exact mean. A JSON line
{"ready": true} says that both peers are up.

Usage (inside the venv): python bench/hivemind_avg.py [--numel 10000000] < commands
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager

# Filled in the averager processes (they are forked from this one, so they inherit the patch and the
# queue): one (pid, seconds) per all-reduce.
ALLREDUCE_TIMES: mp.Queue = mp.get_context("fork").Queue()
_original_aggregate = DecentralizedAverager._aggregate_with_group


async def _timed_aggregate(self: DecentralizedAverager, *args: object, **kwargs: object) -> object:
    began = time.perf_counter()
    try:
        return await _original_aggregate(self, *args, **kwargs)
    finally:
        ALLREDUCE_TIMES.put(time.perf_counter() - began)


DecentralizedAverager._aggregate_with_group = _timed_aggregate


def tensors(numel: int, seed: int) -> list[torch.Tensor]:
    """The same phi and Delta as bench/sync.py's peers (same generator, same seeds)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g), torch.randn(numel, generator=g).mul_(0.01)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=10_000_000)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one averaging step may take")
    args = p.parse_args()
    torch.set_num_threads(1)

    inputs = [tensors(args.numel, seed) for seed in (0, 1)]
    expected = [(a + b) / 2 for a, b in zip(inputs[0], inputs[1], strict=True)]
    dhts = [DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])]
    dhts.append(DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=dhts[0].get_visible_maddrs()))
    averagers = [
        DecentralizedAverager(
            [t.clone() for t in ts], dht, prefix="bench", target_group_size=2, min_group_size=2,
            min_matchmaking_time=2.0, request_timeout=1.0, start=True,
        )
        for ts, dht in zip(inputs, dhts, strict=True)
    ]

    def one(av: DecentralizedAverager) -> float:
        began = time.perf_counter()
        if av.step(timeout=args.timeout) is None:
            raise RuntimeError("hivemind averaging step failed (no group)")
        return time.perf_counter() - began

    try:
        print(json.dumps({"ready": True}), flush=True)
        with ThreadPoolExecutor(2) as pool:
            for line in sys.stdin:
                if line.strip() != "step":
                    raise SystemExit(f"unknown command {line.strip()!r} (expected: step)")
                for av, ts in zip(averagers, inputs, strict=True):  # every round averages the original inputs
                    with av.get_tensors() as mine:
                        for dst, src in zip(mine, ts, strict=True):
                            dst.copy_(src)
                steps = list(pool.map(one, averagers))
                allreduce = [ALLREDUCE_TIMES.get(timeout=30) for _ in averagers]
                for av in averagers:
                    with av.get_tensors() as out:
                        for got, want in zip(out, expected, strict=True):
                            if not torch.allclose(got, want, atol=1e-6):
                                raise RuntimeError("hivemind's result is not the mean of the two inputs")
                print(json.dumps({"step_s": max(steps), "allreduce_s": max(allreduce)}), flush=True)
    finally:
        for av in averagers:
            av.shutdown()
        for dht in dhts:
            dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
