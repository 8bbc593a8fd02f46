"""Flat fp32 tensors in named POSIX shared memory, mapped by both the daemon and the worker.

Why shared memory: the slow weights and outer gradient of even a small model are megabytes, and a large
one gigabytes; pickling them through a pipe would copy them twice and stall whichever side is busier.
Instead the supervisor (daemon side) creates four segments once the worker says how many parameters it
has, sends their names over the control channel, and both sides view the same pages as flat float32
arrays: numpy arrays in the daemon, which loads no torch, and torch tensors over those in the worker
(`torch.from_numpy(slot.array)`, no copy).

The daemon owns the segments: they outlive a crashed worker, and the daemon unlinks them when it stops.
The worker only attaches. Python 3.11's `SharedMemory` registers *attached* segments with the attaching
process's resource tracker too, which would unlink the daemon's segments when the worker exits; `attach`
undoes that registration.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import numpy as np

log = logging.getLogger("starling.shm")

SLOTS = ("phi", "delta", "phi_out", "delta_out")
_FLOAT_BYTES = 4


class SharedTensor:
    """One named shared-memory segment viewed as a flat float32 array of `numel` elements (`array`)."""

    def __init__(self, shm: shared_memory.SharedMemory, numel: int, *, owner: bool) -> None:
        if shm.size < numel * _FLOAT_BYTES:
            shm.close()
            raise ValueError(f"shared memory {shm.name} holds {shm.size} bytes, need {numel * _FLOAT_BYTES}")
        self._shm: shared_memory.SharedMemory | None = shm
        self.name = shm.name
        self.numel = numel
        self.owner = owner
        self.array: np.ndarray = np.frombuffer(shm.buf, dtype=np.float32, count=numel)  # type: ignore[arg-type]

    @classmethod
    def create(cls, numel: int, tag: str) -> SharedTensor:
        name = f"stl{os.getpid()}_{secrets.token_hex(4)}_{tag}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=max(1, numel * _FLOAT_BYTES))
        return cls(shm, numel, owner=True)

    @classmethod
    def attach(cls, name: str, numel: int) -> SharedTensor:
        shm = shared_memory.SharedMemory(name=name, create=False)
        # Not ours to clean up (see the module docstring). Python 3.13 has track=False for this.
        try:
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        except Exception:  # the tracker's API is private; failing here only risks an extra warning
            pass
        return cls(shm, numel, owner=False)

    def close(self) -> None:
        """Drop our mapping; the owner also unlinks the name. Safe to call twice."""
        if self._shm is None:
            return
        shm, self._shm = self._shm, None
        self.array = np.empty(0, dtype=np.float32)
        try:
            shm.close()
        except BufferError:
            # Someone still holds a view of the pages (an array kept by the daemon's averager, the worker's
            # phi tensor): numpy views hold the mmap's buffer, so the mapping lives until the last one is
            # collected (the mmap unmaps itself then) and no view ever points at unmapped memory. Let go of
            # the mmap here, or `SharedMemory.__del__` would try again and print "Exception ignored" at
            # exit. Private attributes of CPython's SharedMemory (3.11-3.13); unlinking the name is safe.
            log.debug("shared memory %s still has views; leaving the mapping to them", self.name)
            shm._mmap = None  # type: ignore[attr-defined]
            with contextlib.suppress(AttributeError, OSError):
                os.close(shm._fd)  # type: ignore[attr-defined]
                shm._fd = -1  # type: ignore[attr-defined]
        if self.owner:
            try:
                shm.unlink()
            except FileNotFoundError:
                pass


@dataclass
class ExchangeSlots:
    """The four segments of one outer exchange: what the worker publishes and what the daemon returns."""

    phi: SharedTensor
    delta: SharedTensor
    phi_out: SharedTensor
    delta_out: SharedTensor

    @property
    def numel(self) -> int:
        return self.phi.numel

    @classmethod
    def create(cls, numel: int) -> ExchangeSlots:
        made: list[SharedTensor] = []
        try:
            for slot in SLOTS:
                made.append(SharedTensor.create(numel, slot))
        except BaseException:
            for s in made:
                s.close()
            raise
        return cls(*made)

    @classmethod
    def attach(cls, names: dict[str, str], numel: int) -> ExchangeSlots:
        made: list[SharedTensor] = []
        try:
            for slot in SLOTS:
                made.append(SharedTensor.attach(names[slot], numel))
        except BaseException:
            for s in made:
                s.close()
            raise
        return cls(*made)

    def names(self) -> dict[str, str]:
        return {slot: getattr(self, slot).name for slot in SLOTS}

    def close(self) -> None:
        for slot in SLOTS:
            getattr(self, slot).close()


def sweep_orphans(directory: str = "/dev/shm") -> int:
    """Remove exchange segments whose creating daemon is dead (a SIGKILLed daemon cannot clean up).

    Segment names carry the creator's pid (`stl<pid>_...`); a pid that no longer exists owns nothing.
    Called once when a daemon starts; returns how many segments were removed.
    """
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.startswith("stl"):
            continue
        pid_text = name[3:].split("_", 1)[0]
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed += 1
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True
