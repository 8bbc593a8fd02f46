"""Where the time of an exchange goes: its phases, in seconds and in round trips.

Issue #50 asked for an exchange that pays for bytes, not round trips, and for a bench that shows it: per
exchange this node asked for, the time from the ask to the result split at the moments the asking side sees,

- ``open``: the stream to the partner (libp2p's protocol negotiation, pipelined: p2p/multiselect.py);
- ``answer``: the pairing request with its key agreement until the partner's answer;
- ``connect``: the answer until the first byte of the transfer (the side channel's connect and its ACK,
  started with the request where a recent one is known: protocols/avg.py `preconnect`);
- ``transfer``: the first byte to the last, both ways (what the link's bandwidth decides);
- ``result``: the last byte until the exchange returned (the partner's values checked, the stream closed).

A phase's round trips are its seconds over the connection's RTT (`SwarmView.rtt_s`): the fixed cost of an
exchange is the sum of every phase but ``transfer``, and should be about 3 RTT (bench/exchange_rtt.py).
`starling status` shows the latest (`sync.last_asked`), bench/wan.py their medians per trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

from node.status_schema import AskedExchangeStatus

PHASES = ("open", "answer", "connect", "transfer", "result")


@dataclass
class PhaseClock:
    """The moments of one asked exchange, on `time.monotonic()` (the transfer's byte counter's clock)."""

    began: float
    stream_open: float | None = None
    answered: float | None = None

    def phases(self, first_byte: float | None, last_byte: float | None, ended: float) -> dict[str, float]:
        """Seconds per phase; a moment not seen (no bytes: all of it was small enough to pass unseen) folds
        its phase into the next one, so that the phases always add up to the whole."""
        marks = [self.began, self.stream_open, self.answered, first_byte, last_byte, ended]
        out: dict[str, float] = {}
        prev = self.began
        for name, mark in zip(PHASES, marks[1:], strict=True):
            at = prev if mark is None else min(max(mark, prev), ended)
            out[name] = round(at - prev, 4)
            prev = at
        return out


def asked_status(partner: str, phases: dict[str, float], rtt_s: float | None) -> AskedExchangeStatus:
    """`sync.last_asked`: the phases of our latest asked exchange, with each one's round trips."""
    rtts = None if not rtt_s else {name: round(seconds / rtt_s, 2) for name, seconds in phases.items()}
    return {"partner": partner, "phases_s": phases, "rtt_ms": None if not rtt_s else round(rtt_s * 1000, 1),
            "phases_rtt": rtts}
