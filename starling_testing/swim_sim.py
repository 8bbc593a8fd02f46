"""An in-process network for the SWIM membership core (:mod:`node.swarm.membership`): a discrete-event
simulation (heapq) with per-message latency and loss, driving the real ``Membership`` code.

Why here: the tests (tests/test_membership.py) and the scale benchmark (bench/scale_sim.py) run the same
network, and neither imports the other. All nodes share one :class:`~node.swarm.membership.Registry`, so
10,000 full views fit in a few GB. Deterministic for a seed: one ``random.Random`` draws latencies and
losses, and each node gets its own, seeded from it.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable

from node.swarm.membership import Membership, MembershipConfig, Message, Registry

__all__ = ["SimNet"]

Hook = Callable[[int, int, int, int, float], None]  # (observer, member, old state, new state, now)


class SimNet:
    """Nodes, a clock and messages in flight. ``latency`` is the one-way delay range (uniform), ``loss`` the
    chance that a message is lost; ``cut(src, dst)`` (settable) drops a link's messages when true."""

    def __init__(self, seed: int = 0, config: MembershipConfig | None = None,
                 latency: tuple[float, float] = (0.02, 0.2), loss: float = 0.01, hook: Hook | None = None) -> None:
        self.rng = random.Random(seed)
        self.config = config or MembershipConfig()
        self.latency, self.loss, self.hook = latency, loss, hook
        self.registry = Registry()
        self.now = 0.0
        self.nodes: dict[int, Membership] = {}
        self.cut: Callable[[int, int], bool] | None = None
        self._heap: list[tuple[float, int, int, Message | None]] = []
        self._order = 0
        self._scheduled: dict[int, float] = {}
        self.sent_msgs: dict[int, int] = {}
        self.sent_bytes: dict[int, int] = {}
        self.bytes_by_type: dict[str, int] = {}
        self.delivered = 0

    # ----------------------------------------------------------------------------------------- nodes

    def add(self, name: str, preload: range | None = None) -> int:
        """A node named ``name`` (started now); ``preload``: the members it holds alive from the start."""
        pid = self.registry.intern(name)
        hook = None
        if self.hook is not None:
            outer = self.hook

            def hook(member: int, old: int, new: int, now: float, me: int = pid) -> None:
                outer(me, member, old, new, now)
        node = Membership(pid, self.now, random.Random(self.rng.getrandbits(64)), self.config, on_change=hook,
                          registry=self.registry)
        if preload is not None:
            node.preload(preload, self.now)
        self.nodes[pid] = node
        self.sent_msgs.setdefault(pid, 0)
        self.sent_bytes.setdefault(pid, 0)
        self._wake(pid)
        return pid

    def start(self, n: int, prefix: str = "peer") -> list[int]:
        """``n`` nodes that all know each other (a converged swarm), ids 0..n-1 on a fresh registry."""
        assert len(self.registry) == 0
        for i in range(n):
            self.registry.intern(f"{prefix}{i:06d}")
        return [self.add(f"{prefix}{i:06d}", preload=range(n)) for i in range(n)]

    def join(self, name: str, seed: int) -> int:
        pid = self.add(name)
        self.send(pid, self.nodes[pid].join(seed, self.now))
        self._wake(pid)
        return pid

    def poke(self, pid: int) -> None:
        """Tell the network that ``pid``'s timers may have moved (after calling the node from outside)."""
        self._wake(pid)

    def kill(self, pid: int) -> None:
        """A crash: the node stops, silently; messages to it are lost."""
        self.nodes.pop(pid, None)
        self._scheduled.pop(pid, None)

    # -------------------------------------------------------------------------------------- the network

    def send(self, src: int, sends: list[tuple[int, Message]]) -> None:
        for dst, message in sends:
            self.sent_msgs[src] += 1
            size = message.size
            self.sent_bytes[src] += size
            kind = type(message).__name__
            self.bytes_by_type[kind] = self.bytes_by_type.get(kind, 0) + size
            if self.rng.random() < self.loss or (self.cut is not None and self.cut(src, dst)):
                continue
            self._order += 1
            heapq.heappush(self._heap, (self.now + self.rng.uniform(*self.latency), self._order, dst, message))

    def _wake(self, pid: int) -> None:
        node = self.nodes.get(pid)
        if node is None:
            return
        t = max(node.next_wakeup(), self.now)
        if t < self._scheduled.get(pid, math.inf) and math.isfinite(t):
            self._scheduled[pid] = t
            self._order += 1
            heapq.heappush(self._heap, (t, self._order, pid, None))

    def run_until(self, t_end: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= t_end:
            t, _, pid, message = heapq.heappop(heap)
            self.now = t
            node = self.nodes.get(pid)
            if node is None:
                continue
            if message is None:
                if self._scheduled.get(pid) != t:
                    continue
                del self._scheduled[pid]
                sends = node.tick(t)
            else:
                self.delivered += 1
                sends = node.receive(t, message)
            if sends:
                self.send(pid, sends)
            self._wake(pid)
        self.now = max(self.now, t_end)

    def run_for(self, seconds: float) -> None:
        self.run_until(self.now + seconds)
