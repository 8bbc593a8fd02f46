"""bench/donor_memory.py (issue #55): serving a joiner the live weights adds no model-sized buffer to the donor,
where serving a checkpoint loaded one."""

from __future__ import annotations

import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import donor_memory  # noqa: E402


def test_serving_live_weights_allocates_a_fraction_of_the_model_where_a_checkpoint_allocated_all_of_it() -> None:
    r = trio.run(donor_memory.measure, 8_000_000)  # 32 MB: a few MiB of chunks and buffers are a small part
    assert r["live_peak"] < 0.5 * r["model_bytes"], r
    assert r["checkpoint_peak"] > r["model_bytes"], r  # the baseline really holds the model: the bench can tell
