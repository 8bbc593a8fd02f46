"""What serving a joiner costs a donor in memory: the live weights (issue #55) against a checkpoint's.

Why: a donor now serves its worker's current slow weights straight from the shared phi slot
(node/bridge/livephi.py), where it used to load its newest checkpoint's phi into a model-sized buffer first.
Issue #55 asks that serving adds no model-sized buffer; this measures it, both ways, in one run.

How: one process holds a donor and a joiner (two libp2p hosts on 127.0.0.1), a phi slot of N float32 values
(the daemon's view of the worker's slot, touched before measuring) and `protocols.snapshot`'s real server and
download. For each source, the peak of the memory Python and numpy allocate while one joiner downloads the
whole snapshot (`tracemalloc`, which numpy reports its arrays to) is read, less what was allocated before:

- live: `LivePhi.snapshot` over the slot (hashed in place, chunks copied 1 MiB at a time);
- checkpoint: the slot written as a checkpoint file (`write_phi`), served by `snapshot_source` as before.

The joiner's own allocations (its 1 MiB chunks, written to disk) are in both figures alike.

    .venv/bin/python bench/donor_memory.py                 # 64M values (256 MB), about a minute
    .venv/bin/python bench/donor_memory.py --numel 16M
    .venv/bin/python bench/donor_memory.py --write-docs    # the `## Donor memory` section of docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
import tracemalloc
from contextlib import AsyncExitStack
from pathlib import Path

import numpy as np
import trio
from libp2p.peer.id import ID

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from node.averaging.latejoin import snapshot_source  # noqa: E402
from node.bridge.ckptfile import write_phi  # noqa: E402
from node.bridge.livephi import LivePhi  # noqa: E402
from protocols import snapshot as snap  # noqa: E402
from starling_testing.hosts import connected_pair  # noqa: E402
from starling_testing.report import replace_section  # noqa: E402

DOCS = ROOT / "docs" / "benchmarks.md"
SECTION = "## Donor memory"



def parse_count(text: str) -> int:
    units = {"K": 1_000, "M": 1_000_000, "G": 1_000_000_000}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1:].upper() in units else int(text)


async def download_peak(server: snap.SnapshotServer, numel: int, work: Path) -> tuple[int, bool]:
    """Bytes allocated at the peak of one whole download from `server` (above the start), and whether it
    completed."""
    async with AsyncExitStack() as stack:
        donor, joiner = await connected_pair(stack, {snap.PROTOCOL_ID: server.handle})

        async def open_stream(peer: str):  # type: ignore[no-untyped-def]
            return await joiner.new_stream(ID.from_base58(peer), [snap.PROTOCOL_ID])

        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        progress = await snap.JoinDownload(work, snap.ModelShape("L", numel)).fetch(
            open_stream, str(donor.get_id()), timeout_s=600)
        _, peak = tracemalloc.get_traced_memory()
    return peak - base, progress.done


async def measure(numel: int) -> dict[str, float]:
    slot = np.random.default_rng(0).standard_normal(numel, dtype=np.float32)  # touched: resident already
    with tempfile.TemporaryDirectory(prefix="starling-donor-mem-") as tmp:
        home = Path(tmp) / "home"
        folder = home / "checkpoints" / "task-model"
        folder.mkdir(parents=True)
        write_phi(folder / f"ckpt-{100:012d}.pt", slot, 100, 10, "L")
        live = LivePhi()
        live.attached(slot, "L")
        live.metrics(0, step=100, outer_step=10)
        tracemalloc.start()
        try:
            live_peak, live_done = await download_peak(snap.SnapshotServer(lambda: None, live=live.snapshot), numel,
                                                       Path(tmp) / "live")
            ckpt_peak, ckpt_done = await download_peak(snap.SnapshotServer(snapshot_source(home)), numel,
                                                       Path(tmp) / "ckpt")
        finally:
            tracemalloc.stop()
    if not (live_done and ckpt_done):
        raise SystemExit("a download did not complete")
    model = numel * 4
    return {"model_bytes": model, "live_peak": live_peak, "checkpoint_peak": ckpt_peak}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", default="64M", help="values in the phi slot (e.g. 16M, 64M; default 64M)")
    p.add_argument("--write-docs", action="store_true", help=f"write the {SECTION} section of docs/benchmarks.md")
    args = p.parse_args(argv)
    try:
        numel = parse_count(args.numel)
    except ValueError:
        p.error(f"--numel: a count such as 16M, got {args.numel!r}")
    if not 1 <= numel <= 2_000_000_000:
        p.error("--numel: between 1 and 2G")
    r = trio.run(measure, numel)
    mib = 1 << 20
    lines = [
        f"phi slot: {numel:,} values ({r['model_bytes'] / mib:.0f} MiB)",
        "peak allocated while one joiner downloads it, above the start (donor and joiner in one process):",
        f"  live weights (node/bridge/livephi.py): {r['live_peak'] / mib:8.1f} MiB = "
        f"{r['live_peak'] / r['model_bytes']:.3f} of the model",
        f"  checkpoint file (before issue #55):    {r['checkpoint_peak'] / mib:8.1f} MiB = "
        f"{r['checkpoint_peak'] / r['model_bytes']:.3f} of the model",
    ]
    print("\n".join(lines))
    if args.write_docs:
        command = " ".join(["python bench/donor_memory.py", *(argv if argv is not None else sys.argv[1:])])
        body = [SECTION, "",
                f"`{command}` on {os.cpu_count()} cores ({platform.machine()}), {time.strftime('%Y-%m-%d')}: what "
                "serving one late joiner the whole of its slow weights costs a donor in memory, measured with "
                "`tracemalloc` (numpy reports its arrays to it) in one process holding the donor, the joiner "
                "(two libp2p hosts on 127.0.0.1) and the daemon's view of the phi slot. Issue #55 asks that "
                "serving add no model-sized buffer.", "", "```", *lines, "```", ""]
        replace_section(DOCS, SECTION, "\n".join(body))
        print(f"wrote the {SECTION} section of docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
