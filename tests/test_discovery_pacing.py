"""p2p/discovery.py's LookupPacer: DHT lookups back off on a settled swarm and come back when it changes."""

from __future__ import annotations

from p2p.discovery import FAST_INTERVAL_S, FAST_ROUNDS, MAX_BACKOFF, LookupPacer


def test_lookups_are_fast_at_start_then_double_while_nothing_new_is_found_up_to_the_cap() -> None:
    pacer = LookupPacer(10.0)
    fast = [pacer.after_lookup(found_new=False) for _ in range(FAST_ROUNDS - 1)]
    assert fast == [FAST_INTERVAL_S] * (FAST_ROUNDS - 1)
    settled = [pacer.after_lookup(found_new=False) for _ in range(6)]
    assert settled == [10.0, 20.0, 40.0, 80.0, 80.0, 80.0]
    assert max(settled) == 10.0 * MAX_BACKOFF


def test_a_new_member_or_a_new_connection_brings_lookups_back_to_the_interval() -> None:
    pacer = LookupPacer(10.0)
    for _ in range(FAST_ROUNDS + 5):
        pacer.after_lookup(found_new=False)
    assert pacer.after_lookup(found_new=False) == 80.0
    assert pacer.after_lookup(found_new=True) == 10.0
    assert pacer.after_lookup(found_new=False) == 10.0  # and doubles again from there
    assert pacer.after_lookup(found_new=False) == 20.0
    pacer.woken()
    assert pacer.after_lookup(found_new=False) == 10.0
