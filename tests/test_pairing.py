"""The pairing schedule (node/pairing.py): every node computes the same matching, partners spread over all
members, and with an odd number of trainers the solo step rotates instead of starving one trainer."""

from __future__ import annotations

import collections
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from node.pairing import BYE, matching, scheduled_partner

members_st = st.lists(st.text("abcdefghij", min_size=1, max_size=6), min_size=2, max_size=12, unique=True)


@given(members_st, st.integers(0, 10_000))
def test_the_matching_is_symmetric_and_covers_every_member(members: list[str], round_no: int) -> None:
    m = matching(members, round_no)
    assert set(m) == set(members)
    for a, b in m.items():
        assert b != a
        if b is not BYE:
            assert m[b] == a
    byes = [a for a, b in m.items() if b is BYE]
    assert len(byes) == len(members) % 2


@given(members_st, st.integers(0, 10_000), st.randoms(use_true_random=False))
def test_every_node_computes_the_same_matching_whatever_order_it_knows_the_members_in(
    members: list[str], round_no: int, rng: random.Random
) -> None:
    shuffled = list(members)
    rng.shuffle(shuffled)
    assert matching(shuffled, round_no) == matching(members, round_no)
    for me in members:
        others = [m for m in shuffled if m != me]
        assert scheduled_partner(me, others, round_no) == matching(members, round_no)[me]


@settings(max_examples=50)
@given(members_st, st.integers(0, 1000))
def test_with_an_odd_number_of_trainers_each_sits_out_exactly_once_every_n_outer_steps(
    members: list[str], start: int
) -> None:
    n = len(members)
    byes = collections.Counter(a for r in range(start, start + n) for a, b in matching(members, r).items() if b is BYE)
    assert byes == ({m: 1 for m in members} if n % 2 else {})


def test_three_trainers_rotate_the_solo_step_and_each_averages_two_of_three_steps_with_both_others() -> None:
    members = ["A", "B", "C"]
    averaged = collections.Counter()
    partners: dict[str, set[str]] = collections.defaultdict(set)
    for r in range(30):
        for a, b in matching(members, r).items():
            if b is not BYE:
                averaged[a] += 1
                partners[a].add(b)
    assert averaged == {"A": 20, "B": 20, "C": 20}
    assert all(partners[m] == set(members) - {m} for m in members)


def test_partners_are_drawn_afresh_so_every_trainer_meets_all_others_and_no_pairs_stay_fixed() -> None:
    for n in (4, 7, 8):
        members = [f"peer{i}" for i in range(n)]
        partners = [matching(members, r)["peer0"] for r in range(12 * n)]
        assert set(partners) - {BYE} == set(members) - {"peer0"}
        assert len({tuple(partners[i : i + n]) for i in range(0, 10 * n, n)}) > 1  # no fixed cycle


def test_fewer_than_two_members_have_no_partner() -> None:
    assert matching(["A"], 5) == {"A": BYE}
    assert matching([], 5) == {}
    assert scheduled_partner("A", [], 3) is BYE
