"""Atomic file replacement, shared by everything the daemon persists (swarm state, loss history).

Readers (`starling plot` while the daemon runs, the next start after a power cut) must see the old file or
the new one, never half of one: write a temp file in the same directory, fsync it, rename it over the
target, then fsync the directory so the rename itself survives a crash. Blocking: from trio, call it with
`trio.to_thread.run_sync` on bytes prepared in the trio task.

It lives in the bottom layer (``p2p/``) because both the protocols (snapshot downloads) and the daemon
(``node/``) write private files, and a layer imports only the ones below it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: Path, data: bytes, *, mode: int | None = None) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def unwritable_reason(directory: Path) -> str | None:
    """Why this process cannot create files in `directory` (None: it can).

    The daemon writes its lock, control socket, state and checkpoints there; saying so before it starts
    beats a PermissionError from whichever write comes first. It only asks (access(2)), never writes, so
    `starling doctor` can use it on a live node: root passes mode bits but not a read-only mount, and
    access(2) knows both.
    """
    directory = Path(directory)
    if os.access(directory, os.W_OK | os.X_OK):
        return None
    try:
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError as e:
        return e.strerror or str(e)
    if read_only:
        return "it is on a read-only file system"
    return f"it is not writable by this user (uid {os.geteuid()})"


#: Free space a node's HOME should keep at least: checkpoints (two at a time while one is replaced),
#: the swarm state and the loss history. More when its checkpoints are larger (`free_space_problem`).
MIN_FREE_BYTES = 64 << 20


def free_space_problem(home: Path, checkpoints: Path) -> str | None:
    """Why HOME's file system is too full to keep writing checkpoints (None: it is not, or it cannot be
    told): less free than twice its largest checkpoint under `checkpoints` (a new one is written before the
    oldest is removed), or than MIN_FREE_BYTES."""
    home = Path(home)
    try:
        st = os.statvfs(home)
    except OSError:
        return None
    largest = 0
    try:
        for path in Path(checkpoints).rglob("*"):
            with contextlib.suppress(OSError):
                if path.is_file():
                    largest = max(largest, path.stat().st_size)
    except OSError:
        pass
    need = max(MIN_FREE_BYTES, 2 * largest)
    free = st.f_bavail * st.f_frsize
    if free >= need:
        return None
    return (f"only {free / 1e6:.1f} MB free on the file system of {home} (of {st.f_blocks * st.f_frsize / 1e6:.1f} MB); "
            f"checkpoints need about {need / 1e6:.0f} MB")


PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def private_dir(directory: Path) -> Path:
    """Create `directory` (and any missing parents) as 0700 and tighten it to 0700 if it exists.

    What the daemon keeps under HOME (checkpoints: the model and optimizer state; downloaded snapshots)
    is nobody else's business on a shared machine, whatever the umask. `mkdir(parents=True, mode=...)`
    would give the parents the umask's mode, so each missing level is made here.
    """
    directory = Path(directory)
    missing = []
    level = directory
    while not level.exists():
        missing.append(level)
        if level.parent == level:
            break
        level = level.parent
    for path in reversed(missing):
        try:
            path.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:  # made meanwhile by another process
            pass
    os.chmod(directory, PRIVATE_DIR_MODE)
    return directory


def open_private(path: Path, mode: str = "wb") -> Any:
    """`open(path, mode)` for writing, creating the file 0600 (an existing file keeps its mode)."""
    flags = os.O_WRONLY | os.O_CREAT
    if "r+" in mode:
        flags = os.O_RDWR | os.O_CREAT
    elif "w" in mode:
        flags |= os.O_TRUNC
    return os.fdopen(os.open(path, flags, PRIVATE_FILE_MODE), mode)


def tighten_private_folders(folders: Iterable[Path]) -> list[str]:
    """Make HOME's model-state folders (checkpoints, downloaded snapshots: `node.config.home.Home`'s
    `private_folders`) 0700 and their files 0600, as versions before this rule left them 0755 / 0644
    (world-readable weights on a shared machine). Returns one line per path it could not change (a
    read-only home, another owner), for a warning; never raises."""
    problems = []
    for folder in folders:
        top = Path(folder)
        if not top.is_dir():
            continue
        for root, _dirs, files in os.walk(top):  # os.walk does not follow symlinked folders
            for path, mode in [(root, PRIVATE_DIR_MODE), *((os.path.join(root, f), PRIVATE_FILE_MODE) for f in files)]:
                try:
                    st = os.stat(path, follow_symlinks=False)
                    if not stat.S_ISLNK(st.st_mode) and stat.S_IMODE(st.st_mode) != mode:
                        os.chmod(path, mode)
                except OSError as e:
                    problems.append(f"{path}: {e.strerror or e}")
    return problems
