"""Checkpoint files: atomic writes, last-N retention, corruption detected and the previous one used."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from node.checkpoint import CheckpointError, CheckpointStore, read_checkpoint, write_checkpoint


def state(step: int) -> dict:
    return {"step": step, "weights": torch.full((64,), float(step)), "nested": {"lr": 0.1, "pair": (1, 2)}}


def test_a_checkpoint_round_trips(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    store.save(state(7), 7)
    loaded = store.load_latest().checkpoint
    assert loaded is not None and loaded.step == 7
    assert loaded.state["step"] == 7 and torch.equal(loaded.state["weights"], torch.full((64,), 7.0))
    assert loaded.state["nested"] == {"lr": 0.1, "pair": (1, 2)}


def test_only_the_newest_n_checkpoints_are_kept(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for step in (10, 20, 30, 40):
        store.save(state(step), step)
    assert [s for s, _ in store.checkpoints()] == [40, 30]
    assert store.load_latest().checkpoint.step == 40


def test_a_flipped_byte_is_detected_and_the_previous_checkpoint_used(tmp_path: Path, caplog) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    store.save(state(1), 1)
    newest = store.save(state(2), 2)
    raw = bytearray(newest.read_bytes())
    raw[-100] ^= 0xFF
    newest.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="starling.checkpoint"):
        result = store.load_latest()
    assert result.checkpoint is not None and result.checkpoint.step == 1
    assert [(p, why) for p, why in result.rejected] == [(newest, "hash mismatch (the file is corrupt)")]
    assert "rejected" in caplog.text and str(newest) in caplog.text
    # Set aside, so it is not tried again and a later save of the same step is not confused with it.
    assert not newest.exists() and newest.with_name(newest.name + ".corrupt").exists()


def test_a_truncated_checkpoint_is_detected_and_the_previous_one_used(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    store.save(state(1), 1)
    newest = store.save(state(2), 2)
    newest.write_bytes(newest.read_bytes()[:-10])
    result = store.load_latest()
    assert result.checkpoint.step == 1
    assert result.rejected[0][1] == "truncated payload"


def test_a_file_that_is_not_a_checkpoint_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "ckpt-000000000001.pt"
    path.write_bytes(b"hello, this is not a checkpoint at all, just some bytes")
    with pytest.raises(CheckpointError, match="bad magic"):
        read_checkpoint(path)
    (tmp_path / "short.pt").write_bytes(b"STL")
    with pytest.raises(CheckpointError, match="truncated header"):
        read_checkpoint(tmp_path / "short.pt")


def test_when_every_checkpoint_is_corrupt_there_is_none_and_all_are_reported(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    for step in (1, 2):
        store.save(state(step), step).write_bytes(b"STLCKPT1" + b"\0" * 60)
    result = store.load_latest()
    assert result.checkpoint is None
    assert len(result.rejected) == 2


def test_a_check_that_refuses_a_checkpoint_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    store.save(state(1), 1)
    store.save({**state(2), "model": "other"}, 2)

    def check(s: dict) -> None:
        if s.get("model") == "other":
            raise CheckpointError("checkpoint is for a different model")

    result = store.load_latest(check=check)
    assert result.checkpoint.step == 1
    assert result.rejected[0][1] == "checkpoint is for a different model"


def test_a_failed_write_leaves_the_previous_checkpoint_and_no_partial_file(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    store.save(state(1), 1)
    with pytest.raises(Exception):  # noqa: B017 - whatever torch.save raises for an unpicklable value
        store.save({"step": 2, "bad": lambda: None}, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000000001.pt"]
    assert store.load_latest().checkpoint.step == 1


def test_temp_files_left_by_a_crashed_writer_are_ignored_and_cleaned(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "ckpt-000000000001.pt", state(1))
    stale = tmp_path / ".ckpt-tmp-ckpt-000000000009.pt.12345"
    stale.write_bytes(b"half a checkpoint")
    store = CheckpointStore(tmp_path, keep=3)
    assert not stale.exists()
    assert store.load_latest().checkpoint.step == 1


def test_loading_never_runs_code_from_the_file(tmp_path: Path) -> None:
    # A hash-valid file whose payload is a pickle with a callable is refused by weights_only loading.
    import hashlib
    import pickle
    import struct

    payload = pickle.dumps({"x": print}, protocol=2)
    path = tmp_path / "ckpt-000000000005.pt"
    path.write_bytes(struct.pack(">8s32sQ", b"STLCKPT1", hashlib.sha256(payload).digest(), len(payload)) + payload)
    with pytest.raises(CheckpointError, match="does not load"):
        read_checkpoint(path)
