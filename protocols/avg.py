"""`/starling/avg/1.3.0`: one pairwise averaging exchange of `(phi, Delta)` between two trainers.

Control flow on the libp2p stream (Noise-authenticated, so both PeerIDs are proven):

    initiator                                   responder
    AvgRequest(step, manifest, layout, numel,
               wire dtype, chunking, X25519 key) ->
                                             <- AvgAnswer(accept | busy | refuse, its X25519 key,
                                                          session id, side-channel port)
    [connect the encrypted TCP side channel, or not]
    AvgPath(datapath | stream)               ->
    phi, Delta  (chunks, both directions at once, over the side channel or this stream)

Both sides then hold the same two pairs of (wire-encoded) arrays and compute the same sums: the
sender's own contribution goes through the same codec round trip as what it sent, so the two sums are
bit-identical whatever the wire dtype. Received bytes land directly in the caller's output tensors
(shared memory) and become the group's sums there chunk by chunk as they arrive, so an exchange needs no
model-sized buffer beyond those and no second pass over them; the caller uses the outputs only when
`run_transfer` returns, so a failure or a rejection never leaves a half-applied update. Sums rather than
means: the worker's outer step folds the 1/n into its own scalars for free (node/worker/outer.py), while a
halving here was one more pass over every received byte, about a tenth of the exchange's CPU.

An outer step may take two exchanges (node/averaging/pairing.py, `schedule`): in the second (`stage` 2) each side
sends the sample-weighted mean of the pair it averaged with in the first, and says how many trainers'
values that mean carries (`members`) and their samples, so that two pairs become a group of four. The
stage is part of the request, so that a second-round request never meets a first-round exchange. Version
1.1.0 added `stage` and `members`: a 1.0.0 peer refuses them as unknown fields, so the protocol id
changed and the two versions do not negotiate (the run manifest pins the version anyway).

Version 1.2.0 added `compression` (a `sync.compression` preset, protocols/compress.py), `fragment` (the
fragment of phi this exchange carries, chosen by the initiator from its outer step) and `phi_chunk_elems`
(phi's chunking, which differs from Delta's once their encodings differ). A responder with a fixed preset
refuses another one (node/averaging/averager.py): partners whose error feedback and pull expect different wires must
not mix silently; one with `sync.compression = auto` takes the preset the request names (the wire is the
same: the request always named its preset, so `auto` needed no new field and no new version), unless it
is less compressed than the one the responder would choose for that link: it then refuses for compression
and its words name the preset it wants, which an `auto` initiator asks again with
(node/averaging/compression_choice.py; the words, read only for a known preset name right after a fixed
prefix, needed no new field either). As for 1.1.0, the protocol id changed, since a 1.1.0 peer refuses the
new fields.

Version 1.3.0 added `AvgAnswer.code`: why a busy or refuse answer says no, as a machine-readable
`AnswerCode` beside the human-readable `reason`, so that no node decides what to do next by reading prose
(a partner that is "not ready" is asked again; one that refused for the step gap starts the catch-up).
Swarms upgrade node by node, so this version talks to 1.2.0 as well, without a new manifest: a node
serves both protocol ids and asks for 1.3.0 first (multistream falls back to 1.2.0 on an older peer, one
round trip more). On a 1.2.0 stream it leaves `code` out (a 1.2.0 peer refuses unknown fields, and would
count our answer as malformed), and a 1.2.0 peer's answer, which has only the text, gets its code from the
texts 1.2.0 sends (`LEGACY_REASONS`: with the preset a compression refusal wants, the one place a reason's
text is read, to go when 1.2.0 is gone). The
session keys stay bound to the 1.2.0 id (`KEYS_PROTOCOL_ID`): the key schedule did not change.

Streaming fragments (`sync.fragments` = F > 1, issue #23): an exchange carries one fragment of the model,
and the request says which, `stream_fragment` of `stream_fragments` (at most `MAX_FRAGMENTS`); `numel`
is then the fragment's size, and everything else (chunking, presets, phi's `fragment`, the bounds) applies
to the fragment as if it were the model. The responder refuses a count that differs from its own or an
index out of range (`AnswerCode.FRAGMENTS`: the two would cut the model differently), and answers a
request for another fragment than the one its round is syncing with `OTHER_FRAGMENT` (busy: asked again).
The two fields go on the wire only where F > 1, so with one fragment the request is the one it was, byte
for byte, and no version changed: a peer that does not know them refuses the request as malformed, which
is right, since the two would not cut the model alike.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import trio

from p2p.datapath import (
    BlockingFrames,
    DataPathListener,
    KeyAgreement,
    Preconnect,
    Role,
    SecureChannel,
    SessionKeys,
    connect_datapath,
    new_session_id,
    open_punched,
)
from p2p.datapath import preconnect as preconnect  # the initiator's caller dials early with it
from p2p.punch import PunchSocket, simultaneous_open
from p2p.wire import (
    Buffer,
    ByteStream,
    FrameChannel,
    LibP2PByteStream,
    PlainFrameChannel,
    ProtocolError,
    Reason,
    recv_as,
    send_msg,
    single_error,
    spec,
    to_map,
)

# What a caller hands initiate and respond; named here too (`avg.Session`, `avg.TransferLimits`, ...).
from protocols.avg_call import Ask as Ask
from protocols.avg_call import Contribution as Contribution
from protocols.avg_call import Progress as Progress
from protocols.avg_call import Session as Session
from protocols.avg_call import TransferLimits as TransferLimits
from protocols.avg_call import Wire as Wire
from protocols.codec import (
    PASS_ELEMS,
    ChunkPlan,
    Flat,
    Fp32Codec,
    TensorCodec,
    flat_fp32,
    get_codec,
    recv_tensor,
    recv_tensor_blocking,
    round_trip,
    send_tensor,
    send_tensor_blocking,
)
from protocols.compress import MAX_FRAGMENTS, get_compression

log = logging.getLogger("starling.avg")

PROTOCOL_ID = "/starling/avg/1.3.0"
PROTOCOL_ID_1_2 = "/starling/avg/1.2.0"  # the previous version, still served and spoken (module docstring)
PROTOCOL_IDS = (PROTOCOL_ID, PROTOCOL_ID_1_2)  # what an initiator asks for, preferred first
KEYS_PROTOCOL_ID = PROTOCOL_ID_1_2  # what the session keys are bound to, in both versions
MAX_CODE_LEN = 24
MAX_MEMBERS = 2  # trainers whose mean one side of an exchange may carry (a pair's, in the second round)
MAX_CONTROL_BYTES = 16 * 1024
MAX_NUMEL = 1 << 34  # 16 G parameters: refuse anything a real model could not be
MAX_FRAME = 1 << 20
DATAPATH_CONNECT_S = 5.0
PUNCH_S = 5.0  # for a punched side channel; on failure the exchange falls back to the libp2p stream

HASH_LEN = 64  # sha256 hex


class AnswerCode(enum.Enum):
    """Why a partner said no (`AvgAnswer.code`), each code belonging to one verdict (`busy` or `refuse`).

    The asker acts on the code only: `asks_again` codes (the partner has not published yet) are asked again
    soon and are no miss; `EXCHANGING` is waited for (a slow link's transfer); `STEP_GAP` starts the
    catch-up of whichever side is behind. `BUSY` and `REFUSED` stand for any other reason, including a code
    this version does not know (a newer peer's)."""

    # busy: no now, maybe later
    NOT_READY = "not_ready"  # training between outer steps
    NOT_IN_ROUND = "not_in_round"  # a second-round request while it is still in its first round
    SECOND_ROUND = "second_round"  # a first-round request while it is in its second round
    EXCHANGING = "exchanging"  # its outer step is paired and transferring
    SCHEDULED = "scheduled"  # waiting for the partner the schedule gives it
    CROSSING = "crossing"  # it is asking us at the same time, and its request wins
    ASKING_OTHER = "asking_other"  # it is asking someone else
    OTHER_FRAGMENT = "other_fragment"  # its round syncs another streaming fragment (it gets to ours soon)
    CLAIMED = "claimed"  # (never on the wire) a crossing request claimed our outer step meanwhile
    BUSY = "busy"  # any other busy answer
    # refuse: no, for reasons a retry does not change
    NO_DIRECT_PATH = "no_direct_path"
    BANNED = "banned"
    MANIFEST = "manifest"
    LAYOUT = "layout"
    STEP_GAP = "step_gap"  # outer steps further apart than `sync.max_step_gap`
    WIRE_DTYPE = "wire_dtype"
    COMPRESSION = "compression"
    FRAGMENTS = "fragments"  # another `sync.fragments`, or a fragment index out of range
    REFUSED = "refused"  # any other refusal

    @property
    def busy(self) -> bool:
        """No for now (verdict "busy"), as opposed to a refusal."""
        return self in _BUSY_CODES

    @property
    def verdict(self) -> str:
        """The `AvgAnswer.verdict` this code goes with: "busy" or "refuse"."""
        return "busy" if self.busy else "refuse"

    @property
    def asks_again(self) -> bool:
        """The partner has not begun the round we asked for (it is "not ready"): ask again soon."""
        return self in (AnswerCode.NOT_READY, AnswerCode.NOT_IN_ROUND, AnswerCode.OTHER_FRAGMENT)

    @classmethod
    def of(cls, verdict: str, code: str, reason: str) -> AnswerCode:
        """The code of a busy or refuse answer: its `code` where this version knows it and it goes with the
        verdict; a 1.2.0 peer's (no code) from its text (`LEGACY_REASONS`); else `BUSY` or `REFUSED`."""
        generic = cls.BUSY if verdict == "busy" else cls.REFUSED
        if code:
            try:
                known = cls(code)
            except ValueError:
                return generic  # a newer peer's code
            return known if known.verdict == verdict else generic
        for prefix, legacy in LEGACY_REASONS:
            if legacy.verdict == verdict and reason.startswith(prefix):
                return legacy
        return generic


_BUSY_CODES = frozenset({AnswerCode.NOT_READY, AnswerCode.NOT_IN_ROUND, AnswerCode.SECOND_ROUND,
                         AnswerCode.EXCHANGING, AnswerCode.SCHEDULED, AnswerCode.CROSSING, AnswerCode.ASKING_OTHER,
                         AnswerCode.OTHER_FRAGMENT, AnswerCode.CLAIMED, AnswerCode.BUSY})

# The reasons a 1.2.0 node sends (node/averaging/averager.py's `_judge` as it was), by prefix, and their codes.
LEGACY_REASONS: tuple[tuple[str, AnswerCode], ...] = (
    ("not ready (in the first round", AnswerCode.NOT_IN_ROUND),
    ("not ready", AnswerCode.NOT_READY),
    ("in the second round", AnswerCode.SECOND_ROUND),
    ("already exchanging", AnswerCode.EXCHANGING),
    ("waiting for the partner the schedule gives it", AnswerCode.SCHEDULED),
    ("crossing request", AnswerCode.CROSSING),
    ("asking someone else", AnswerCode.ASKING_OTHER),
    ("no direct path", AnswerCode.NO_DIRECT_PATH),
    ("banned", AnswerCode.BANNED),
    ("manifest mismatch", AnswerCode.MANIFEST),
    ("parameter layout mismatch", AnswerCode.LAYOUT),
    ("outer steps too far apart", AnswerCode.STEP_GAP),
    ("unknown wire dtype", AnswerCode.WIRE_DTYPE),
    ("compression mismatch", AnswerCode.COMPRESSION),
)


@dataclass(frozen=True)
class AvgRequest:
    KIND: ClassVar[str] = "avg.request"
    VERSION: ClassVar[int] = 1
    outer_step: int = spec(ge=0, le=1 << 40)
    manifest_hash: str = spec(min_len=1, max_len=HASH_LEN)
    layout_hash: str = spec(min_len=1, max_len=HASH_LEN)
    numel: int = spec(ge=1, le=MAX_NUMEL)
    wire_dtype: str = spec(min_len=1, max_len=8)
    int8_block: int = spec(ge=16, le=1 << 20)
    chunk_elems: int = spec(ge=1, le=1 << 28)
    pubkey: bytes = spec(min_len=32, max_len=32)
    datapath: bool = spec(default=True)
    punch_port: int = spec(ge=0, le=65535, default=0)  # 0: no punched side channel offered
    # What this Delta covers, for a pair's sample-weighted mean and the norm check (node/worker/outer.py), and how
    # long the initiator has waited for a partner since it published (the pair meets halfway in phase).
    inner_steps: int = spec(ge=0, le=1 << 30, default=0)
    samples: int = spec(ge=0, le=1 << 40, default=0)
    waited_ms: int = spec(ge=0, le=1 << 30, default=0)
    # The round of the outer step (node/averaging/pairing.py) and how many trainers' mean the tensors carry.
    stage: int = spec(ge=1, le=2, default=1)
    members: int = spec(ge=1, le=MAX_MEMBERS, default=1)
    # What crosses the wire (protocols/compress.py): the preset, phi's fragment and phi's chunking (0: Delta's).
    compression: str = spec(min_len=1, max_len=16, default="none")
    fragment: int = spec(ge=0, le=1 << 16, default=0)
    phi_chunk_elems: int = spec(ge=0, le=1 << 28, default=0)
    # Streaming fragments (module docstring): which fragment of how many the tensors are; on the wire only
    # where `stream_fragments` > 1 (`request_map`). Whether the index is below the count is the responder's
    # check (a refusal, `AnswerCode.FRAGMENTS`), not a malformed request.
    stream_fragment: int = spec(ge=0, le=MAX_FRAGMENTS - 1, default=0)
    stream_fragments: int = spec(ge=1, le=MAX_FRAGMENTS, default=1)


def request_map(request: AvgRequest) -> dict[str, object]:
    """`request` as it goes on the wire: without the streaming-fragment fields where there is one fragment,
    so that a whole-model request is the one it always was (module docstring)."""
    fields = to_map(request)
    if request.stream_fragments == 1 and request.stream_fragment == 0:
        del fields["stream_fragment"], fields["stream_fragments"]
    return fields


def fragment_refusal(request: AvgRequest, fragments: int) -> str | None:
    """Why a responder syncing the model in `fragments` streaming fragments refuses `request`
    (`AnswerCode.FRAGMENTS`), or None where the two cut the model alike and the index is one of them."""
    if request.stream_fragments != fragments:
        return (f"fragments mismatch: yours {request.stream_fragments}, ours {fragments} "
                "(sync.fragments must be the same on every trainer)")
    if request.stream_fragment >= fragments:
        return f"fragments mismatch: fragment {request.stream_fragment} out of range for {fragments}"
    return None


@dataclass(frozen=True)
class AvgAnswer:
    KIND: ClassVar[str] = "avg.answer"
    VERSION: ClassVar[int] = 1
    verdict: str = spec(min_len=1, max_len=8)  # accept | busy | refuse
    reason: str = spec(max_len=300, default="")
    outer_step: int = spec(ge=0, le=1 << 40, default=0)
    pubkey: bytes = spec(max_len=32, default=b"")
    session_id: bytes = spec(max_len=64, default=b"")
    datapath_port: int = spec(ge=0, le=65535, default=0)
    punch_port: int = spec(ge=0, le=65535, default=0)
    inner_steps: int = spec(ge=0, le=1 << 30, default=0)  # as in AvgRequest, for the responder's Delta
    samples: int = spec(ge=0, le=1 << 40, default=0)
    waited_ms: int = spec(ge=0, le=1 << 30, default=0)
    # Between outer steps: how long ago this trainer published (0: unknown), so that an asker whose phase
    # is off everyone's can move towards theirs (node/averaging/averager.py).
    since_publish_ms: int = spec(ge=0, le=1 << 31, default=0)
    paired: bool = spec(default=False)  # its last outer step was averaged: it is in phase with someone
    members: int = spec(ge=1, le=MAX_MEMBERS, default=1)  # as in AvgRequest
    # 1.3.0: why a busy or refuse answer says no (`AnswerCode`'s value; absent in 1.2.0 and in an accept).
    # A plain string, so that a code added later reads as `BUSY` / `REFUSED` here instead of a malformed answer.
    code: str = spec(max_len=MAX_CODE_LEN, default="")

    def __post_init__(self) -> None:
        if self.verdict not in ("accept", "busy", "refuse"):
            raise ValueError(f"unknown verdict {self.verdict!r}")
        if self.verdict == "accept" and (len(self.pubkey) != 32 or not self.session_id):
            raise ValueError("an accept needs a 32-byte key and a session id")


@dataclass(frozen=True)
class AvgPath:
    KIND: ClassVar[str] = "avg.path"
    VERSION: ClassVar[int] = 1
    path: str = spec(min_len=1, max_len=8)  # datapath | stream

    def __post_init__(self) -> None:
        if self.path not in ("datapath", "stream"):
            raise ValueError(f"unknown path {self.path!r}")


class Rejected(Exception):
    """The partner's values arrived intact but fail validation (poisoned or outlier update)."""

    def __init__(self, reason: str, detail: str, *, wild: bool = True) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        # False: out of bounds, but within what an honest partner far ahead of a fresh model can show (a phi
        # fragment's distance beyond 4x the fragment's norm, within 4x the whole model's): the averager
        # decides whether that is an offence (node/averaging/averager.py, `_fail`).
        self.wild = wild


class Declined(Exception):
    """The partner answered busy or refuse; not a failure of the partner. `code` says why (what the asker
    acts on), `reason` in words (what it logs and shows)."""

    def __init__(
        self, code: AnswerCode, reason: str, outer_step: int = 0, since_publish_ms: int = 0, paired: bool = False
    ) -> None:
        super().__init__(f"{code.verdict}: {reason}")
        self.code = code
        self.verdict = code.verdict
        self.reason = reason
        self.outer_step = outer_step  # the partner's, where it said (0: unknown)
        self.since_publish_ms = since_publish_ms  # how long ago it published, where it said (0: unknown)
        self.paired = paired  # whether its last outer step was averaged


@dataclass
class Tensors:
    """This side's inputs and the outputs the group's sums go into (flat fp32 numpy arrays, same length).

    Held as given: a caller may still pass CPU torch tensors, which :meth:`as_arrays` views as arrays
    without a copy at the entry points, so the sums land in the caller's memory either way."""

    phi: np.ndarray
    delta: np.ndarray
    phi_out: np.ndarray
    delta_out: np.ndarray

    def as_arrays(self) -> Tensors:
        """The same memory as flat float32 arrays (zero-copy views; ``ValueError`` where that cannot be)."""
        return Tensors(
            flat_fp32(self.phi, "phi"),
            flat_fp32(self.delta, "delta"),
            flat_fp32(self.phi_out, "phi_out", writable=True),
            flat_fp32(self.delta_out, "delta_out", writable=True),
        )


@dataclass(frozen=True)
class Clip:
    """How much of the partner's contribution we keep: its Delta scaled by `delta_scale`, its phi's
    deviation from ours by `phi_scale` (1.0: untouched, and the sums stay bit-exact)."""

    delta_scale: float = 1.0
    phi_scale: float = 1.0

    @property
    def clipped(self) -> bool:
        return self.delta_scale < 1.0 or self.phi_scale < 1.0


@dataclass
class TransferResult:
    path: str
    bytes_sent: int
    bytes_received: int
    duration_s: float
    delta_norms: tuple[float, float] = (0.0, 0.0)  # (ours, the partner's)
    clip: Clip = field(default_factory=Clip)  # what the judge kept of the partner's values


def make_plan(numel: int, wire_dtype: str, int8_block: int, chunk_elems: int | None = None) -> ChunkPlan:
    codec = get_codec(wire_dtype, int8_block=int8_block)
    return _plan_for(numel, codec, chunk_elems)


def _plan_for(numel: int, codec: TensorCodec, chunk_elems: int | None) -> ChunkPlan:
    if chunk_elems is None:
        return ChunkPlan.for_frame_size(numel, codec, MAX_FRAME)
    return ChunkPlan.from_header(numel, codec, chunk_elems, MAX_FRAME)


WATCH_S = 0.5  # how often a transfer's progress is looked at


@contextlib.asynccontextmanager
async def watched(limits: TransferLimits, progress: Progress) -> AsyncIterator[None]:
    """Run the body while ``progress`` satisfies ``limits``; raises ``trio.TooSlowError`` (with the
    reason) once it does not. Exceptions of the body come out as they are, not in a group."""
    began = time.monotonic()
    why: list[str] = []
    with trio.CancelScope() as scope, single_error():
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                while True:
                    await trio.sleep(WATCH_S)
                    reason = limits.verdict(progress, began, time.monotonic())
                    if reason is not None:
                        why.append(reason)
                        scope.cancel()
                        return

            nursery.start_soon(watch)
            yield
            nursery.cancel_scope.cancel()
    if scope.cancelled_caught:
        raise trio.TooSlowError(why[0] if why else "the transfer was given up")


class _Counted:
    """A byte stream that tells ``progress`` what crosses it (the libp2p stream path of a transfer)."""

    def __init__(self, stream: ByteStream, progress: Progress) -> None:
        self._stream, self._progress = stream, progress

    async def read(self, max_bytes: int) -> bytes:
        data = await self._stream.read(max_bytes)
        if data:
            self._progress.moved(len(data))
        return data

    async def write(self, data: Buffer) -> None:
        await self._stream.write(data)
        self._progress.moved(memoryview(data).nbytes)

    async def aclose(self) -> None:
        await self._stream.aclose()


def _counted(channel: FrameChannel, progress: Progress) -> FrameChannel:
    """Attach ``progress`` to a side channel (its bytes are counted where they cross the socket)."""
    if isinstance(channel, SecureChannel):
        channel.on_bytes = progress.moved
    return channel


@dataclass(frozen=True)
class Plans:
    """How phi and Delta cross the wire in one exchange: each its own chunk plan (their encodings may
    differ), and the range [lo, hi) of phi that is sent (a fragment; the whole model without compression)."""

    phi: ChunkPlan
    delta: ChunkPlan
    phi_range: tuple[int, int]
    compressed: bool = False  # a lossy `sync.compression` preset (not `none`)

    @classmethod
    def same(cls, plan: ChunkPlan) -> Plans:
        """Both tensors whole under one plan: the exchange as it was before compression."""
        return cls(plan, plan, (0, plan.numel))

    @property
    def total_bytes(self) -> int:
        """Payload bytes one side sends (framing excluded)."""
        return self.phi.total_bytes + self.delta.total_bytes

    def sliced(self, t: Tensors) -> Tensors:
        """``t`` with phi and its output cut to the fragment (views: the sums land in the caller's memory)."""
        lo, hi = self.phi_range
        if (lo, hi) == (0, t.phi.size):
            return t
        return Tensors(t.phi[lo:hi], t.delta, t.phi_out[lo:hi], t.delta_out)


def make_plans(
    numel: int,
    wire_dtype: str,
    int8_block: int,
    compression: str = "none",
    fragment: int = 0,
    chunk_elems: int | None = None,
    phi_chunk_elems: int | None = None,
) -> Plans:
    """Both plans of an exchange under a `sync.compression` preset. ``ValueError`` for an unknown preset or
    wire dtype, or a fragment out of range; :class:`ProtocolError` (``BAD_FIELD``) for a peer's chunking
    that does not fit a frame. `chunk_elems`/`phi_chunk_elems`: a peer's announced chunking (None: ours)."""
    preset = get_compression(compression)
    if not preset.lossy:
        plan = make_plan(numel, wire_dtype, int8_block, chunk_elems)
        if phi_chunk_elems not in (None, 0, plan.chunk_elems):
            raise ValueError("phi and Delta must share one chunking without compression")
        return Plans.same(plan)
    lo, hi = preset.fragment_range(numel, fragment)
    delta = _plan_for(numel, preset.delta_codec(wire_dtype), chunk_elems)
    phi = _plan_for(hi - lo, preset.phi_codec(wire_dtype), phi_chunk_elems or None)
    return Plans(phi, delta, (lo, hi), compressed=True)


@dataclass
class Received:
    """What the receive loop measured of the partner's values while it folded them into the sums."""

    finite: bool = True
    their_delta_sq: float = 0.0
    own_delta_sq: float = 0.0
    phi_distance_sq: float = 0.0  # |their phi - ours|^2, both as they crossed the wire
    own_phi_sq: float = 0.0  # |our phi|^2 where it crossed the wire (our values, not their code): the scale of "a model"
    # |our whole phi|^2 where only a fragment of phi crosses the wire (a lossy preset), None otherwise: the
    # Delta always covers the whole model (top-k of all of it), so it is judged against the whole phi.
    model_phi_sq: float | None = None

    @property
    def delta_norms(self) -> tuple[float, float]:
        """(our Delta's norm, the partner's), for the bounds (node/averaging/robust.py) and their history."""
        return math.sqrt(self.own_delta_sq), math.sqrt(self.their_delta_sq)

    @property
    def phi_distance(self) -> float:
        """How far the partner's phi is from ours: what its half of the NoLoCo pull moves us by."""
        return math.sqrt(self.phi_distance_sq)

    @property
    def own_phi_norm(self) -> float:
        """The norm of our phi where it crossed the wire (a fragment of it under a lossy preset)."""
        return math.sqrt(self.own_phi_sq)

    @property
    def own_model_norm(self) -> float:
        """The norm of our whole phi: the scale a whole Delta is compared with (a fragment's norm can be any
        small share of the whole, a run of biases or norms; comparing the whole Delta with it refused honest
        partners under `high` as "not a model of ours")."""
        return self.own_phi_norm if self.model_phi_sq is None else math.sqrt(self.model_phi_sq)


class _Fold:
    """Turns each received chunk of the partner's values into the group's sum, in place, on arrival.

    Why on arrival: the chunk was just written by the decryption, so the finiteness check, the norm and
    the sum read it from the cache; a separate pass over model-sized arrays afterwards cost as much
    as the transfer itself (bench/sync.py). Both sides compute ``theirs + own`` with ``own`` through the
    same codec round trip as what was sent, so the two sums are bit-identical (addition commutes).

    The squared norms are float32 BLAS dot products per chunk (``np.dot``, as ``torch.dot`` was), summed
    over chunks in Python floats (float64): their overflow on absurd values is part of the finiteness check.
    """

    def __init__(self, mine: Flat, out: Flat, plan: ChunkPlan, seen: Received, *, is_delta: bool):
        self.mine, self.out, self.codec, self.seen, self.is_delta = mine, out, plan.codec, seen, is_delta
        lossless = isinstance(plan.codec, Fp32Codec)
        chunk = min(plan.chunk_elems, plan.numel)
        # Our own chunk's round trip reuses these two buffers for every chunk (no allocation per chunk).
        self.scratch = None if lossless else np.empty(chunk, dtype=np.float32)
        self.encoded = None if lossless else bytearray(plan.max_chunk_bytes)
        self.diff = None if is_delta else np.empty(chunk, dtype=np.float32)

    def __call__(self, start: int, stop: int) -> None:
        if not self.seen.finite:
            return  # the exchange will be rejected: draining the rest is all that is left to do
        # A partner's infinities and overflows are judged below, not warned about by numpy.
        with np.errstate(over="ignore", invalid="ignore"):
            self._fold(start, stop)

    def _fold(self, start: int, stop: int) -> None:
        theirs, mine = self.out[start:stop], self.mine[start:stop]
        if self.is_delta:
            # The squared norm doubles as the finiteness check: one NaN or infinity makes the sum NaN or
            # infinite, and so do values too large to square (|x| > 1e19, an update no model survives).
            their_sq = float(np.dot(theirs, theirs))
            if not math.isfinite(their_sq):
                self.seen.finite = False
                return
            self.seen.their_delta_sq += their_sq
            self.seen.own_delta_sq += float(np.dot(mine, mine))
        if self.scratch is None or self.encoded is None:
            own = mine
        else:
            own = self.scratch[: stop - start]
            # Decode plainly, then add: a fused decode-and-accumulate would round differently from the
            # partner's plain decode of the same bytes, and the two sums would differ.
            size = self.codec.encode_into(mine, self.encoded)
            self.codec.decode_into(memoryview(self.encoded)[:size], own)
        if self.diff is not None:
            # The distance of their phi from ours (as both crossed the wire) bounds the NoLoCo pull. A NaN
            # or an infinity makes it NaN or infinite, so it doubles as the finiteness check, as does a
            # value too large to square (|x| > 1e19).
            diff = np.subtract(theirs, own, out=self.diff[: stop - start])
            dist_sq = float(np.dot(diff, diff))
            if not math.isfinite(dist_sq):
                self.seen.finite = False
                return
            self.seen.phi_distance_sq += dist_sq
            self.seen.own_phi_sq += float(np.dot(mine, mine))  # a scale: our values, not their wire code
        np.add(theirs, own, out=theirs)


async def _swap(channel: FrameChannel, t: Tensors, plans: Plans, seen: Received) -> tuple[int, int, Received]:
    """Send our phi and Delta while receiving theirs into the outputs (both directions at once, or the
    socket buffers fill up and both sides wait forever), turning them into the sums as they land.

    Over the side channel each direction runs in its own thread (``SecureChannel.run_in_threads``: the
    encryption, the socket calls and the sums release the GIL); over a libp2p stream both directions run
    as tasks on the event loop."""
    phi_plan, delta_plan = plans.phi, plans.delta
    phi_fold = _Fold(t.phi, t.phi_out, phi_plan, seen, is_delta=False)
    delta_fold = _Fold(t.delta, t.delta_out, delta_plan, seen, is_delta=True)

    if isinstance(channel, SecureChannel):

        def send_both(io: BlockingFrames) -> int:
            return send_tensor_blocking(io.send, t.phi, phi_plan) + send_tensor_blocking(io.send, t.delta, delta_plan)

        def recv_both(io: BlockingFrames) -> int:
            return recv_tensor_blocking(io.recv_into, t.phi_out, phi_plan, on_chunk=phi_fold) + recv_tensor_blocking(
                io.recv_into, t.delta_out, delta_plan, on_chunk=delta_fold
            )

        sent, received = await channel.run_in_threads(send_both, recv_both)
        return sent, received, seen

    sent = received = 0

    async def send_side() -> None:
        nonlocal sent
        sent += await send_tensor(channel, t.phi, phi_plan)
        sent += await send_tensor(channel, t.delta, delta_plan)

    async def recv_side() -> None:
        nonlocal received
        received += await recv_tensor(channel, t.phi_out, phi_plan, on_chunk=phi_fold)
        received += await recv_tensor(channel, t.delta_out, delta_plan, on_chunk=delta_fold)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_side)
            nursery.start_soon(recv_side)
    except BaseExceptionGroup as group:
        # Keep the module's contract (ProtocolError) so the caller can count the partner's offence.
        first = next((e for e in group.exceptions if isinstance(e, ProtocolError)), None)
        if first is not None:
            raise first from None
        raise
    return sent, received, seen


Validator = Callable[[Received], Clip]

"""``judge(seen)``: what to keep of the partner's values (a :class:`Clip`), or raises :class:`Rejected`."""


def apply_clip(t: Tensors, clip: Clip, plans: Plans | None = None) -> None:
    """Rewrite the sums as if the partner had sent its values clipped: its Delta scaled by
    ``clip.delta_scale``, its phi moved towards ours by ``clip.phi_scale``.

    With S = own + theirs: own + s*theirs = own + s*(S - own), and own + (own + s*(theirs - own)) =
    2*own + s*(S - 2*own). (Over a lossy wire the sum holds our value as it crossed the wire, which
    differs from ours by the codec's rounding; the clipped sums carry that rounding times s.)
    With `plans` of a compressed exchange (protocols/compress.py) `own` is our value as it crossed the wire
    (recomputed with ``round_trip``): top-k's "rounding" is most of Delta, and the worker's error feedback
    counts on our own term in the sum being exactly what the wire carried, clipped or not.
    Any float dtype, as long as the four share it; CPU torch tensors are rewritten in their own memory."""
    wire = plans if plans is not None and plans.compressed else None
    if clip.delta_scale < 1.0:
        _rescale(_inplace(t.delta_out), np.asarray(t.delta), clip.delta_scale, copies=1,
                 codec=wire.delta.codec if wire else None)
    if clip.phi_scale < 1.0:
        _rescale(_inplace(t.phi_out), np.asarray(t.phi), clip.phi_scale, copies=2,
                 codec=wire.phi.codec if wire else None)


def _inplace(x: object) -> np.ndarray:
    """``x`` as an array over its own memory, or ``ValueError`` (a copy would drop what is written)."""
    arr = np.asarray(x)
    if not arr.flags.writeable or (arr is not x and arr.base is None):
        raise ValueError(f"cannot rewrite a {type(x).__name__} in place")
    return arr


def _rescale(total: np.ndarray, own: np.ndarray, scale: float, *, copies: int,
             codec: TensorCodec | None = None) -> None:
    """``total = copies*own + scale*(total - copies*own)`` in place, a cache-sized slice at a time (no
    model-sized temporary). Step by step as torch's ``sub_(own, alpha=copies).mul_(scale).add_(own,
    alpha=copies)`` was, so bit for bit the same (``copies*own`` is exact; ``scale`` rounds to the dtype).
    With `codec`, ``own`` is first replaced by its round trip through it (slices of whole blocks)."""
    step = PASS_ELEMS if codec is None else max(1, PASS_ELEMS // codec.align) * codec.align
    work = np.empty(min(step, total.size), dtype=total.dtype) if (copies != 1 or codec is not None) else None
    for lo in range(0, total.size, step):
        hi = min(lo + step, total.size)
        part, mine = total[lo:hi], own[lo:hi]
        if codec is not None and work is not None:
            round_trip(codec, mine, work[: hi - lo])
            mine = work[: hi - lo]
        if copies != 1 and work is not None:
            mine = np.multiply(mine, copies, out=work[: hi - lo])
        np.subtract(part, mine, out=part)
        np.multiply(part, scale, out=part)
        np.add(part, mine, out=part)


async def run_transfer(
    channel: FrameChannel, t: Tensors, plan: ChunkPlan | Plans, path: str, validate: Validator | None = None
) -> TransferResult:
    """Swap values and leave the group's sums in the outputs, clipped as ``validate`` says. Raises
    Rejected (non-finite values, or what ``validate`` refuses) or ProtocolError; the outputs are
    meaningful only when it returns. Nothing clipped: the sums are the exact ones both sides hold.

    With a phi fragment (`Plans.phi_range`) only that range of ``phi_out`` is written; the bounds
    (``validate``, node/averaging/robust.py) see the decoded values: the partner's Delta as top-k decoded it and the
    distance of its phi from ours on the fragment, and a clip rescales exactly those."""
    began = trio.current_time()
    plans = plan if isinstance(plan, Plans) else Plans.same(plan)
    arrays = t.as_arrays()
    seen = Received()
    if plans.phi_range != (0, arrays.phi.size):  # one pass over our phi, off the event loop
        seen.model_phi_sq = await trio.to_thread.run_sync(lambda: float(np.dot(arrays.phi, arrays.phi)))
    t = plans.sliced(arrays)
    sent, received, seen = await _swap(channel, t, plans, seen)
    if not seen.finite:
        raise Rejected("non_finite", "partner sent NaN, infinite or overflowing values")
    clip = validate(seen) if validate is not None else Clip()
    if clip.clipped:
        # Two passes over model-sized tensors: off the event loop (only a partner outside the bounds pays).
        await trio.to_thread.run_sync(apply_clip, t, clip, plans)
    return TransferResult(path, sent, received, trio.current_time() - began, seen.delta_norms, clip)


async def initiate(
    stream: object,
    ask: Ask,
    tensors: Tensors,
    session: Session,
    *,
    remote_ip: str | None,
    on_accept: Callable[[AvgAnswer], bool] | None = None,
    validate: Validator | None = None,
    offer_punch: bool = False,
    early: Preconnect | None = None,
) -> TransferResult:
    """The initiator's side. Raises Declined, ProtocolError or trio.TooSlowError; outputs are valid only
    when it returns. ``on_accept(answer)`` runs when the partner accepts (its outer step, samples and wait are
    in the answer); returning False declines after all (we were claimed by a crossing request meanwhile).

    With ``offer_punch`` (and the side channel enabled) it binds a port for a punched side channel and
    announces it: a responder behind a NAT, whose listener we cannot dial, may take it up (``p2p.punch``).

    ``session`` (:class:`Session`) bounds the handshake and the transfer and counts its bytes; ``validate``
    judges the partner's values as they arrive (node/averaging/robust.py).

    Round trips, with the libp2p connection up (issue #50): the stream's protocol (1, p2p/multiselect.py;
    none where the partner confirmed the protocol before and the stream is optimistic, `open_optimistic`:
    the request rides with the proposal), the request and its answer (1), the side channel's TCP connect
    (1, none where ``early`` dialled the answer's port already, ``p2p.datapath.preconnect``), then our HELLO
    and the path message go together and the partner's first byte comes back a round trip later with its
    ACK: 2 to an empty exchange's end with a partner we exchanged with before, 4 the first time (6 before
    issue #50: a second multistream round trip, and the path message only after the ACK)."""
    control = LibP2PByteStream(stream)
    progress = Progress() if session.progress is None else session.progress
    mine = KeyAgreement()
    tensors = tensors.as_arrays()
    numel = tensors.phi.size
    wire = ask.wire
    plan = make_plans(numel, wire.dtype, wire.int8_block, wire.compression, wire.fragment)
    with contextlib.ExitStack() as cleanup:
        punch = None
        if offer_punch and ask.datapath and remote_ip:
            punch = cleanup.enter_context(PunchSocket())
        c = ask.contribution
        request = AvgRequest(
            outer_step=c.outer_step, manifest_hash=ask.manifest_hash, layout_hash=ask.layout_hash, numel=numel,
            wire_dtype=wire.dtype, int8_block=wire.int8_block, chunk_elems=plan.delta.chunk_elems,
            pubkey=mine.public_key, datapath=ask.datapath, punch_port=punch.port if punch else 0,
            inner_steps=c.inner_steps, samples=c.samples, waited_ms=c.waited_ms, stage=ask.stage,
            members=c.members, compression=wire.compression, fragment=wire.fragment,
            phi_chunk_elems=plan.phi.chunk_elems, stream_fragment=ask.stream_fragment,
            stream_fragments=ask.stream_fragments,
        )
        with trio.fail_after(session.handshake_timeout):
            await send_msg(control, request_map(request), max_bytes=MAX_CONTROL_BYTES)
            answer = await recv_as(control, AvgAnswer, max_bytes=MAX_CONTROL_BYTES)
        if answer.verdict != "accept":
            raise Declined(AnswerCode.of(answer.verdict, answer.code, answer.reason), answer.reason,
                           answer.outer_step, answer.since_publish_ms, answer.paired)
        if on_accept is not None and not on_accept(answer):
            raise Declined(AnswerCode.CLAIMED, "we were claimed by a crossing request meanwhile")
        keys = mine.derive(
            role=Role.INITIATOR,
            peer_public_key=answer.pubkey,
            session_id=answer.session_id,
            local_peer_id=session.local_peer_id,
            remote_peer_id=session.remote_peer_id,
            protocol_id=KEYS_PROTOCOL_ID,
        )
        async with watched(session.limits, progress):
            channel: FrameChannel | None = None
            if request.datapath and answer.datapath_port and remote_ip:
                address = (remote_ip, answer.datapath_port)
                try:
                    with trio.fail_after(DATAPATH_CONNECT_S):
                        dialled = await early.take(address) if early is not None else None
                    # The ACK is read after the path message went (below): the partner starts its bulk
                    # as both reach it, a round trip sooner than if we waited for the ACK to send it.
                    channel = await connect_datapath(address, keys, timeout=DATAPATH_CONNECT_S, stream=dialled,
                                                     await_ack=False)
                except (ProtocolError, trio.TooSlowError) as e:
                    log.debug("side channel to %s:%d unavailable (%s); using the libp2p stream", remote_ip,
                              answer.datapath_port, e)
            elif punch is not None and answer.punch_port and remote_ip:
                channel = await _punch(punch, (remote_ip, answer.punch_port), keys)
            await send_msg(control, AvgPath("datapath" if channel else "stream"), max_bytes=MAX_CONTROL_BYTES)
            if channel is not None:
                async with channel:
                    # The listener's proof of the session keys before our first byte of bulk. Past this
                    # point a failure fails the exchange (the partner was told "datapath"), where a
                    # failed ACK used to fall back to the stream: a listener that accepted the connect
                    # and named no session of ours is not a partner's, and is rare.
                    await channel.await_ack(timeout=DATAPATH_CONNECT_S)
                    return await run_transfer(_counted(channel, progress), tensors, plan, "datapath", validate)
            return await run_transfer(
                PlainFrameChannel(_Counted(control, progress), max_frame_size=MAX_FRAME), tensors, plan, "stream",
                validate,
            )
    raise AssertionError("unreachable")  # pragma: no cover (the ExitStack does not swallow exceptions)


async def _punch(local: PunchSocket, remote: tuple[str, int], keys: SessionKeys) -> SecureChannel | None:
    """The initiator's punched side channel, or None (the libp2p stream then carries the bulk)."""
    try:
        stream = await simultaneous_open(local, remote, timeout=PUNCH_S)
        return await open_punched(stream, keys, timeout=DATAPATH_CONNECT_S)
    except (ProtocolError, trio.TooSlowError) as e:
        why = str(e) or f"no answer to the handshake within {DATAPATH_CONNECT_S:g}s"
        log.info("no punched side channel to %s:%d (%s); using the libp2p stream", remote[0], remote[1], why)
        return None


async def read_request(stream: object, timeout: float) -> AvgRequest:
    with trio.fail_after(timeout):
        return await recv_as(LibP2PByteStream(stream), AvgRequest, max_bytes=MAX_CONTROL_BYTES)


def _on_the_wire(answer: AvgAnswer, coded: bool) -> dict[str, object]:
    """`answer` as the asker's version reads it: without `code` on a 1.2.0 stream (`coded` False), whose
    peers refuse unknown fields, and without an empty one (an accept's) in either version."""
    fields = to_map(answer)
    if not coded or not answer.code:
        fields.pop("code")
    return fields


async def answer(
    stream: object,
    code: AnswerCode,
    reason: str = "",
    outer_step: int = 0,
    since_publish_ms: int = 0,
    paired: bool = False,
    *,
    coded: bool = True,
) -> None:
    """Send a busy/refuse answer (best effort: the asker may already be gone); `coded`: the stream speaks
    1.3.0 (`PROTOCOL_ID`), so the answer carries `code` beside the text."""
    if code is AnswerCode.CLAIMED:
        code = AnswerCode.BUSY  # ours alone: a peer need not know it
    message = AvgAnswer(verdict=code.verdict, reason=reason[:300], outer_step=outer_step,
                        since_publish_ms=since_publish_ms, paired=paired, code=code.value)
    with trio.move_on_after(2):
        try:
            await send_msg(LibP2PByteStream(stream), _on_the_wire(message, coded), max_bytes=MAX_CONTROL_BYTES)
        except ProtocolError:
            pass


async def respond(
    stream: object,
    request: AvgRequest,
    tensors: Tensors,
    session: Session,
    ours: Contribution,
    *,
    listener: DataPathListener | None,
    validate: Validator | None = None,
    allow_punch: bool = False,
) -> TransferResult:
    """The responder's side, after the caller decided to accept `request`; `ours` goes in the accept.

    Where it offers no listener (``listener`` None: we are not publicly reachable) but the initiator
    offered a punch port, both open a punched side channel at once; else the libp2p stream. ``session`` as
    in :func:`initiate`."""
    control = LibP2PByteStream(stream)
    progress = Progress() if session.progress is None else session.progress
    handshake_timeout = session.handshake_timeout
    tensors = tensors.as_arrays()
    if request.numel != tensors.phi.size:
        raise ProtocolError(Reason.BAD_FIELD, f"numel {request.numel} != ours {tensors.phi.size}")
    try:
        plan = make_plans(request.numel, request.wire_dtype, request.int8_block, request.compression,
                          request.fragment, request.chunk_elems, request.phi_chunk_elems)
    except ValueError as e:
        raise ProtocolError(Reason.BAD_FIELD, str(e)) from None
    mine = KeyAgreement()
    session_id = new_session_id()
    keys = mine.derive(
        role=Role.RESPONDER,
        peer_public_key=request.pubkey,
        session_id=session_id,
        local_peer_id=session.local_peer_id,
        remote_peer_id=session.remote_peer_id,
        protocol_id=KEYS_PROTOCOL_ID,
    )
    offer_listener = listener is not None and request.datapath
    remote_ip = partner_ip(stream)
    with contextlib.ExitStack() as cleanup:
        punch = None
        if not offer_listener and request.datapath and request.punch_port and remote_ip and allow_punch:
            punch = cleanup.enter_context(PunchSocket())
        accept = AvgAnswer(
            verdict="accept",
            outer_step=ours.outer_step,
            pubkey=mine.public_key,
            session_id=session_id,
            datapath_port=listener.port if (listener is not None and offer_listener) else 0,
            punch_port=punch.port if punch else 0,
            inner_steps=ours.inner_steps,
            samples=ours.samples,
            waited_ms=ours.waited_ms,
            members=ours.members,
        )
        accept_fields = _on_the_wire(accept, coded=False)  # an accept carries no code, in either version
        async with watched(session.limits, progress):
            if accept.datapath_port and listener is not None:
                async with listener.expect(keys, timeout=handshake_timeout + DATAPATH_CONNECT_S) as pending:
                    await send_msg(control, accept_fields, max_bytes=MAX_CONTROL_BYTES)
                    path = await recv_as(control, AvgPath, max_bytes=MAX_CONTROL_BYTES)
                    if path.path == "datapath":
                        async with await pending.wait() as channel:
                            return await run_transfer(_counted(channel, progress), tensors, plan, "datapath",
                                                      validate)
            elif punch is not None and remote_ip:
                await send_msg(control, accept_fields, max_bytes=MAX_CONTROL_BYTES)
                channel = await _punched_or_stream(control, punch, (remote_ip, request.punch_port), keys)
                if channel is not None:
                    async with channel:
                        return await run_transfer(_counted(channel, progress), tensors, plan, "datapath", validate)
            else:
                await send_msg(control, accept_fields, max_bytes=MAX_CONTROL_BYTES)
                path = await recv_as(control, AvgPath, max_bytes=MAX_CONTROL_BYTES)
                if path.path == "datapath":
                    raise ProtocolError(Reason.BAD_FIELD, "partner chose a side channel we did not offer")
            return await run_transfer(
                PlainFrameChannel(_Counted(control, progress), max_frame_size=MAX_FRAME), tensors, plan, "stream",
                validate,
            )
    raise AssertionError("unreachable")  # pragma: no cover


async def _punched_or_stream(
    control: LibP2PByteStream, punch: PunchSocket, remote: tuple[str, int], keys: SessionKeys
) -> SecureChannel | None:
    """The responder's half of a punched side channel: connect towards the initiator and answer its
    handshake while waiting for its choice of path (it chooses only once the handshake is done). Returns
    the authenticated channel, or None where the initiator chose the stream."""
    opened: list[SecureChannel] = []

    async def connect_and_answer() -> None:
        with contextlib.suppress(ProtocolError, trio.TooSlowError):
            stream = await simultaneous_open(punch, remote, timeout=PUNCH_S)
            opened.append(await open_punched(stream, keys, timeout=DATAPATH_CONNECT_S))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(connect_and_answer)
        path = await recv_as(control, AvgPath, max_bytes=MAX_CONTROL_BYTES)
        if path.path == "stream":
            nursery.cancel_scope.cancel()  # its punch failed or it gave up: stop ours
    if path.path == "stream":
        for channel in opened:
            await channel.aclose()
        return None
    if not opened:
        raise ProtocolError(Reason.BROKEN, "partner chose the punched side channel, but it did not connect here")
    return opened[0]


def partner_ip(stream: object) -> str | None:
    """The IP the partner's libp2p connection comes from (its NAT's public address when it is behind one)."""
    try:
        remote = stream.get_remote_address()  # type: ignore[attr-defined]
    except Exception:  # no address for this kind of connection (e.g. a relayed one, or a test double)
        return None
    return str(remote[0]) if remote else None
