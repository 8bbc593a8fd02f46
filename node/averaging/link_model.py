"""A link as two numbers: the round trip it costs and the bytes per second it carries.

Why: `sync.compression = auto` (compression_choice.py) chooses a preset by the bytes each one moves over the
link's *bandwidth*, and it used to learn that bandwidth as a transfer's bytes over the seconds they flowed
(averager.py `_learn_rate`). On a link with latency those seconds hold round trips that no preset changes:
the partner's first byte comes a round trip after ours (its bulk starts when our path message reaches it,
and the first byte then travels back), and a TCP connection opened for the exchange sends its initial
window, then twice that, one round trip after another, until it fills the link (slow start). A 156 kB
transfer over 20 Mbit/s with 100 ms of RTT is about half a second of round trips and 60 ms of bytes: read
as bandwidth, it is a 2 Mbit/s link, and `auto` compressed what a bf16 exchange would have carried in time
(issue #50's trial: `high` at 100 ms where the same rate at 0 ms gave bf16 `none`). The round trips are the
same for every preset, so they cannot be the reason to compress: they are taken out first.

The model (`transfer_time_s`): a transfer of `S` bytes each way over bandwidth `B` with round trip `R` takes
`R x (1 + k) + (S - ramp) / B`: one round trip for the partner's first byte, `k = log2(max(1, w / IW))`
doublings of the congestion window from TCP's initial window `IW` (RFC 6928: 10 segments) up to `w`, the
smaller of the transfer and the link's bandwidth-delay product `B x R`, during which `ramp = w - IW` bytes
went out; the rest at the link's rate. `bandwidth_s` reads a measured time backwards: the smallest
bandwidth whose predicted time is no longer than what was measured (the conservative reading: the model is
not exact, and erring low compresses a little more, never floods a link). Where the round trips alone
explain the whole time, the transfer says only that the link is fast: it counts as flowing for `floor_s`
(a lower bound on the rate, as a transfer too quick to time always has; compression_choice.py relaxes the
preset one step at a time from there, and the next, bigger transfer measures more).

The round trip comes from the connection's muxer (yamux's pings: node/swarm/nat.py `rtt_of`), which is the
same path the side channel takes to the same address; unknown (None) leaves the time as it was measured.
"""

from __future__ import annotations

import math

__all__ = ["INITIAL_WINDOW_BYTES", "bandwidth_s", "transfer_time_s"]

INITIAL_WINDOW_BYTES = 10 * 1448  # RFC 6928: a new connection's first flight, 10 full-sized segments
_GRID = 400  # bandwidths tried between the naive reading and the fastest one the floor allows (~2% apart)


def transfer_time_s(nbytes_each_way: float, bandwidth_bps: float, rtt_s: float) -> float:
    """Predicted first-to-last-byte seconds of one side's transfer (the module's docstring says how)."""
    window = min(nbytes_each_way, bandwidth_bps * rtt_s)
    doublings = math.log2(max(1.0, window / INITIAL_WINDOW_BYTES))
    ramp = min(nbytes_each_way, max(0.0, window - INITIAL_WINDOW_BYTES))
    return rtt_s * (1.0 + doublings) + (nbytes_each_way - ramp) / bandwidth_bps


def bandwidth_s(nbytes_each_way: float, seconds: float, rtt_s: float | None, *, floor_s: float) -> float:
    """The seconds that a transfer's bytes alone would have taken at the link's bandwidth: `nbytes_each_way`
    over the smallest bandwidth whose `transfer_time_s` fits in the measured `seconds`; `floor_s` where the
    round trips alone fill them; `seconds` unchanged where the round trip is unknown."""
    if rtt_s is None or rtt_s <= 0 or nbytes_each_way <= 0 or seconds <= floor_s:
        return seconds
    low, high = nbytes_each_way / seconds, nbytes_each_way / floor_s
    for i in range(_GRID + 1):
        bandwidth = low * (high / low) ** (i / _GRID)
        if transfer_time_s(nbytes_each_way, bandwidth, rtt_s) <= seconds:
            return nbytes_each_way / bandwidth
    return floor_s
