"""Late join: a trainer with no checkpoint starts from the swarm's weights, not from a fresh model.

Before the worker's first inner step, the daemon looks for alive trainers that have made outer steps,
downloads the slow weights and step counters of up to `train.join_donors` of them at once (chunked,
hashed, resumable: `protocols/snapshot.py`), and leaves their mean in `HOME/join/snapshot.pt` (a hashed
checkpoint file). The worker starts from it when it has no checkpoint of its own, keeping its own data
shard and a fresh inner optimizer. Donors serve from their newest verified checkpoint.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
from libp2p.peer.id import ID

from node.checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from protocols.snapshot import PROTOCOL_ID, JoinDownload, Snapshot, combine

log = logging.getLogger("starling.latejoin")

JOIN_DIR = "join"
JOIN_FILE = "snapshot.pt"
CHECKPOINT_DIR = "checkpoints"


def join_snapshot_path(home: Path) -> Path:
    return home / JOIN_DIR / JOIN_FILE


def _checkpoint_files(home: Path) -> list[Path]:
    """Every checkpoint under HOME/checkpoints/<task>-<model>/, newest first (by modification time)."""
    directory = home / CHECKPOINT_DIR
    if not directory.is_dir():
        return []
    files = [p for p in directory.glob("*/ckpt-*.pt") if p.is_file()]
    return sorted(files, key=lambda p: p.stat().st_mtime, reverse=True)


def has_checkpoint(home: Path) -> bool:
    return bool(_checkpoint_files(home))


def snapshot_source(home: Path) -> Callable[[], Snapshot | None]:
    """What a donor serves: its newest checkpoint's slow weights, cached until a newer one appears.

    Called in a worker thread (reading and hashing a checkpoint takes a while for a large model).
    """
    cache: dict[str, Any] = {"path": None, "snapshot": None}

    def source() -> Snapshot | None:
        for path in _checkpoint_files(home):
            if cache["path"] == path:
                return cache["snapshot"]
            try:
                state = read_checkpoint(path)
                snap = Snapshot.of(state["phi"], int(state["step"]), int(state["outer_step"]), str(state["layout_hash"]))
            except (CheckpointError, KeyError, TypeError, ValueError) as e:
                log.debug("not serving %s: %s", path, e)
                continue
            cache.update(path=path, snapshot=snap)
            return snap
        return None

    return source


async def late_join(
    host: Any,
    home: Path,
    donors: Callable[[], list[str]],
    *,
    max_donors: int,
    wait_s: float,
    timeout_s: float,
    status: dict[str, Any],
) -> bool:
    """Download a starting point from the swarm if this node has no checkpoint. True if one was written."""
    target = join_snapshot_path(home)
    if has_checkpoint(home) or target.exists():
        status["state"] = "not needed"
        return False
    status["state"] = "looking for donors"
    deadline = trio.current_time() + wait_s
    found: list[str] = []
    while trio.current_time() < deadline:
        found = donors()
        if found:
            break
        await trio.sleep(0.5)
    if not found:
        status["state"] = "no donors: starting a fresh model"
        log.info("no trained swarm members found within %.0fs; starting from a fresh model", wait_s)
        return False
    chosen = random.sample(found, min(max_donors, len(found)))
    status.update(state="downloading", donors=chosen)
    download = JoinDownload(home / JOIN_DIR / "partial")
    status["progress"] = download.progress

    async def open_stream(donor: str) -> Any:
        return await host.new_stream(ID.from_base58(donor), [PROTOCOL_ID])

    async with trio.open_nursery() as nursery:
        for donor in chosen:
            nursery.start_soon(functools.partial(download.fetch, open_stream, donor, timeout_s=timeout_s))
    complete = download.complete()
    for p in download.progress.values():
        if not p.done:
            log.warning("snapshot download from %s incomplete: %s", p.donor, p.error or "stopped")
    if not complete:
        status["state"] = "download failed: starting a fresh model (will resume the download next start)"
        return False
    state = await trio.to_thread.run_sync(combine, complete)
    target.parent.mkdir(parents=True, exist_ok=True)
    await trio.to_thread.run_sync(write_checkpoint, target, state)
    download.clear()
    status.update(state="done", step=state["step"], outer_step=state["outer_step"], donors=state["donors"])
    log.info("joined the swarm at outer step %d from the mean of %d donors", state["outer_step"], len(state["donors"]))
    return True


def progress_view(status: dict[str, Any]) -> dict[str, Any]:
    """The JSON-friendly `join` section of status."""
    out = {k: v for k, v in status.items() if k != "progress"}
    progress = status.get("progress")
    if progress:
        out["downloads"] = {
            d: {"have_chunks": p.have, "done": p.done, "bytes": p.bytes, "error": p.error} for d, p in progress.items()
        }
    return out
