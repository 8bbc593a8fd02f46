"""HOME's layout: every file and folder a node keeps in its directory (`--home`, $STARLING_HOME), named once.

Why one value object: the daemon, its worker, the operator's commands (`init`, `status`, `doctor`, `export`,
`plot`) and the test harness all reach into the same directory, and each used to spell the names it needed.
These names are an on-disk format: a HOME written by an earlier release (its identity, its checkpoints, the
swarm state it pinned) must still be found after an upgrade, so none of them changes
(tests/test_home.py pins each one to its literal path). Here rather than in p2p/: the layout is the node's;
the transport takes plain paths (`p2p.identity`, `p2p.fsutil`).

A `Home` only names paths (`checkpoint_files` alone reads a directory); `resolve_home` (node/config/load.py)
says which directory it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_CHECKPOINT_NAME = re.compile(r"^ckpt-(\d{12})\.pt$")


def checkpoint_name(step: int) -> str:
    """A checkpoint's file name in its model's folder: the global inner step it was taken at, zero-padded so
    that the names sort as the steps do."""
    return f"ckpt-{step:012d}.pt"


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint's file name; None for any other file (a temp file, a set-aside corrupt one)."""
    m = _CHECKPOINT_NAME.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class SnapshotFolder:
    """Where a downloaded swarm snapshot lands (`protocols/snapshot.py`): the finished file the worker starts
    from or adopts, beside the partial download it resumes from."""

    path: Path

    @property
    def snapshot(self) -> Path:
        return self.path / "snapshot.pt"

    @property
    def partial(self) -> Path:
        return self.path / "partial"


@dataclass(frozen=True)
class Home:
    """A node's directory and the paths in it (a str is taken as a path)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    # --- the operator's files --------------------------------------------------------------------------------

    @property
    def config(self) -> Path:
        """The config file `starling init` writes, commented."""
        return self.root / "config.toml"

    @property
    def run_config(self) -> Path:
        """The [train] and [task] options the trainer last ran with: what `export` rebuilds the model from."""
        return self.root / "run-config.toml"

    @property
    def identity(self) -> Path:
        """The node's ed25519 key: its peer ID."""
        return self.root / "identity.key"

    @property
    def swarm_key(self) -> Path:
        """The private swarm's key, used when it exists and `node.swarm_key_file` names no other."""
        return self.root / "swarm.key"

    def swarm_key_file(self, configured: str) -> Path:
        """The swarm key file to read: `node.swarm_key_file` when set, else HOME's."""
        return Path(configured) if configured else self.swarm_key

    # --- the running daemon's --------------------------------------------------------------------------------

    @property
    def lock(self) -> Path:
        """Held while a daemon runs on this HOME (one daemon per HOME)."""
        return self.root / "daemon.lock"

    @property
    def control_socket(self) -> Path:
        """The daemon's control socket (`status`, `doctor`, `plot`)."""
        return self.root / "control.sock"

    @property
    def log(self) -> Path:
        """The daemon's output when the launcher starts it (node/ops/launcher.py: `localswarm`, the test harness)."""
        return self.root / "daemon.log"

    @property
    def history(self) -> Path:
        """The loss history that `starling plot` draws."""
        return self.root / "history.msgpack"

    @property
    def swarm_state(self) -> Path:
        """The replicated swarm state (member records, the manifest), saved for a restart."""
        return self.root / "state.msgpack"

    @property
    def manifest_pin(self) -> Path:
        """The hash of the first manifest this node held (trust on first use)."""
        return self.root / "manifest.pin"

    # --- model state: private (0700 folders, 0600 files) ----------------------------------------------------

    @property
    def checkpoints(self) -> Path:
        """The worker's checkpoints, one folder per model (`model_checkpoints`)."""
        return self.root / "checkpoints"

    def model_checkpoints(self, task: str, model_hash: str) -> Path:
        """The checkpoints of one model: a changed architecture starts fresh instead of tripping over old files."""
        return self.checkpoints / f"{task}-{model_hash[:12]}"

    def checkpoint_files(self) -> list[tuple[int, Path]]:
        """(step, path) of every checkpoint of every model in HOME, largest step first ([] without any)."""
        found = [(step, p) for p in self.checkpoints.glob("*/ckpt-*.pt") if (step := checkpoint_step(p.name)) is not None]
        return sorted(found, reverse=True)

    @property
    def join(self) -> SnapshotFolder:
        """A late joiner's swarm snapshot (node/averaging/latejoin.py), consumed by the worker's first start."""
        return SnapshotFolder(self.root / "join")

    @property
    def catchup(self) -> SnapshotFolder:
        """A catch-up's swarm snapshot, adopted at the worker's next outer step."""
        return SnapshotFolder(self.root / "catchup")

    @property
    def private_folders(self) -> tuple[Path, ...]:
        """The folders that hold model state, which is nobody else's on a shared machine."""
        return (self.checkpoints, self.join.path, self.catchup.path)
