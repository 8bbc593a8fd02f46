"""Helpers for driving real averagers (node.averager.Averager) against each other in one trio process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio

__all__ = ["exchange_both"]


async def exchange_both(avs: Sequence[Any], reqs: Sequence[Any], *, timeout: float = 60.0) -> list[Any]:
    """Both sides' ``exchange`` at once, as two daemons' supervisors call it; what each returned (in the
    order of ``avs``). Raises ``trio.TooSlowError`` after ``timeout`` seconds."""
    results: list[Any] = [None] * len(avs)

    async def one(i: int) -> None:
        results[i] = await avs[i].exchange(reqs[i])

    with trio.fail_after(timeout):
        async with trio.open_nursery() as nursery:
            for i in range(len(avs)):
                nursery.start_soon(one, i)
    return results
