"""A worker group's processes as the daemon sees them: where the ranks meet, and ranks 1..W-1 as processes.

node/worker/group.py says how a group of `train.local_ranks` processes trains as one node. This module is
the part the daemon needs (node/bridge/supervisor.py starts and stops the ranks), kept apart from that one so
that the daemon loads no torch.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import trio

log = logging.getLogger("starling.worker_group")

@dataclass(frozen=True)
class Rendezvous:
    """Where a worker group's processes meet: a fresh directory holding their torch.distributed FileStore
    (opened by the ranks, node/worker/group.py `group_store`: the daemon, which starts them, loads no torch)."""

    directory: Path
    world_size: int


class FollowerProcs:
    """Ranks 1..W-1 of one worker-group lifetime, started next to rank 0 by node/bridge/supervisor.py and
    stopped (killed after a grace period) with it; each lifetime meets in a fresh directory."""

    def __init__(self, world_size: int, python: str) -> None:
        self.rendezvous = Rendezvous(Path(tempfile.mkdtemp(prefix="starling-group-")), world_size)
        self._python = python
        self.procs: list[trio.Process] = []

    def leader_args(self) -> list[str]:
        """Rank 0's extra command-line arguments."""
        return ["--group", str(self.rendezvous.directory), "--world-size", str(self.rendezvous.world_size)]

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    async def start(self) -> None:
        for rank in range(1, self.rendezvous.world_size):
            self.procs.append(await trio.lowlevel.open_process(
                [self._python, "-P", "-m", "node.worker", "--follow", str(self.rendezvous.directory),
                 "--rank", str(rank), "--world-size", str(self.rendezvous.world_size)],
                start_new_session=True,  # like rank 0: terminal signals go to the daemon
            ))

    async def first_exit(self) -> tuple[int, int | None]:
        """Wait until one of the ranks exits: (its rank, its exit code)."""
        send, receive = trio.open_memory_channel(len(self.procs))

        async def wait(rank: int, proc: trio.Process) -> None:
            await proc.wait()
            send.send_nowait((rank, proc.returncode))

        async with trio.open_nursery() as nursery:
            for rank, proc in enumerate(self.procs, start=1):
                nursery.start_soon(wait, rank, proc)
            ended = await receive.receive()
            nursery.cancel_scope.cancel()
        return ended

    async def stop(self, grace: float) -> None:
        """Give the ranks `grace` seconds to exit (rank 0 told them to), kill the rest, remove the store."""
        with trio.move_on_after(grace):
            for proc in self.procs:
                await proc.wait()
        for proc in self.procs:
            if proc.returncode is None:
                log.warning("worker rank process %d did not stop within %.0f s; killing it", proc.pid, grace)
                proc.kill()
        for proc in self.procs:
            await proc.wait()
        shutil.rmtree(self.rendezvous.directory, ignore_errors=True)
