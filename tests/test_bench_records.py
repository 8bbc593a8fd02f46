"""bench/records.py: what the benches keep of a run (issue #52) is plain JSON, whole, and says where it came from."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import records  # noqa: E402  (bench/records.py)

sys.path.pop(0)


@dataclass
class _Row:
    label: str
    loss: float
    spread: float | None = None
    where: Path = Path("/tmp/x")
    shares: tuple[float, ...] = ()


@dataclass
class _Results:
    rows: list[_Row] = field(default_factory=list)
    by_part: dict[int, _Row] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)


def test_nested_dataclasses_become_plain_json_and_a_non_finite_figure_becomes_null() -> None:
    res = _Results(rows=[_Row("swarm", 1.5, spread=math.inf, shares=(0.5, np.float32(0.25)))],
                   by_part={1: _Row("raw", float("nan"))}, seen={"b", "a"})
    out = records.jsonable(res)
    text = json.dumps(out, allow_nan=False)  # would raise on Infinity or NaN, or on anything not JSON
    assert json.loads(text) == {
        "rows": [{"label": "swarm", "loss": 1.5, "spread": None, "where": "/tmp/x", "shares": [0.5, 0.25]}],
        "by_part": {"1": {"label": "raw", "loss": None, "spread": None, "where": "/tmp/x", "shares": []}},
        "seen": ["a", "b"],
    }


def test_keep_results_appends_one_record_per_run_with_its_provenance_and_nothing_without_a_path(
        tmp_path: Path) -> None:
    path = tmp_path / "results" / "swarm.jsonl"
    records.keep_results(None, "swarm", _Results(), "python bench/swarm.py --quick", "abc1234")
    assert not path.exists()  # a quick run keeps nothing unless a path is given
    for run in range(2):
        records.keep_results(path, "swarm", _Results(rows=[_Row("swarm", 1.0 + run)]), "python bench/swarm.py",
                             "abc1234", scenarios=("mixing3",))
    kept = records.read_records(path, frozenset({"bench", "results", "tree", "command", "machine", "utc"}))
    assert [r["results"]["rows"][0]["loss"] for r in kept] == [1.0, 2.0]
    assert kept[0]["tree"] == "abc1234" and kept[0]["scenarios"] == ["mixing3"]
    assert kept[0]["command"] == "python bench/swarm.py"
