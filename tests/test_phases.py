"""An asked exchange's time split into its phases (node/averaging/phases.py) and how status shows it."""

from __future__ import annotations

import pytest

from node.averaging.phases import PHASES, PhaseClock, asked_status
from node.ops.status_view import render_status


def test_the_phases_are_the_gaps_between_the_moments_the_asker_saw_and_add_up_to_the_whole() -> None:
    clock = PhaseClock(began=10.0, stream_open=10.1, answered=10.2)
    phases = clock.phases(first_byte=10.3, last_byte=11.3, ended=11.35)
    assert phases == pytest.approx({"open": 0.1, "answer": 0.1, "connect": 0.1, "transfer": 1.0, "result": 0.05})
    assert list(phases) == list(PHASES)


def test_a_moment_not_seen_folds_its_phase_into_the_next_and_none_goes_negative() -> None:
    # No byte was counted (nothing to time): connect and transfer are 0, the rest of the time is the result.
    phases = PhaseClock(began=0.0, stream_open=0.1, answered=0.3).phases(None, None, ended=0.5)
    assert phases == pytest.approx({"open": 0.1, "answer": 0.2, "connect": 0.0, "transfer": 0.0, "result": 0.2})
    # A first byte counted before the answer was seen (the byte counter runs on threads): never negative.
    phases = PhaseClock(began=0.0, stream_open=0.1, answered=0.3).phases(0.25, 0.9, ended=1.0)
    assert min(phases.values()) >= 0 and sum(phases.values()) == pytest.approx(1.0)


def test_status_gives_each_phase_in_round_trips_where_the_rtt_is_known() -> None:
    phases = {"open": 0.1, "answer": 0.1, "connect": 0.1, "transfer": 0.7, "result": 0.0}
    asked = asked_status("12D3KooWpartner", phases, 0.1)
    assert asked["rtt_ms"] == 100.0 and asked["phases_rtt"] == {"open": 1.0, "answer": 1.0, "connect": 1.0,
                                                                "transfer": 7.0, "result": 0.0}
    assert asked_status("p", phases, None)["phases_rtt"] is None
    text = render_status({"peer_id": "me", "sync": {"rounds": 1, "last_asked": asked}})
    line = next(ln for ln in text.splitlines() if "last asked exchange" in ln)
    assert "RTT 100 ms" in line and "open 0.10s (1 RTT)" in line and "transfer 0.70s (7 RTT)" in line
