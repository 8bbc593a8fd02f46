"""Tests for the bounded per-member loss history (node/ops/history.py)."""

from __future__ import annotations

import math
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.config.home import Home
from node.ops.history import (
    DEFAULT_MAX_MEMBERS,
    DEFAULT_MAX_POINTS,
    FORMAT_NAME,
    HistoryError,
    LossHistory,
    _Series,
)

T0 = 1_700_000_000.0


def pack(doc: object) -> bytes:
    return msgpack.packb(doc, use_bin_type=True)


def filled(members: int = 3, points: int = 5) -> LossHistory:
    h = LossHistory()
    for m in range(members):
        for s in range(points):
            h.observe(f"peer{m}", s * 10, s // 2, 5.0 - s * 0.1 - m, None if s % 2 else 4.0 - m, T0 + s)
    return h


# ---- recording ----------------------------------------------------------------------------------


def test_observations_appear_in_series_with_missing_losses_as_none() -> None:
    h = LossHistory()
    assert h.observe("a", 1, 0, 3.5, None, T0)
    assert h.observe("a", 2, 1, 3.0, 2.9, T0 + 1)
    assert h.series() == {
        "a": {
            "t": [T0, T0 + 1],
            "step": [1, 2],
            "outer_step": [0, 1],
            "loss": [3.5, 3.0],
            "val_loss": [None, 2.9],
        }
    }


def test_observation_whose_step_is_not_newer_is_ignored() -> None:
    h = LossHistory()
    h.observe("a", 5, 0, 3.0, 2.0, T0)
    assert not h.observe("a", 5, 0, 9.0, 9.0, T0 + 1)  # same step, nothing missing to fill in
    assert not h.observe("a", 4, 0, 9.0, 9.0, T0 + 2)  # older step
    assert h.series()["a"]["loss"] == [3.0]
    assert h.series()["a"]["val_loss"] == [2.0]


def test_same_step_observation_fills_in_a_missing_validation_loss() -> None:
    h = LossHistory()
    h.observe("a", 5, 0, 3.0, None, T0)
    assert h.observe("a", 5, 0, 9.0, 2.5, T0 + 1)
    s = h.series()["a"]
    assert (s["step"], s["loss"], s["val_loss"]) == ([5], [3.0], [2.5])


def test_observation_without_any_finite_loss_is_not_recorded() -> None:
    h = LossHistory()
    assert not h.observe("relay", 0, 0, None, None, T0)
    assert not h.observe("relay", 1, 0, math.nan, math.inf, T0)
    assert len(h) == 0
    assert h.observe("a", 1, 0, math.inf, 2.0, T0)
    assert h.series()["a"]["loss"] == [None]


def test_full_series_is_thinned_but_stays_evenly_spread_over_the_whole_run() -> None:
    h = LossHistory(max_points=20)
    for s in range(1000):
        h.observe("a", s, 0, 1.0 / (s + 1), None, T0 + s)
        assert h.points("a") <= 20
    steps = h.series()["a"]["step"]
    assert steps[0] == 0 and steps[-1] == 999  # the start of the run and the newest observation
    assert steps == sorted(set(steps))
    assert len(steps) >= 10  # thinning halves, it does not empty
    # Evenly spread: no stretch of the run is much sparser than average (plain repeated halving would
    # leave a handful of points for the first 90% of the run and crowd the rest near the end).
    gaps = [b - a for a, b in zip(steps, steps[1:-1], strict=False)]
    assert max(gaps) <= 2 * 999 / (len(steps) - 1)


def test_sparse_validation_points_survive_thinning() -> None:
    h = LossHistory(max_points=20)
    for s in range(1, 1001):
        h.observe("a", s, 0, 1.0, 0.5 if s % 100 == 0 else None, T0 + s)
    s = h.series()["a"]
    val_steps = [step for step, v in zip(s["step"], s["val_loss"], strict=True) if v is not None]
    assert val_steps == list(range(100, 1001, 100))


def test_history_needs_room_for_at_least_four_points_and_one_member() -> None:
    with pytest.raises(ValueError, match="max_points"):
        LossHistory(max_points=3)
    with pytest.raises(ValueError, match="max_members"):
        LossHistory(max_members=0)


def test_member_with_oldest_last_observation_is_evicted_beyond_capacity() -> None:
    h = LossHistory(max_members=3)
    h.observe("a", 1, 0, 1.0, None, T0 + 10)
    h.observe("b", 1, 0, 1.0, None, T0 + 5)
    h.observe("c", 1, 0, 1.0, None, T0 + 20)
    h.observe("d", 1, 0, 1.0, None, T0 + 30)
    assert h.members() == ["a", "c", "d"]


def test_stale_new_member_does_not_displace_fresher_members() -> None:
    h = LossHistory(max_members=2)
    h.observe("a", 1, 0, 1.0, None, T0 + 10)
    h.observe("b", 1, 0, 1.0, None, T0 + 20)
    assert not h.observe("old", 1, 0, 1.0, None, T0)
    assert h.members() == ["a", "b"]


@pytest.mark.parametrize(
    ("args", "what"),
    [
        (("", 1, 0, 1.0, None, T0), "peer id"),
        (("x" * 129, 1, 0, 1.0, None, T0), "peer id"),
        (("a", -1, 0, 1.0, None, T0), "step"),
        (("a", 1, True, 1.0, None, T0), "outer_step"),
        (("a", 1.5, 0, 1.0, None, T0), "step"),
        (("a", 1, 0, 1.0, None, math.nan), "time"),
    ],
)
def test_observe_rejects_values_no_member_record_can_carry(args: tuple, what: str) -> None:
    with pytest.raises(ValueError, match=what):
        LossHistory().observe(*args)


def test_merge_is_the_union_by_step_preferring_points_with_more_losses() -> None:
    a, b = LossHistory(), LossHistory()
    a.observe("p", 1, 0, 3.0, None, T0)
    a.observe("p", 3, 0, 2.0, None, T0 + 2)
    b.observe("p", 2, 0, 2.5, None, T0 + 1)
    b.observe("p", 3, 0, 2.1, 1.9, T0 + 2)
    b.observe("q", 1, 0, 4.0, None, T0)
    a.merge(b)
    assert a.members() == ["p", "q"]
    p = a.series()["p"]
    assert p["step"] == [1, 2, 3]
    assert p["loss"] == [3.0, 2.5, 2.1]
    assert p["val_loss"] == [None, None, 1.9]


def test_merge_respects_the_point_and_member_limits() -> None:
    small = LossHistory(max_points=8, max_members=2)
    big = LossHistory()
    for m, pid in enumerate(["x", "y", "z"]):
        for s in range(50):
            big.observe(pid, s, 0, 1.0, None, T0 + m * 100 + s)
    small.merge(big)
    assert small.members() == ["y", "z"]
    assert all(small.points(pid) <= 8 for pid in small.members())


# ---- encoding -----------------------------------------------------------------------------------


def test_bytes_round_trip_preserves_every_point() -> None:
    h = filled()
    h.observe("peer0", 1000, 7, None, 1.25, T0 + 99)
    again = LossHistory.from_bytes(h.to_bytes())
    assert again.series() == h.series()


def test_decoding_trims_a_history_larger_than_the_readers_limits() -> None:
    h = filled(members=5, points=40)
    small = LossHistory.from_bytes(h.to_bytes(), max_points=10, max_members=2)
    assert len(small) == 2
    for pid in small.members():
        steps = small.series()[pid]["step"]
        assert len(steps) <= 10
        assert (steps[0], steps[-1]) == (0, 390)


def _valid_doc() -> dict:
    return msgpack.unpackb(filled(members=1, points=3).to_bytes(), raw=False)


def _column(values: list, code: str = "d") -> bytes:
    from array import array

    col = array(code, values)
    return col.tobytes()  # the test machine is little-endian, as the format is


@pytest.mark.parametrize(
    ("mutate", "problem"),
    [
        (lambda d: d.update(v=2), "unsupported version"),
        (lambda d: d.update(format="something-else"), "format"),
        (lambda d: d.update(extra=1), "expected the keys"),
        (lambda d: d.update(members={}), "not a list"),
        (lambda d: d["members"][0].pop(), "list of 7"),
        (lambda d: d["members"][0].__setitem__(0, ""), "member id"),
        (lambda d: d["members"][0].__setitem__(1, -1.0), "min_gap"),
        (lambda d: d["members"][0].__setitem__(1, "x"), "min_gap"),
        (lambda d: d["members"][0].__setitem__(2, b"\0" * 7), "packed 8-byte"),
        (lambda d: d["members"][0].__setitem__(2, _column([T0])), "different lengths"),
        (lambda d: d["members"][0].__setitem__(3, _column([0, 20, 10], "q")), "strictly increasing"),
        (lambda d: d["members"][0].__setitem__(3, _column([-3, 10, 20], "q")), "non-negative"),
        (lambda d: d["members"][0].__setitem__(4, _column([0, -1, 0], "q")), "negative outer"),
        (lambda d: d["members"][0].__setitem__(2, _column([T0, math.inf, T0])), "non-finite"),
        (lambda d: d["members"].append(list(d["members"][0])), "twice"),
        (lambda d: d["members"][0].__setitem__(5, "text"), "packed 8-byte"),
    ],
)
def test_malformed_history_is_refused_with_the_reason(mutate, problem: str) -> None:
    doc = _valid_doc()
    mutate(doc)
    with pytest.raises(HistoryError, match=problem):
        LossHistory.from_bytes(pack(doc))


@pytest.mark.parametrize(
    "data", [b"", b"\xc1", b"\x92\x01", pack([1, 2, 3]), pack({"v": 1}), b"\xdb\xff\xff\xff\xff"]
)
def test_garbage_bytes_raise_history_error_not_a_msgpack_exception(data: bytes) -> None:
    with pytest.raises(HistoryError):
        LossHistory.from_bytes(data)


def test_oversized_column_is_refused_before_decoding_it() -> None:
    doc = _valid_doc()
    doc["members"][0][2] = b"\0" * (65536 * 8 + 8)
    with pytest.raises(HistoryError, match="not valid msgpack"):
        LossHistory.from_bytes(pack(doc))


def test_non_finite_stored_losses_decode_as_missing() -> None:
    doc = _valid_doc()
    doc["members"][0][5] = _column([math.inf, 1.0, -math.inf])
    s = LossHistory.from_bytes(pack(doc)).series()
    assert next(iter(s.values()))["loss"] == [None, 1.0, None]


# ---- files --------------------------------------------------------------------------------------


def test_save_then_load_round_trips_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = Home(tmp_path).history
    h = filled()
    h.save(path)
    filled(members=1).save(path)  # overwrite
    h.save(path)
    assert LossHistory.load(path).series() == h.series()
    assert sorted(p.name for p in tmp_path.iterdir()) == [Home(tmp_path).history.name]


def test_a_history_saved_and_loaded_mid_run_continues_exactly_like_an_uninterrupted_one(
    tmp_path: Path,
) -> None:
    def feed(h: LossHistory, steps: range) -> None:
        for s in steps:
            h.observe("a", s, 0, 1.0 / (s + 1), 0.5 if s % 7 == 0 else None, T0 + s)

    straight, resumed = LossHistory(max_points=16), LossHistory(max_points=16)
    feed(straight, range(300))
    feed(resumed, range(150))
    resumed.save(Home(tmp_path).history)
    resumed = LossHistory.load(Home(tmp_path).history, max_points=16)
    feed(resumed, range(150, 300))
    assert resumed.series() == straight.series()


def test_loading_a_missing_file_gives_an_empty_history(tmp_path: Path) -> None:
    h = LossHistory.load(Home(tmp_path).history)
    assert len(h) == 0 and h.series() == {}


@pytest.mark.parametrize(
    "content", [b"not msgpack \xc1", pack({"format": FORMAT_NAME, "v": 99, "members": []})]
)
def test_loading_a_corrupt_file_names_the_file(tmp_path: Path, content: bytes) -> None:
    path = Home(tmp_path).history
    path.write_bytes(content)
    with pytest.raises(HistoryError) as info:
        LossHistory.load(path)
    assert str(path) in str(info.value)
    assert info.value.path == path


def test_loading_a_directory_raises_history_error(tmp_path: Path) -> None:
    (Home(tmp_path).history).mkdir()
    with pytest.raises(HistoryError, match="cannot be read"):
        LossHistory.load(Home(tmp_path).history)


# ---- properties ---------------------------------------------------------------------------------

observations = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c", "d", "e"]),
        st.integers(0, 60),
        st.integers(0, 5),
        st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
        st.one_of(st.none(), st.floats(0, 10)),
        st.floats(0, 1e9),
    ),
    max_size=120,
)


@settings(max_examples=60, deadline=None)
@given(observations)
def test_any_observation_sequence_keeps_the_bounds_and_round_trips(obs: list) -> None:
    h = LossHistory(max_points=6, max_members=3)
    for o in obs:
        h.observe(*o)
    assert len(h) <= 3
    for pid, s in h.series().items():
        assert len(s["step"]) <= 6
        assert s["step"] == sorted(set(s["step"]))
        assert all(v is None or math.isfinite(v) for v in s["loss"] + s["val_loss"])
        assert any(v is not None for v in s["loss"] + s["val_loss"]), pid
    assert LossHistory.from_bytes(h.to_bytes(), max_points=6, max_members=3).series() == h.series()


def test_a_full_history_answers_the_control_socket_within_its_limit_and_plots() -> None:
    """At the history's own bounds (256 members x 2,000 points) the whole series was ~34 MiB of JSON, over
    the control client's 16 MiB: `starling plot` of a running daemon failed. The answer is spread thin."""
    import json

    from node.daemon import HISTORY_ANSWER_POINTS
    from node.ops.control import MAX_RESPONSE
    from node.ops.history import series_of

    full = LossHistory()
    for m in range(DEFAULT_MAX_MEMBERS):
        series = full._members.setdefault(f"12D3KooW{m:040d}", _Series())
        for k in range(DEFAULT_MAX_POINTS):
            series.append(1.7e9 + 10.123456 * k, 50 * k + 7, k, 5.0 - k * 1.234567e-3, 4.9 - k * 1.234567e-3)
    assert len(json.dumps({"ok": True, "history": full.series()})) > MAX_RESPONSE  # the failure this fixes
    answer = series_of(full.snapshot(), HISTORY_ANSWER_POINTS)
    assert len(json.dumps({"ok": True, "history": answer})) < MAX_RESPONSE // 2
    for columns in answer.values():
        assert columns["step"][0] == 7 and columns["step"][-1] == 50 * (DEFAULT_MAX_POINTS - 1) + 7
        assert len(columns["step"]) <= HISTORY_ANSWER_POINTS // DEFAULT_MAX_MEMBERS
    assert LossHistory.from_series(answer).members() == full.members()
