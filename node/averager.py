"""The daemon's side of an outer step: find a partner and average, or answer with a solo step.

This module is the seam between the trainer's supervisor (which publishes `(phi, Delta)` in shared
memory) and the gossip averaging protocol. Until a partner can be found, every outer step is answered
with n = 1: the worker then applies NoLoCo's solo step, so a lone node trains correctly.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any


def make_exchange(daemon: Any) -> Callable[[Any], Awaitable[int]]:
    async def exchange(request: Any) -> int:
        return 1  # solo: no gossip partner yet (see protocols/avg.py once it lands)

    return exchange
