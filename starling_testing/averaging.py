"""Helpers for driving real averagers (node.averaging.averager.Averager) against each other in one trio process.

`FakeSwarm` is the `SwarmView` (node/averaging/swarm_view.py) an averager gets outside a daemon: the
answers a test gives it, by default those of a swarm where every connected peer is an eligible trainer
of our run over a direct path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import trio

from node.bridge.exchange import ExchangeOutcome, ExchangeRequest

__all__ = ["FakeSwarm", "exchange_both", "group_sizes"]

T = TypeVar("T")


def _now(value: T | Callable[[], T]) -> T:
    return value() if callable(value) else value  # type: ignore[return-value]


class FakeSwarm:
    """A `SwarmView` with the answers a test sets. Each may be a value or a function of no arguments (read
    at every question, for answers that change during a test); the attributes may be changed meanwhile.

    `partners` None (the default) makes every peer `host` is connected to an eligible partner, which is what
    two averagers on connected hosts need to pair; `others` is `anyone_else` (True: an outer step never goes
    solo at once for want of anyone); `period` None follows `pace`."""

    def __init__(
        self,
        host: Any = None,
        *,
        manifest: str | None | Callable[[], str | None] = "m1",
        partners: Sequence[str] | Callable[[], Sequence[str]] | None = None,
        others: bool | Callable[[], bool] = True,
        path: str | Callable[[], str] = "direct",
        reachable: bool = True,
        pace: float | Callable[[], float] = 0.0,
        period: float | Callable[[], float] | None = None,
        steps: dict[str, int] | Callable[[], dict[str, int]] | None = None,
        speeds: dict[str, float] | None = None,
        rtt: float | None | Callable[[], float | None] = None,
    ) -> None:
        self.host = host
        self.manifest = manifest
        self.partners = partners
        self.others = others
        self.path = path
        self.is_reachable = reachable
        self.pace_s = pace
        self.period = period
        self.steps = steps
        self.samples_per_s = speeds
        self.rtt = rtt

    def manifest_hash(self) -> str | None:
        return _now(self.manifest)

    def eligible_partners(self) -> list[str]:
        if self.partners is None:
            return [str(p) for p in self.host.get_connected_peers()] if self.host is not None else []
        return list(_now(self.partners))

    def anyone_else(self) -> bool:
        return bool(_now(self.others))

    def path_of(self, peer: str) -> str:
        return _now(self.path)

    def reachable(self) -> bool:
        return self.is_reachable

    def rtt_s(self, peer: str) -> float | None:
        return _now(self.rtt)

    def pace(self) -> float:
        return float(_now(self.pace_s))

    def outer_period(self) -> float:
        return self.pace() if self.period is None else float(_now(self.period))

    def swarm_steps(self) -> dict[str, int]:
        return dict(_now(self.steps)) if self.steps is not None else {}

    def speeds(self) -> dict[str, float]:
        return dict(self.samples_per_s or {})


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
