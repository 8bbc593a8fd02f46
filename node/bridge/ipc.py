"""The daemon-worker control channel: its messages, their framing, and the worker's blocking end.

Why a module of its own: the daemon (node/bridge/supervisor.py) and the worker (node/worker/loop.py) both speak this
conversation, and the daemon must not import the worker, which imports torch: the daemon process loads
no torch at all (it averages on numpy views of the shared memory, node/bridge/shm.py). The conversation itself
is described in node/worker/loop.py's docstring.

Frames are p2p/framing.py's, as on every libp2p stream: a 4-byte big-endian length and a msgpack map, here
`{"v": version, "t": type, **fields}`, each at most MAX_FRAME bytes; a frame that breaks any of that is a
`ProtocolError` (the same class, and the same reasons, as a peer's bad message). What is this module's own is
the messages and how a map becomes one of them.
"""

from __future__ import annotations

import dataclasses
import select
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from node.bridge.exchange import ExchangeOutcome
from p2p.framing import FrameSplitter, ProtocolError, Reason, pack_map

PROTOCOL_VERSION = 1
MAX_FRAME = 8 << 20  # bytes; the largest message is `hello` with the parameter layout


# --- wire messages ----------------------------------------------------------------------------------------


@dataclass
class Init:
    config: dict[str, Any]
    home: str
    peer_id: str
    log_level: str = "info"
    task_options: dict[str, Any] = field(default_factory=dict)  # the [task] config section


@dataclass
class Hello:
    pid: int
    numel: int
    layout: list[list[Any]]  # [[name, [dims...]], ...]
    task: str
    device: str
    model_hash: str
    layout_hash: str
    step: int
    outer_step: int
    resumed_from: str | None
    rejected: list[str] = field(default_factory=list)  # "path: reason" for each corrupt checkpoint


@dataclass
class Attach:
    names: dict[str, str]
    # `sync.fragments`: the worker syncs the model as this many streaming fragments (1: the whole vector).
    fragments: int = 1


@dataclass
class Publish:
    outer_step: int
    step: int
    inner_steps: int = 0  # inner steps this Delta covers (since the previous publish)
    samples: int = 0  # sequences those steps trained on: the weight of this Delta in a pair's mean
    # A streaming fragment's publish (`sync.fragments` > 1): its index of `fragments`; phi and Delta are in
    # the fragment's slice of the slots only, and `outer_step` is the fragment's own count.
    fragment: int = 0
    fragments: int = 1


@dataclass
class Result:
    outer_step: int
    group_size: int
    # The outer step to continue from when larger than ours: the group's largest (n >= 2), or for a solo
    # step the largest that ready trainers showed the daemon meanwhile (node/averaging/averager.py).
    group_outer_step: int | None = None
    adopt: str = ""  # a swarm snapshot file to adopt instead of this outer step (a catch-up)
    adopt_outer_step: int | None = None  # the swarm's outer step to continue from with the snapshot
    partner_samples: int = 0  # a pair's other member's samples (0: unknown, plain mean)
    period_s: float = 0.0  # the swarm's pace: seconds between two publishes (0: every H inner steps)
    shift_s: float = 0.0  # move the next publish by this much, to meet the swarm's phase
    compression: str = "none"  # the sync.compression preset the exchange's wire used (protocols/compress.py)
    phi_range: list[int] | None = None  # [lo, hi): the phi fragment exchanged (None: all of it)
    # A solo step's count, exactly (below ours too): a catch-up that moves the count alone (latejoin.py).
    exact_outer_step: int | None = None
    # A lossy exchange of `auto`'s ramp: apply our own Delta in full, no error feedback (Trainer.apply_result).
    own_exact: bool = False
    # The streaming fragment this result answers (as its publish named it): the sums are in the fragment's
    # slice of the output slots, `phi_range` is relative to it.
    fragment: int = 0
    fragments: int = 1


def outcome_of(result: Result) -> ExchangeOutcome:
    """The exchange's outcome as the worker's outer step takes it (`Trainer.apply_result`): one typed value,
    the one the daemon's exchange returned, as the supervisor's `Result` carried it."""
    phi_range = (int(result.phi_range[0]), int(result.phi_range[1])) if result.phi_range else None
    return ExchangeOutcome(result.group_size, result.group_outer_step, result.partner_samples, result.shift_s,
                           result.compression, phi_range, result.exact_outer_step, result.own_exact)


@dataclass
class Adopted:
    """The answer to a result with `adopt`: the counters before and after, or why it was not adopted."""

    previous_step: int
    previous_outer_step: int
    step: int
    outer_step: int
    donors: list[str] = field(default_factory=list)
    val_loss: float | None = None
    error: str = ""


@dataclass
class Metrics:
    step: int
    outer_step: int
    loss: float | None
    val_loss: float | None
    samples_per_s: float
    lr: float
    # Results (outer steps, snapshots to adopt) this worker has handled since it started: when it equals the
    # number the daemon sent, the phi slot is still until the next one (node/bridge/livephi.py).
    results: int = 0


@dataclass
class CheckpointSaved:
    step: int
    outer_step: int
    path: str


@dataclass
class CheckpointFailed:
    """A checkpoint could not be written (a full or failing disk); the previous one is kept."""

    step: int
    outer_step: int
    error: str  # one line: the OSError
    final: bool = False  # the one written on stop: a restart resumes from an older checkpoint


@dataclass
class Stop:
    pass


@dataclass
class Stopped:
    step: int
    outer_step: int


@dataclass
class Fatal:
    error: str


@dataclass
class Crashed:
    """The worker's last words before an unexpected error ends it (a restart may help, or may not)."""

    error: str  # one line: exception type and message


Message = (
    Init | Hello | Attach | Publish | Result | Adopted | Metrics | CheckpointSaved | CheckpointFailed | Stop
    | Stopped | Fatal | Crashed
)
_TYPES: dict[str, type] = {
    "init": Init, "hello": Hello, "attach": Attach, "publish": Publish, "result": Result, "adopted": Adopted,
    "metrics": Metrics, "checkpoint": CheckpointSaved, "checkpoint_failed": CheckpointFailed, "stop": Stop, "stopped": Stopped, "fatal": Fatal,
    "crashed": Crashed,
}
_NAMES = {cls: name for name, cls in _TYPES.items()}


# Fields added with streaming fragments, left out of a frame where they hold their default: with
# `sync.fragments` = 1 the conversation is the one it was, frame for frame.
_QUIET_DEFAULTS = {"fragment": 0, "fragments": 1}


def encode_message(msg: Message) -> bytes:
    fields = dataclasses.asdict(msg)
    for name, default in _QUIET_DEFAULTS.items():
        if name in fields and fields[name] == default:
            del fields[name]
    return pack_map({"v": PROTOCOL_VERSION, "t": _NAMES[type(msg)], **fields}, max_bytes=MAX_FRAME)


def _message_of(obj: dict[str, Any]) -> Message:
    """The message a decoded frame's map is, checked strictly: this version, a known type, its fields only."""
    if obj.pop("v", None) != PROTOCOL_VERSION:
        raise ProtocolError(Reason.BAD_VERSION, "frame is not a versioned map")
    cls = _TYPES.get(obj.pop("t", None))
    if cls is None:
        raise ProtocolError(Reason.BAD_KIND, "unknown message type")
    names = {f.name for f in dataclasses.fields(cls)}
    if not set(obj) <= names:
        raise ProtocolError(Reason.BAD_FIELD, f"unexpected fields in {cls.__name__}: {sorted(set(obj) - names)}")
    try:
        return cls(**obj)
    except TypeError as e:
        raise ProtocolError(Reason.BAD_FIELD, f"bad {cls.__name__}: {e}") from None


class FrameBuffer:
    """Accumulates bytes and splits off complete messages (frames bounded by MAX_FRAME)."""

    def __init__(self) -> None:
        self._frames = FrameSplitter(max_bytes=MAX_FRAME)

    def feed(self, data: bytes) -> None:
        self._frames.feed(data)

    def next_message(self) -> Message | None:
        obj = self._frames.next_map()
        return None if obj is None else _message_of(obj)


class DaemonGone(Exception):
    """End of file on the control socket: the daemon died or closed it."""


class WorkerChannel:
    """The worker's blocking end of the control socket, with a poll for use between training steps."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self._sock = sock
        self._frames = FrameBuffer()

    def send(self, msg: Message) -> None:
        try:
            self._sock.sendall(encode_message(msg))
        except (BrokenPipeError, ConnectionResetError) as e:
            raise DaemonGone(str(e)) from None

    def receive(self, timeout: float) -> Message | None:
        """The next message, waiting at most `timeout` seconds (0 = just poll); None if none came."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self._frames.next_message()
            if msg is not None:
                return msg
            remaining = max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([self._sock], [], [], remaining)
            if not readable:
                return None
            try:
                data = self._sock.recv(1 << 16)
            except ConnectionResetError:
                data = b""
            if not data:
                raise DaemonGone("control socket closed")
            self._frames.feed(data)

    def close(self) -> None:
        self._sock.close()
