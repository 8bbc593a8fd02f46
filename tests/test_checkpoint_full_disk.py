"""A checkpoint written onto a full disk: a clear ENOSPC error, the previous checkpoint intact, no debris.

The checkpoints directory is a tiny tmpfs (root mounts it; the tests skip, saying why, where mounting is
not allowed). The disk is filled with a file until the kernel refuses more, then some room is given back -
less than a checkpoint needs - so the write fails at its first byte, inside the raw slow weights (written by
Starling itself) or part-way through the torch payload, where a writer is most likely to leave a truncated
file behind. Where it fails matters: torch's zip writer turns an ENOSPC from the file into an opaque
RuntimeError ("unexpected pos ..."), except when the final flush happens to fail too.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from node.worker.checkpoint import CheckpointStore, read_checkpoint
from starling_testing.disk import tiny_tmpfs

TMPFS_SIZE = 1 << 20  # bytes: room for a few checkpoints of STATE_ELEMS floats


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, unmounted when the test ends."""
    with tiny_tmpfs(tmp_path / "disk", TMPFS_SIZE) as mountpoint:
        yield mountpoint



def tiny_state(step: int) -> dict:
    """A small model's training state: slow weights (a third of the file), weights, an optimizer's moments,
    counters. An eighth of a checkpoint's room runs out inside phi, three quarters inside the payload."""
    weights = torch.full((16_000,), float(step))
    return {"step": step, "outer_step": step // 10, "layout_hash": "abc", "phi": weights * 2, "model": {"w": weights},
            "optimizer": {"exp_avg": weights * 0.5}, "lr": 0.001}


def fill(directory: Path, leave_free: int) -> Path:
    """Fill the file system holding `directory` until it refuses more, then free `leave_free` bytes."""
    filler = directory / "filler.bin"
    block = b"\xa5" * 4096
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    os.truncate(filler, max(0, filler.stat().st_size - leave_free))
    return filler


@pytest.mark.parametrize("free_fraction", [0.0, 0.125, 0.75], ids=["no-room", "an-eighth", "three-quarters"])
def test_a_checkpoint_write_on_a_full_disk_fails_with_enospc_and_keeps_the_previous_one(
    tiny_disk: Path, free_fraction: float
) -> None:
    store = CheckpointStore(tiny_disk / "checkpoints", keep=3)
    first = store.save(tiny_state(10), 10)
    fill(tiny_disk, leave_free=int(first.stat().st_size * free_fraction))  # room for part of the next one

    with pytest.raises(Exception) as failure:  # noqa: B017 - which exception is checked last, below
        store.save(tiny_state(20), 20)

    # Nothing but the previous checkpoint: no temp file, no truncated step-20 file; and it still loads.
    assert sorted(p.name for p in store.directory.iterdir()) == [first.name]
    result = store.load_latest()
    assert result.rejected == []
    assert result.checkpoint is not None and result.checkpoint.step == 10
    assert torch.equal(result.checkpoint.state["model"]["w"], tiny_state(10)["model"]["w"])
    assert torch.equal(result.checkpoint.state["phi"], tiny_state(10)["phi"])
    # The error says what happened, in the exception itself (not only in a chained cause).
    assert isinstance(failure.value, OSError) and failure.value.errno == errno.ENOSPC, repr(failure.value)
    assert os.strerror(errno.ENOSPC) in str(failure.value)


def test_checkpoints_are_written_again_once_space_is_freed(tiny_disk: Path) -> None:
    store = CheckpointStore(tiny_disk / "checkpoints", keep=2)
    store.save(tiny_state(10), 10)
    filler = fill(tiny_disk, leave_free=0)
    with pytest.raises(OSError):
        store.save(tiny_state(20), 20)

    filler.unlink()
    for step in (30, 40):
        store.save(tiny_state(step), step)

    assert [s for s, _ in store.checkpoints()] == [40, 30]
    assert read_checkpoint(store.path_for(40))["step"] == 40
    assert not [p for p in store.directory.iterdir() if p.name.startswith(".")]  # no temp files


def test_the_daemons_snapshot_write_on_a_full_disk_fails_with_enospc_and_leaves_nothing(tiny_disk: Path) -> None:
    from node.bridge.ckptfile import write_phi  # the daemon's torch-free writer (node/averaging/latejoin.py)

    join = tiny_disk / "join"
    join.mkdir()
    fill(tiny_disk, leave_free=16_000)  # a quarter of the slow weights
    with pytest.raises(OSError) as failure:
        write_phi(join / "snapshot.pt", tiny_state(10)["phi"].numpy(), 10, 1, "abc")
    assert failure.value.errno == errno.ENOSPC
    assert list(join.iterdir()) == []
