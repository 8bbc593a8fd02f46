"""node.ops.islands: the pairing graph over alive trainers, its islands and its unpaired members."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from node.ops.islands import alive_trainers, pairing_graph

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
