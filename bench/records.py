"""Raw bench results as JSON lines under bench/results/ (issue #52, item 2): each finished run appends one
record with its figures and where they came from (the tree, the command, the machine, the time), and the docs
render from the file, so a figure in docs/benchmarks.md can be traced to the run that made it and rerun.

Shared by the benches that keep their results (compression_long, phi_schemes, wan, swarm, sync, scale)."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"


def tree_id() -> str:
    """HEAD's short hash, with "+changes" when the working tree differs from it."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no").strip()
    return head + ("+changes" if dirty else "")


def provenance(command: str, tree: str | None = None) -> dict[str, str]:
    """Where a record comes from: the tree (`tree`: read when the run started, HEAD may move during it), the
    command line, the machine and the time it finished."""
    return {"tree": tree or tree_id(), "command": command,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.node()}",
            "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def jsonable(value: Any) -> Any:
    """`value` as plain JSON: dataclasses as dicts, tuples and sets as lists, paths as strings, numpy scalars as
    numbers, and a float that JSON cannot hold (inf, nan) as None. Why: a bench's results are nested
    dataclasses, and `json.dumps` would either refuse them or write `Infinity`, which is not JSON."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [jsonable(v) for v in items]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item):  # a numpy or torch scalar
        return jsonable(value.item())
    return repr(value)


def keep_results(path: Path | None, bench: str, results: Any, command: str, tree: str, **extra: Any) -> None:
    """Append one record of a whole run of `bench` (its results made `jsonable`, `extra` beside them, and the
    provenance) to `path`; nothing where `path` is None (a quick run). Tells stderr where it went."""
    if path is None:
        return
    record = {"bench": bench, **{k: jsonable(v) for k, v in extra.items()}, "results": jsonable(results),
              **provenance(command, tree)}
    append_record(path, record)
    print(f"raw results appended to {path}", file=sys.stderr)


def append_record(path: Path, record: dict) -> None:
    """One line, written whole under an exclusive lock: concurrent runs never interleave."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        fcntl.flock(f, fcntl.LOCK_UN)


def read_records(path: Path, keys: frozenset[str]) -> list[dict]:
    """Every well-formed record of `path`, one with all of `keys` (a line cut by a killed run is skipped, not
    fatal)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and keys <= record.keys():
            records.append(record)
    return records
