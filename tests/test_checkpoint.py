"""Checkpoint files: atomic writes, last-N retention, corruption detected and the previous one used; the
format-2 layout (phi apart, read and written by the daemon without torch) and format-1 files still read."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from node.bridge import ckptfile
from node.bridge.ckptfile import read_phi, write_phi
from node.worker.checkpoint import CheckpointError, CheckpointStore, read_checkpoint, write_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def state(step: int) -> dict:
    return {"step": step, "weights": torch.full((64,), float(step)), "nested": {"lr": 0.1, "pair": (1, 2)},
            "phi": torch.arange(32, dtype=torch.float32) * step}


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


# -- format 2: phi apart, for the daemon -------------------------------------------------------------------


def worker_state(numel: int = 1000, step: int = 120) -> dict[str, Any]:
    """Shaped like node.worker.trainer.Trainer.state_dict(): phi beside a model, an optimizer, RNG and counters."""
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return {
        "format": 2, "task": "tiny", "model_hash": "m" * 64, "layout_hash": "l" * 64,
        "step": step, "outer_step": step // 10, "last_publish_step": step - 10,
        "model": model.state_dict(), "phi": torch.randn(numel),
        "outer": {"momentum": torch.randn(numel), "kind": "nesterov"},
        "optimizer": opt.state_dict(), "scaler": {}, "data": {"position": 77, "epoch": (1, 2)},
        "rng": {"cpu": torch.get_rng_state()}, "val_loss": None,
    }


def same(a: Any, b: Any) -> bool:
    """Equal values, tensors by dtype, shape and content (nested dicts, lists and tuples too)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def sections(path: Path) -> dict[str, tuple[int, int]]:
    """(offset, length) of each section of a format-2 file."""
    raw = path.read_bytes()
    assert raw[:8] == b"STLCKPT2"
    meta_len, phi_len = struct.unpack(">QQ", raw[48:64])
    return {"lengths": (48, 16), "meta": (64, meta_len), "phi": (64 + meta_len, phi_len),
            "payload": (64 + meta_len + phi_len, len(raw) - 64 - meta_len - phi_len)}


def flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x10
    path.write_bytes(bytes(raw))


def test_a_worker_state_round_trips_in_format_2_with_phi_in_its_own_section(tmp_path: Path) -> None:
    path = tmp_path / "ckpt-000000000120.pt"
    saved = worker_state()
    write_checkpoint(path, saved)
    parts = sections(path)
    assert parts["phi"][1] == 1000 * 4 and parts["payload"][1] > 0
    raw = path.read_bytes()
    start, length = parts["phi"]
    assert raw[start : start + length] == saved["phi"].numpy().astype("<f4").tobytes()  # raw little-endian fp32
    assert hashlib.sha256(raw[48:]).digest() == raw[8:40]  # one hash over every section
    loaded = read_checkpoint(path)
    assert same(loaded, saved)
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_a_format_1_file_written_by_the_old_code_still_reads(tmp_path: Path) -> None:
    saved = worker_state()
    buf = io.BytesIO()
    torch.save(saved, buf)
    payload = buf.getvalue()
    path = tmp_path / "ckpt-000000000120.pt"
    path.write_bytes(struct.pack(">8s32sQ", b"STLCKPT1", hashlib.sha256(payload).digest(), len(payload)) + payload)
    assert same(read_checkpoint(path), saved)
    assert CheckpointStore(tmp_path, keep=3).load_latest().checkpoint.step == 120
    # The daemon cannot: phi is inside the torch payload. The worker's next checkpoint is format 2.
    with pytest.raises(CheckpointError, match="format-1"):
        read_phi(path)


def test_the_daemon_reads_phi_and_counters_of_a_worker_checkpoint_and_writes_a_snapshot_without_torch(
    tmp_path: Path,
) -> None:
    saved = worker_state(numel=300)
    write_checkpoint(tmp_path / "ckpt-000000000120.pt", saved)
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from node.bridge.ckptfile import read_phi, write_phi\n"
        f"s = read_phi(Path({str(tmp_path / 'ckpt-000000000120.pt')!r}))\n"
        f"write_phi(Path({str(tmp_path / 'snapshot.pt')!r}), s.phi * 2, s.step, s.outer_step + 1, s.layout_hash,"
        " donors=['peer-a', 'peer-b'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print(json.dumps({'phi': s.phi.tolist(), 'dtype': str(s.phi.dtype), 'step': s.step,"
        " 'outer_step': s.outer_step, 'layout_hash': s.layout_hash}))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["dtype"] == "float32" and got["phi"] == saved["phi"].tolist()
    assert (got["step"], got["outer_step"], got["layout_hash"]) == (120, 12, "l" * 64)
    # What the worker reads from the daemon's file (node.worker.trainer.Trainer.read_swarm_snapshot).
    snapshot = read_checkpoint(tmp_path / "snapshot.pt")
    assert same(snapshot, {"step": 120, "outer_step": 13, "layout_hash": "l" * 64, "donors": ["peer-a", "peer-b"],
                           "phi": saved["phi"] * 2})


def test_write_phi_gives_the_state_dict_the_worker_expects(tmp_path: Path) -> None:
    path = tmp_path / "join" / "snapshot.pt"
    path.parent.mkdir()
    phi = np.linspace(-1, 1, 50, dtype=np.float32)
    write_phi(path, phi, 40, 4, "abc")
    state = read_checkpoint(path)
    assert state.keys() == {"phi", "step", "outer_step", "layout_hash"}
    assert same(state, {"phi": torch.from_numpy(phi), "step": 40, "outer_step": 4, "layout_hash": "abc"})
    assert sections(path)["payload"][1] == 0  # no torch payload
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp file left
    back = read_phi(path)
    assert np.array_equal(back.phi, phi) and (back.step, back.outer_step, back.layout_hash, back.donors) == (
        40, 4, "abc", [])
    # A float64 array is stored as float32; any shape is flattened.
    write_phi(path, np.ones((2, 3)), 1, 0, "abc")
    assert same(read_checkpoint(path)["phi"], torch.ones(6))


@pytest.mark.parametrize("section", ["lengths", "meta", "phi", "payload"])
def test_a_bit_flip_in_any_section_is_detected_and_the_file_set_aside(tmp_path: Path, section: str) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    store.save(worker_state(step=110), 110)
    newest = store.save(worker_state(step=120), 120)
    start, length = sections(newest)[section]
    flip(newest, start + length // 2)
    with pytest.raises(CheckpointError, match="corrupt"):
        read_phi(newest)
    with pytest.raises(CheckpointError, match="corrupt"):
        read_checkpoint(newest)
    result = store.load_latest()
    assert result.checkpoint is not None and result.checkpoint.step == 110
    assert len(result.rejected) == 1 and "corrupt" in result.rejected[0][1]
    assert newest.with_name(newest.name + ".corrupt").exists()


@pytest.mark.parametrize("cut", [1, 10, 5000])
def test_a_truncated_format_2_file_is_detected(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "ckpt-000000000120.pt"
    write_checkpoint(path, worker_state())
    path.write_bytes(path.read_bytes()[:-cut])
    for read in (read_phi, read_checkpoint):
        with pytest.raises(CheckpointError, match="truncated payload"):
            read(path)


def test_phi_and_the_payload_are_read_in_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckptfile, "CHUNK_BYTES", 1001)  # many chunks, none aligned to a float
    path = tmp_path / "ckpt-000000000120.pt"
    saved = worker_state(numel=5000)
    write_checkpoint(path, saved)
    assert same(read_checkpoint(path), saved)
    assert np.array_equal(read_phi(path).phi, saved["phi"].numpy())
    flip(path, sum(sections(path)["payload"]) - 3)
    with pytest.raises(CheckpointError, match="hash mismatch"):
        read_phi(path)


def test_read_phi_refuses_a_checkpoint_without_slow_weights(tmp_path: Path) -> None:
    path = tmp_path / "ckpt-000000000001.pt"
    write_checkpoint(path, {"step": 1, "weights": torch.zeros(3)})
    with pytest.raises(CheckpointError, match="no slow weights"):
        read_phi(path)
    assert same(read_checkpoint(path), {"step": 1, "weights": torch.zeros(3)})
    write_checkpoint(path, {"phi": torch.zeros(3)})  # slow weights but no counters
    with pytest.raises(CheckpointError, match="step counters"):
        read_phi(path)


def test_loading_a_format_2_payload_never_runs_code_either(tmp_path: Path) -> None:
    import pickle

    path = tmp_path / "ckpt-000000000005.pt"
    ckptfile.write_file(path, {}, None, lambda w: w.write(pickle.dumps({"x": print}, protocol=2)))
    with pytest.raises(CheckpointError, match="does not load"):
        read_checkpoint(path)


def test_a_numpy_phi_given_to_write_checkpoint_goes_to_the_raw_section_and_reads_back_as_a_tensor(
    tmp_path: Path,
) -> None:
    # Pickled into the torch payload, a numpy array would make a file that weights-only loading refuses.
    path = tmp_path / "snapshot.pt"
    phi = np.arange(12, dtype=np.float32).reshape(3, 4)
    write_checkpoint(path, {"phi": phi, "step": 3, "outer_step": 1, "layout_hash": "abc", "donors": ["p"]})
    assert sections(path)["phi"][1] == 12 * 4
    assert same(read_checkpoint(path), {"phi": torch.from_numpy(phi), "step": 3, "outer_step": 1,
                                        "layout_hash": "abc", "donors": ["p"]})
    assert read_phi(path).step == 3


def test_a_phi_shape_of_more_dimensions_than_numpy_allows_is_refused_before_its_product(tmp_path: Path) -> None:
    """The shape's product over a long list of big integers takes seconds per 10k entries; its length is
    checked first (a 1 MiB meta holds ~100k of them)."""
    path = tmp_path / "ckpt-000000000001.pt"
    phi = np.zeros(12, dtype=np.float32)
    ckptfile.write_file(path, {"step": 1, "outer_step": 1, "layout_hash": "L", "numel": 12,
                               "shape": [1] * (ckptfile.MAX_DIMS + 1) + [12]}, phi, None)
    with pytest.raises(CheckpointError, match="size does not match"):
        read_phi(path)
    ckptfile.write_file(path, {"step": 1, "outer_step": 1, "layout_hash": "L", "numel": 12, "shape": [3, 4]}, phi, None)
    assert read_phi(path).phi.size == 12
