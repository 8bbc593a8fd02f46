"""node.ops.islands: the pairing graph over alive trainers, its islands and its unpaired members; and the
measures of a pairing rule: mutual partners across differing views, and the mixing of a window of matchings."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from node.ops.islands import alive_trainers, mutual_share, pairing_graph, window_mixing

CAPTURED = Path(__file__).parent / "data" / "status_three_trainers.json"


def trainer(peer: str, *partners: str, state: str = "alive", role: str = "trainer") -> dict[str, Any]:
    return {"peer_id": peer, "state": state, "role": role, "partners": list(partners)}


def test_two_disjoint_pairs_are_two_islands() -> None:
    graph = pairing_graph([trainer("a", "b"), trainer("b", "a"), trainer("c", "d"), trainer("d", "c")])
    assert graph.islands == [["a", "b"], ["c", "d"]]
    assert graph.split and graph.unpaired == []


def test_a_chain_is_one_island_even_when_only_one_side_names_the_other() -> None:
    # a-b named by a only, b-c by c only, c-d by both: records lag each other, the graph must not.
    graph = pairing_graph([trainer("a", "b"), trainer("b"), trainer("c", "b", "d"), trainer("d", "c")])
    assert graph.islands == [["a", "b", "c", "d"]]
    assert not graph.split


def test_trainers_without_partners_are_unpaired_not_islands_so_a_fresh_swarm_is_not_split() -> None:
    fresh = pairing_graph([trainer("a"), trainer("b"), trainer("c")])
    assert fresh.islands == [] and fresh.unpaired == ["a", "b", "c"] and not fresh.split
    mixed = pairing_graph([trainer("a", "b"), trainer("b", "a"), trainer("c")])
    assert mixed.islands == [["a", "b"]] and mixed.unpaired == ["c"] and not mixed.split


def test_a_trainer_that_names_only_gone_partners_is_unpaired() -> None:
    graph = pairing_graph([trainer("a", "x"), trainer("x", "a", state="gone"), trainer("b", "c"), trainer("c")])
    assert graph.islands == [["b", "c"]] and graph.unpaired == ["a"]


def test_non_trainers_and_members_not_alive_are_ignored() -> None:
    # Without the filter, the relay "r" and the gone "g" would join the two pairs into one island.
    members = [
        trainer("a", "b", "g"), trainer("b", "a", "r"),
        trainer("c", "d", "g"), trainer("d", "c", "r"),
        trainer("g", "a", "c", state="gone"), trainer("s", "a", state="suspect"),
        trainer("r", "b", "d", role="network-only"),
    ]  # fmt: skip
    graph = pairing_graph(members)
    assert graph.islands == [["a", "b"], ["c", "d"]]
    assert set(alive_trainers(members)) == {"a", "b", "c", "d"}


def test_islands_come_largest_first() -> None:
    graph = pairing_graph([trainer("z", "y"), trainer("y"), trainer("a", "b", "c"), trainer("b"), trainer("c")])
    assert graph.islands == [["a", "b", "c"], ["y", "z"]] and graph.paired == 5


def test_malformed_members_and_partner_lists_do_not_raise() -> None:
    members = [None, "x", {"state": "alive", "role": "trainer"}, trainer("a", 3, None, "a"),  # type: ignore[arg-type]
               {"peer_id": "b", "state": "alive", "role": "trainer", "partners": "a"}]  # fmt: skip
    graph = pairing_graph(members)
    assert graph.islands == [] and graph.unpaired == ["a", "b"]


def test_a_captured_three_trainer_swarm_is_one_island() -> None:
    status = json.loads(CAPTURED.read_text())
    graph = pairing_graph(status["members"])
    assert len(graph.islands) == 1 and graph.paired == 3 and graph.unpaired == []


# --- measuring a pairing rule (issue #24) --------------------------------------------------------------------


def test_mutual_share_counts_nodes_whose_partner_names_them_back_and_byes_nobody_names() -> None:
    assert mutual_share({"a": "b", "b": "a", "c": None}) == 1.0
    # b's view pairs it with c, a's with b: a waits for someone who waits for someone else.
    assert mutual_share({"a": "b", "b": "c", "c": "b"}) == pytest.approx(2 / 3)
    # a thinks it has the bye but b waits for it: neither meets its plan.
    assert mutual_share({"a": None, "b": "a"}) == 0.0
    assert mutual_share({"a": "x"}) == 0.0  # a partner outside the measured nodes never answers
    assert mutual_share({}) == 1.0


def test_fixed_pairs_do_not_mix_and_a_crossing_second_pairing_does() -> None:
    """Two pairs that never change are two islands: one partner each, spectral gap 0. Alternating a-b, c-d
    with a-c, b-d makes the window's graph a 4-cycle: Laplacian eigenvalues 0, 2, 2, 4, so with R = 2
    rounds the averaged matrix I - L/4 has second eigenvalue 1/2: gap 0.5."""
    fixed = {"a": "b", "b": "a", "c": "d", "d": "c"}
    mix = window_mixing([fixed] * 5)
    assert (mix.nodes, mix.rounds, mix.distinct_min, mix.distinct_mean) == (4, 5, 1, 1.0)
    assert mix.spectral_gap == pytest.approx(0.0, abs=1e-12)
    crossing = {"a": "c", "c": "a", "b": "d", "d": "b"}
    mix = window_mixing([fixed, crossing])
    assert (mix.distinct_min, mix.spectral_gap) == (2, pytest.approx(0.5))


def test_one_sided_naming_is_no_exchange_and_a_bye_keeps_its_value() -> None:
    mix = window_mixing([{"a": "b", "b": "c", "c": "b"}, {"a": None, "b": "c", "c": "b"}])
    assert (mix.nodes, mix.distinct_min) == (3, 0)  # a never averaged
    assert mix.spectral_gap == pytest.approx(0.0, abs=1e-12)


def test_the_lanczos_gap_of_a_large_window_equals_the_full_eigendecomposition() -> None:
    """Above `DENSE_MAX` nodes the gap comes from Lanczos; on 600 nodes (20 random perfect matchings) both
    ways agree."""
    rng = random.Random(7)
    names = [f"n{i}" for i in range(600)]
    rounds = []
    for _ in range(20):
        rng.shuffle(names)
        m: dict[str, str | None] = {}
        for a, b in zip(names[0::2], names[1::2], strict=True):
            m[a], m[b] = b, a
        rounds.append(m)
    dense, lanczos = window_mixing(rounds), window_mixing(rounds, dense_max=10)
    assert dense.spectral_gap > 0.2
    assert lanczos.spectral_gap == pytest.approx(dense.spectral_gap, abs=1e-6)
    assert (lanczos.distinct_min, lanczos.distinct_mean) == (dense.distinct_min, dense.distinct_mean)
