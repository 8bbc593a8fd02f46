"""The link model behind `sync.compression = auto` (node/averaging/link_model.py): round trips out, bandwidth in.

A transfer's flowing time is simulated here the way TCP spends it, independently of the model's formula: the
partner's first byte comes back a round trip after ours (the initiator's view), and a new connection sends its
initial window, then twice that, one round trip after another, until the window fills the link; then bytes go
at the link's rate. The model must read the same bandwidth, so the same preset, at 0 and 100 ms.

The figures are the e2e model of issue #50's trial (bench/convergence.py, 0.47M parameters; `none` moves 1.88 MB
each way, phi and Delta in bf16, `medium` 207 kB, `high` 37 kB) and an outer step of 3 s.
"""

from __future__ import annotations

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from node.averaging.admission import RATE_KEEP, FlowRate
from node.averaging.averager import TIMED_FLOW_S, Averager
from node.averaging.compression_choice import PROBE, choose_compression
from node.averaging.link_model import INITIAL_WINDOW_BYTES, bandwidth_s
from node.config.sync import SyncConfig
from protocols.avg import Progress
from protocols.compress import PRESETS
from starling_testing.averaging import FakeSwarm
from starling_testing.fakes import FakeHost

NUMEL = 470_000
PERIOD_S = 3.0
MBIT = 1e6 / 8  # bytes/s of one Mbit/s


def flowing_seconds(nbytes: float, bandwidth_bps: float, rtt_s: float, *, initiator: bool = True) -> float:
    """First byte to last byte of one side of an exchange over a fresh TCP connection in slow start."""
    t = rtt_s if initiator else 0.0  # the partner's bulk starts when our path message reaches it
    sent, window = 0.0, float(INITIAL_WINDOW_BYTES)
    while sent < nbytes:
        if window >= bandwidth_bps * rtt_s:  # the window fills the link: the rest at the link's rate
            return t + (nbytes - sent) / bandwidth_bps
        burst = min(window, nbytes - sent)
        sent += burst
        t += rtt_s if sent < nbytes else burst / bandwidth_bps
        window *= 2
    return t


def each_way(preset: str) -> float:
    return PRESETS[preset].bytes_per_param(NUMEL, "bf16") * NUMEL


def auto_presets(bandwidth_bps: float, rtt_s: float, exchanges: int, *, model: bool = True) -> list[str]:
    """The presets `auto` picks exchange after exchange with one partner, learning as averager.py does."""
    flow, rate, previous, chosen = FlowRate(RATE_KEEP), None, None, []
    for _ in range(exchanges):
        preset = choose_compression(rate_bps=rate, period_s=PERIOD_S, numel=NUMEL, previous=previous)
        nbytes = each_way(preset)
        seconds = flowing_seconds(nbytes, bandwidth_bps, rtt_s)
        if model:
            seconds = bandwidth_s(nbytes, seconds, rtt_s, floor_s=TIMED_FLOW_S)
        rate = flow.add(nbytes, seconds)
        chosen.append(preset)
        previous = preset
    return chosen


@pytest.mark.parametrize("mbit", [0.4, 2.0, 20.0, 100.0])
@pytest.mark.parametrize("rtt_ms", [100.0, 300.0])
def test_auto_picks_the_same_presets_at_a_latency_as_on_its_zero_latency_twin(mbit: float, rtt_ms: float) -> None:
    twin = auto_presets(mbit * MBIT, 0.0, 12)
    delayed = auto_presets(mbit * MBIT, rtt_ms / 1000, 12)
    same = sum(a == b for a, b in zip(twin, delayed, strict=True))
    assert same >= 0.9 * len(twin), (twin, delayed)


def test_at_100_ms_the_time_read_as_bandwidth_compressed_a_link_that_carries_bf16() -> None:
    """What the model fixes (issue #50): 20 Mbit/s with 100 ms of RTT carries a bf16 exchange (1.88 MB each
    way) in well under one period, and the twin at 0 ms is on `none` after its probe; read without the
    model, every transfer's round trips count as bandwidth and `auto` stays compressed."""
    assert flowing_seconds(each_way("none"), 20 * MBIT, 0.1) < PERIOD_S
    assert auto_presets(20 * MBIT, 0.0, 6)[2:] == ["none"] * 4
    assert auto_presets(20 * MBIT, 0.1, 6)[2:] == ["none"] * 4
    assert "none" not in auto_presets(20 * MBIT, 0.1, 6, model=False)


@pytest.mark.parametrize("mbit", [0.4, 2.0, 20.0])
@pytest.mark.parametrize("rtt_ms", [50.0, 100.0, 300.0])
def test_a_transfer_that_fills_the_link_reads_its_bandwidth_within_a_fifth(mbit: float, rtt_ms: float) -> None:
    """Where the transfer is long against its round trips (bf16 on a slow link, or several
    bandwidth-delay products), what is left after the round trips is the bytes' time, from either side."""
    bandwidth = mbit * MBIT
    nbytes = max(each_way("none"), 20 * bandwidth * rtt_ms / 1000)
    for initiator in (True, False):
        seconds = flowing_seconds(nbytes, bandwidth, rtt_ms / 1000, initiator=initiator)
        read = nbytes / bandwidth_s(nbytes, seconds, rtt_ms / 1000, floor_s=TIMED_FLOW_S)
        assert read == pytest.approx(bandwidth, rel=0.2)


def test_a_transfer_that_was_all_round_trips_reads_as_fast_never_as_slow() -> None:
    """A probe over a fast, distant link never fills it: its time is round trips, so it says only that the
    link is fast (a lower bound, `floor_s`), and `auto` relaxes one preset at a time from there."""
    nbytes = each_way(PROBE)
    seconds = flowing_seconds(nbytes, 100 * MBIT, 0.3)
    assert nbytes / seconds < 2 * MBIT  # read as bandwidth: a 2 Mbit/s link
    assert nbytes / bandwidth_s(nbytes, seconds, 0.3, floor_s=TIMED_FLOW_S) > 20 * MBIT


def test_without_a_round_trip_the_time_is_left_as_measured() -> None:
    for rtt in (None, 0.0, -1.0):
        assert bandwidth_s(1e6, 2.5, rtt, floor_s=0.01) == 2.5
    assert bandwidth_s(1e6, 0.005, 0.1, floor_s=0.01) == 0.005  # too fast to time: as it was
    assert bandwidth_s(0, 2.5, 0.1, floor_s=0.01) == 2.5


def test_the_averager_takes_the_connections_round_trip_out_of_what_it_learns() -> None:
    """averager.py `_learn_rate` reads the round trip from its swarm view (the connection's muxer, in the
    daemon) and learns the bandwidth; a view that knows none, or fails, leaves the time as measured."""
    partner = str(ID.from_pubkey(create_new_key_pair().public_key))
    nbytes = each_way("none")
    seconds = flowing_seconds(nbytes, 20 * MBIT, 0.1)

    def learned(rtt: object) -> float:
        host = FakeHost(create_new_key_pair())
        averager = Averager(host, SyncConfig(datapath=False), FakeSwarm(host, rtt=rtt))  # type: ignore[arg-type]
        progress = Progress()
        progress.bytes, progress.first, progress.last = 2 * nbytes, 100.0, 100.0 + seconds
        averager._learn_rate(partner, progress, completed=True)
        rate = averager.admission.link(partner).rate_bps
        assert rate is not None and averager._rate_bps == pytest.approx(rate)
        return rate

    def broken() -> float:
        raise RuntimeError("connection closing")

    assert learned(None) == pytest.approx(nbytes / seconds)
    assert learned(broken) == pytest.approx(nbytes / seconds)
    assert learned(None) < 0.7 * 20 * MBIT  # the round trips read as a slower link
    assert learned(0.1) == pytest.approx(20 * MBIT, rel=0.2)
