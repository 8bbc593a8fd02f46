"""The pairing schedule (node/pairing.py): every node computes the same matching, partners spread over all
members, and with an odd number of trainers the solo step rotates instead of starving one trainer."""

from __future__ import annotations

import collections
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from node.pairing import BYE, matching, scheduled_partner

members_st = st.lists(st.text("abcdefghij", min_size=1, max_size=6), min_size=2, max_size=12, unique=True)


def epoch_len(n: int) -> int:
    return n if n % 2 else n - 1


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
def test_within_one_epoch_every_trainer_meets_every_other_once_and_sits_out_at_most_once(
    members: list[str], epoch: int
) -> None:
    n = len(members)
    rounds = range(epoch * epoch_len(n), (epoch + 1) * epoch_len(n))
    met: dict[str, collections.Counter[str | None]] = {m: collections.Counter() for m in members}
    for r in rounds:
        for a, b in matching(members, r).items():
            met[a][b] += 1
    for a in members:
        assert set(met[a]) - {BYE} == set(members) - {a}
        assert all(count == 1 for count in met[a].values())
        assert met[a][BYE] == (1 if n % 2 else 0)


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


def test_the_order_of_meetings_changes_from_epoch_to_epoch() -> None:
    members = [f"peer{i}" for i in range(8)]
    sequences = {tuple(matching(members, e * 7 + r)["peer0"] for r in range(7)) for e in range(6)}
    assert len(sequences) > 1  # not the same fixed cycle of partners forever


def test_fewer_than_two_members_have_no_partner() -> None:
    assert matching(["A"], 5) == {"A": BYE}
    assert matching([], 5) == {}
    assert scheduled_partner("A", [], 3) is BYE
