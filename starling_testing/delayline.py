"""A userspace delay line: latency, jitter and loss on a lab link, where the kernel has no netem.

This kernel lacks ``sch_netem``, but it has NFQUEUE (nftables' ``queue`` statement) and that is
enough: nftables hands every packet of a direction to this process, which holds the packet's verdict
until its due time and then accepts it (or drops it, with probability ``loss``). The packet itself
stays in the kernel the whole time (we ask for metadata only), so the line moves no payload bytes and
its cost is one small netlink message and one verdict per packet.

Each direction of a link is one queue with its own :class:`LineSpec`:

* every packet is due ``delay_ms`` after it reached the queue, plus a jitter drawn uniformly from
  ``[-jitter_ms, +jitter_ms]`` (netem's default distribution);
* order is kept: a packet is never due before the one queued ahead of it (so jitter never reorders
  a TCP flow, as on a real path; it only stretches the gaps);
* ``loss`` drops each packet independently with that probability, when it arrives.

Run inside a lab namespace (``Lab.limit(..., delay_ms=...)`` does it)::

    python -m starling_testing.delayline --queue 0:25:5:0.005 --queue 1:25:5:0.005

prints ``delay line ready`` once every queue is bound (the lab installs the nftables rules only
then: a queue with no reader drops its packets) and, on SIGTERM or SIGINT, a last line of counters
(``delay line stats {...}``) before it exits. The lab runs it without nftables' ``bypass`` flag on
purpose: if the line dies the link goes dark instead of silently losing its latency.
"""

from __future__ import annotations

import argparse
import json
import random
import select
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_DELAY_MS = 10_000.0  # beyond any path on Earth; a typo (seconds for ms) fails fast
# The kernel queues at most this many packets per queue for us; past it, it drops them. 300 ms at
# 1 Gbit/s is ~25,000 full-sized frames; the lab's links are slower.
QUEUE_MAX_PACKETS = 32_768
NETLINK_RCVBUF_BYTES = 8 << 20  # metadata only: ~100 bytes a packet, so thousands of them
READY_LINE = "delay line ready"
STATS_PREFIX = "delay line stats "


# A UDP echo server, run in a lab host (`Host.spawn_python(UDP_ECHO, PORT)`; prints "listening" once bound): the
# far end of the round trips that tests/test_delayline.py and bench/delayline.py time through a line.
UDP_ECHO = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
while True:
    data, addr = s.recvfrom(2048)
    s.sendto(data, addr)
"""


@dataclass(frozen=True)
class LineSpec:
    """What one direction of a link does to each packet."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.delay_ms <= MAX_DELAY_MS:
            raise ValueError(f"delay_ms must be in [0, {MAX_DELAY_MS:.0f}], got {self.delay_ms}")
        if not 0.0 <= self.jitter_ms <= self.delay_ms:
            raise ValueError(
                f"jitter_ms must be in [0, delay_ms={self.delay_ms}] (a packet cannot leave before "
                f"it arrived), got {self.jitter_ms}"
            )
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss is a probability in [0, 1), got {self.loss}")

    @property
    def is_noop(self) -> bool:
        return self.delay_ms == 0 and self.loss == 0

    def to_arg(self, queue: int) -> str:
        return f"{queue}:{self.delay_ms:g}:{self.jitter_ms:g}:{self.loss:g}"

    @staticmethod
    def from_arg(text: str) -> tuple[int, LineSpec]:
        """Parse ``QUEUE:DELAY_MS:JITTER_MS:LOSS`` (the command line's ``--queue``)."""
        parts = text.split(":")
        if len(parts) != 4:
            raise ValueError(f"--queue {text!r}: expected QUEUE:DELAY_MS:JITTER_MS:LOSS")
        return int(parts[0]), LineSpec(float(parts[1]), float(parts[2]), float(parts[3]))


@dataclass
class Direction:
    """The packets of one queue, held in arrival order until due. Pure logic: no kernel in here.

    `admit` decides a packet's fate when it arrives; `due` releases what is due by `now`. Kept apart
    from the netlink side so the scheduling (order kept, jitter, loss) is tested without root.
    """

    spec: LineSpec
    rng: random.Random
    held: deque[tuple[float, Any]] = field(default_factory=deque)
    last_due: float = 0.0
    passed: int = 0
    dropped: int = 0
    max_held: int = 0

    def admit(self, packet: Any, now: float) -> bool:
        """Hold `packet` until its due time; False if the line drops it (the caller drops it)."""
        if self.spec.loss and self.rng.random() < self.spec.loss:
            self.dropped += 1
            return False
        jitter = self.rng.uniform(-self.spec.jitter_ms, self.spec.jitter_ms) if self.spec.jitter_ms else 0.0
        due = max(now + (self.spec.delay_ms + jitter) / 1000.0, self.last_due)
        self.last_due = due
        self.held.append((due, packet))
        self.max_held = max(self.max_held, len(self.held))
        return True

    def release(self, now: float) -> list[Any]:
        """The packets due by `now`, in order; they leave the line."""
        out = []
        while self.held and self.held[0][0] <= now:
            out.append(self.held.popleft()[1])
        self.passed += len(out)
        return out

    def next_due(self) -> float | None:
        return self.held[0][0] if self.held else None

    def stats(self) -> dict[str, int]:
        return {"passed": self.passed, "dropped": self.dropped, "held": len(self.held), "max_held": self.max_held}


def run(specs: dict[int, LineSpec], seed: int | None) -> int:
    """Bind one NFQUEUE per spec and hold packets until due; returns on SIGTERM/SIGINT."""
    try:
        from netfilterqueue import COPY_META, NetfilterQueue
    except ImportError:
        print(
            "error: the Python package netfilterqueue is missing (Debian: libnetfilter-queue-dev, "
            "then pip install netfilterqueue; `make install` does both)",
            file=sys.stderr,
        )
        return 2

    base = random.Random(seed)
    directions = {q: Direction(spec, random.Random(base.random())) for q, spec in specs.items()}
    queues = []
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def make_callback(direction: Direction):  # type: ignore[no-untyped-def]
        def on_packet(pkt: Any) -> None:
            if not direction.admit(pkt, time.monotonic()):
                pkt.drop()

        return on_packet

    try:
        for q, direction in directions.items():
            nfq = NetfilterQueue()
            try:
                nfq.bind(q, make_callback(direction), max_len=QUEUE_MAX_PACKETS, mode=COPY_META,
                         sock_len=NETLINK_RCVBUF_BYTES)  # fmt: skip
            except (OSError, OverflowError) as e:
                print(f"error: cannot bind NFQUEUE {q} (root in the namespace? queue taken?): {e}", file=sys.stderr)
                return 2
            queues.append(nfq)
        fds = {nfq.get_fd(): nfq for nfq in queues}
        print(READY_LINE, flush=True)
        cpu0 = time.process_time()
        while not stopping:
            now = time.monotonic()
            for direction in directions.values():
                for pkt in direction.release(now):
                    pkt.accept()
            dues = [d for d in (x.next_due() for x in directions.values()) if d is not None]
            timeout = max(0.0, min(dues) - time.monotonic()) if dues else 0.5
            try:
                readable, _, _ = select.select(list(fds), [], [], timeout)
            except InterruptedError:
                continue
            for fd in readable:
                fds[fd].run(block=False)
        # Let what is held go (a test's last packets, a clean stop), then say what the line did.
        for direction in directions.values():
            for pkt in direction.release(float("inf")):
                pkt.accept()
        stats = {str(q): d.stats() for q, d in directions.items()}
        stats["cpu_s"] = round(time.process_time() - cpu0, 3)  # type: ignore[assignment]
        print(STATS_PREFIX + json.dumps(stats), flush=True)
    finally:
        for nfq in queues:
            nfq.unbind()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queue", action="append", required=True, metavar="Q:DELAY_MS:JITTER_MS:LOSS",
                        help="an NFQUEUE number and what it does to each packet (repeat per direction)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=None, help="seed of the jitter and loss draws")
    args = parser.parse_args(argv)
    try:
        specs = dict(LineSpec.from_arg(text) for text in args.queue)
    except ValueError as e:
        parser.error(str(e))
    return run(specs, args.seed)


if __name__ == "__main__":
    sys.exit(main())
