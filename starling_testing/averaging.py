"""Helpers for driving real averagers (node.averaging.averager.Averager) against each other in one trio process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio

from node.bridge.exchange import ExchangeOutcome, ExchangeRequest

__all__ = ["exchange_both", "group_sizes"]


async def exchange_both(avs: Sequence[Any], reqs: Sequence[ExchangeRequest], *,
                        timeout: float = 60.0) -> list[ExchangeOutcome]:
    """Both sides' ``exchange`` at once, as two daemons' supervisors call it; the outcome each returned
    (in the order of ``avs``). Raises ``trio.TooSlowError`` after ``timeout`` seconds."""
    results: list[ExchangeOutcome | None] = [None] * len(avs)

    async def one(i: int) -> None:
        results[i] = await avs[i].exchange(reqs[i])

    with trio.fail_after(timeout):
        async with trio.open_nursery() as nursery:
            for i in range(len(avs)):
                nursery.start_soon(one, i)
    return [r for r in results if r is not None]


def group_sizes(outcomes: Sequence[ExchangeOutcome]) -> list[int]:
    """Each outcome's group size (1: a solo step)."""
    return [o.group_size for o in outcomes]
