"""Fuzz every Starling decoder and protocol handler with random and mutated inputs (``make fuzz``).

Why: every byte a peer, a file or a local client hands the daemon goes through one of these decoders,
and each promises to turn garbage into one documented exception type (or, for the stream handlers, a
counted failure) and never into a crash, a hang or an unbounded allocation. This script holds them to
that promise with >= 100k inputs per decoder; ``tests/test_fuzz.py`` drives the same targets with
hypothesis on every test run (a few hundred inputs each).

Inputs are mostly *mutations of valid encodings* (seeds), because purely random bytes die in the first
length check and never reach the schema, the signatures or the protocol state machines:

* structured: decode a seed message, change one value deep inside (wrong type, out of range, missing
  or unknown key, huge length, nested msgpack inside a bytes field), re-encode with a correct frame;
* message-level: drop, repeat, reorder or cut the messages of a recorded conversation;
* byte-level: bit flips, interesting bytes, inserted/deleted/duplicated ranges, truncation, a 4-byte
  length field overwritten with 0 or 2**32-1, splices of two seeds;
* a few percent of pure random bytes, and the seeds themselves (so that "accepted" is exercised).

Per decoder it prints: inputs, accepted, rejected (by reason), unexpected (must be 0: an exception of
an undocumented type, a hang, or a broken promise such as a failure that was not counted or a server
that stopped answering), inputs/s and the process's peak RSS after it. Exit status 1 on any unexpected
outcome; the offending inputs are written to a directory named in the output.

    python bench/fuzz.py               # 100k inputs per decoder (several minutes)
    python bench/fuzz.py --quick       # 2k per decoder, a smoke run
    python bench/fuzz.py --only avg.respond --n 20000 --seed 7
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import ipaddress
import itertools
import json
import logging
import math
import multiprocessing
import os
import random
import re
import resource
import socket
import struct
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, ClassVar
from unittest import mock

import msgpack
import numpy as np
import tomli_w
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from node.averaging.averager import Averager
from node.bridge.exchange import ExchangeRequest
from node.config.home import Home
from node.config.load import ConfigError, load_config
from node.config.sync import SyncConfig
from node.ops.control import serve_control
from node.ops.history import HistoryError, LossHistory
from node.swarm.crdt import (
    Delivery,
    Manifest,
    RecordError,
    StateFileError,
    SwarmState,
    Verifier,
    decode_digest,
    encode_digest,
    peer_id_of,
)
from node.swarm.replicator import DeliveredReplica
from node.worker import checkpoint as ckpt
from node.worker.task import layout_hash
from p2p.datapath import (
    FRAME_HELLO,
    MAGIC,
    DataPathListener,
    KeyAgreement,
    Role,
    SecureChannel,
    connect_datapath,
)
from p2p.wire import (
    FRAME_DATA,
    FRAME_HEADER,
    PlainFrameChannel,
    ProtocolError,
    decode_msg,
    from_map,
    recv_msg,
    to_map,
)
from protocols import avg, dialback, state
from protocols.codec import ChunkPlan, get_codec, recv_tensor
from protocols.lowbit import TopKLowBitCodec
from starling_testing.averaging import FakeSwarm
from starling_testing.fakes import FakeHost, FakeNetStream, RefusingProber, ScriptedStream

#: Longest any single input may take before it counts as a hang (every input ends in EOF, so no
#: decoder has a reason to wait for anything).
HANG_S = 10.0
#: Largest input produced; mutations that grow a seed beyond it are cut.
MAX_INPUT = 256 * 1024


class Violation(AssertionError):
    """A broken promise other than an exception type: an uncounted failure, a server that stopped
    serving, a dial-back target at a foreign IP, negative swarm totals, a stream left open."""


# --------------------------------------------------------------------------------------------------
# Inputs: seeds and mutations
# --------------------------------------------------------------------------------------------------

#: One piece of a seed. ``msg``: a u32-length-prefixed msgpack message (p2p.wire framing);
#: ``doc``: a bare msgpack document (records, digests, files); ``toml``: a TOML document; ``raw``: bytes.
Part = tuple[str, Any]
Seed = list[Part]

INTERESTING_INTS = [
    0, 1, -1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 127, 128, 255, 256, 4096, 0x7FFF, 0x8000, 0xFFFF,
    0x10000, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**53, 2**63 - 1, -(2**63), 2**64 - 1,
]  # fmt: skip
INTERESTING_FLOATS = [0.0, -0.0, 1e-45, 1e308, -1e308, math.inf, -math.inf, math.nan, 0.5, -1.0]
#: msgpack type markers, framing bytes and separators: the bytes most likely to change a parse.
INTERESTING_BYTES = [
    0x00, 0x01, 0x7F, 0x80, 0xFF, 0xC0, 0xC1, 0xC2, 0xC3, 0xC4, 0xC6, 0xCA, 0xCB, 0xCF, 0xD3, 0xD9,
    0xDB, 0xDC, 0xDD, 0xDE, 0xDF, 0x90, 0x9F, 0xA0, 0xBF, 0x0A, 0x5B, 0x7B, 0x22, 0x3D,
]  # fmt: skip
U32_VALUES = [0, 1, 4, 5, 16, 17, 255, 4096, 65535, 1 << 20, (1 << 20) + 1, 1 << 24, 2**31, 2**32 - 1]


def render(seed: Seed) -> bytes:
    """The bytes of a seed: its parts encoded and concatenated."""
    out = bytearray()
    for kind, value in seed:
        if kind == "msg":
            payload = msgpack.packb(value, use_bin_type=True)
            out += struct.pack(">I", len(payload)) + payload
        elif kind == "doc":
            out += msgpack.packb(value, use_bin_type=True)
        elif kind == "toml":
            out += tomli_w.dumps(value).encode()
        else:
            out += value
    return bytes(out)


class Mutator:
    """Turns seeds into inputs; every choice comes from ``rng`` (so hypothesis can drive and shrink it)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def mutate(self, seeds: Sequence[Seed]) -> bytes:
        r = self.rng
        seed = r.choice(seeds)
        roll = r.random()
        if roll < 0.03:
            return render(seed)
        if roll < 0.10:
            return r.randbytes(r.choice([0, 1, 2, 3, 4, 5, 8, 16, 64, 256, 1024]))
        if roll < 0.45:
            data = self._structured(seed)
        elif roll < 0.55:
            data = self._reframed(seed)
        else:
            data = render(seed)
        if roll >= 0.45 or r.random() < 0.2:
            data = self._bytewise(data, seeds)
        return data[:MAX_INPUT]

    # -- structured: one value deep inside one message changes ----------------------------------

    def _structured(self, seed: Seed) -> bytes:
        decoded = [i for i, (kind, _) in enumerate(seed) if kind in ("msg", "doc", "toml")]
        if not decoded:
            return self._reframed(seed)
        for _ in range(4):  # a mutation may produce what the encoder cannot write; try another
            parts = copy.deepcopy(seed)
            for _ in range(1 + (self.rng.random() < 0.3)):
                i = self.rng.choice(decoded)
                parts[i] = (parts[i][0], self._mutate_value(parts[i][1], depth=0))
            try:
                return render(parts)
            except Exception:  # msgpack/tomli_w cannot write it (huge int, surrogate, TOML without a table)
                continue
        return render(seed)

    def _mutate_value(self, value: Any, depth: int) -> Any:
        """A copy of ``value`` with one node changed (or ``value`` replaced, at the chosen node)."""
        r = self.rng
        children: list[Any] = []
        if isinstance(value, dict):
            children = list(value)
        elif isinstance(value, list):
            children = list(range(len(value)))
        if children and depth < 12 and r.random() < 0.75:
            key = r.choice(children)
            value[key] = self._mutate_value(value[key], depth + 1)
            return value
        return self._mutate_here(value)

    def _mutate_here(self, value: Any) -> Any:
        r = self.rng
        if r.random() < 0.3:
            return self.random_value(depth=0)
        if isinstance(value, bool):
            return not value
        if isinstance(value, int):
            return r.choice([value + 1, value - 1, -value, r.choice(INTERESTING_INTS), value * 2**32])
        if isinstance(value, float):
            return r.choice([*INTERESTING_FLOATS, -value, value * 1e300])
        if isinstance(value, str):
            return r.choice([
                "", value[: r.randrange(len(value) + 1)], value + "x", value * r.choice([2, 50]),
                value.upper(), "\u00e9" + value, value + "\x00", value.replace("/", "//"),
            ])  # fmt: skip
        if isinstance(value, bytes):
            nested = self._nested_msgpack(value)
            if nested is not None:
                return nested
            return r.choice([
                b"", value[: r.randrange(len(value) + 1)], value + b"\x00", value * 2,
                bytes(len(value)), self._flip(value), r.randbytes(len(value)),
            ])  # fmt: skip
        if isinstance(value, list):
            ops = ["clear", "append", "many"] + (["drop", "dup", "swap"] if value else [])
            op = r.choice(ops)
            if op == "clear":
                return []
            if op == "append":
                return [*value, self.random_value(depth=1)]
            if op == "many":
                return (value or [self.random_value(depth=1)]) * r.choice([2, 9, 65, 300])
            i = r.randrange(len(value))
            if op == "drop":
                return value[:i] + value[i + 1 :]
            if op == "dup":
                return value[: i + 1] + value[i:]
            j = r.randrange(len(value))
            value[i], value[j] = value[j], value[i]
            return value
        if isinstance(value, dict):
            keys = list(value)
            op = r.choice(["add", "int-key"] + (["drop", "rename"] if keys else []))
            if op == "add":
                value[r.choice(["x", "t", "v", "", "extra", "kind", "body"])] = self.random_value(depth=1)
            elif op == "int-key":
                value[r.choice([0, 1, -1])] = self.random_value(depth=1)
            elif op == "drop":
                del value[r.choice(keys)]
            else:
                k = r.choice(keys)
                value[str(k) + "_"] = value.pop(k)
            return value
        return self.random_value(depth=0)

    def _nested_msgpack(self, value: bytes) -> bytes | None:
        """A bytes field that holds msgpack itself (a signed record's body): mutate inside it."""
        if len(value) < 2 or value[0] not in range(0x80, 0x90) or self.rng.random() < 0.5:
            return None
        try:
            inner = msgpack.unpackb(value, raw=False, strict_map_key=False)
            return msgpack.packb(self._mutate_value(inner, depth=1), use_bin_type=True)
        except (ValueError, TypeError, OverflowError):
            return None

    def random_value(self, depth: int) -> Any:
        r = self.rng
        kinds = ["none", "bool", "int", "float", "str", "bytes"] + (["list", "dict"] if depth < 3 else [])
        kind = r.choice(kinds)
        if kind == "none":
            return None
        if kind == "bool":
            return r.random() < 0.5
        if kind == "int":
            return r.choice(INTERESTING_INTS) if r.random() < 0.7 else r.randrange(-(2**63), 2**64)
        if kind == "float":
            return r.choice(INTERESTING_FLOATS) if r.random() < 0.7 else r.uniform(-1e6, 1e6)
        if kind == "str":
            return r.choice(["", "a", "accept", "stream", "datapath", "fp32", "hello", "records", "\u00e9\u4e2d",
                             "/ip4/127.0.0.1/tcp/1", "x" * r.choice([16, 64, 65, 129, 257, 1025])])
        if kind == "bytes":
            return r.randbytes(r.choice([0, 1, 15, 16, 17, 31, 32, 33, 64, 300]))
        if kind == "list":
            return [self.random_value(depth + 1) for _ in range(r.randrange(4))]
        return {r.choice(["t", "v", "a", "b", "records", "done"]): self.random_value(depth + 1)
                for _ in range(r.randrange(4))}

    # -- message-level: the conversation's messages dropped, repeated, reordered, cut -------------

    def _reframed(self, seed: Seed) -> bytes:
        r = self.rng
        parts = list(seed)
        if not parts:
            return b""
        op = r.choice(["drop", "dup", "swap", "prefix", "inject"])
        i = r.randrange(len(parts))
        if op == "drop":
            del parts[i]
        elif op == "dup":
            parts.insert(i, parts[i])
        elif op == "swap":
            j = r.randrange(len(parts))
            parts[i], parts[j] = parts[j], parts[i]
        elif op == "prefix":
            parts = parts[:i]
        else:
            parts.insert(i, ("msg", {"t": r.choice(["hello", "records", "avg.path", "x"]), "v": 1}))
        try:
            return render(parts)
        except Exception:  # an encoder refused a part; keep the seed
            return render(seed)

    # -- byte-level ------------------------------------------------------------------------------

    def _flip(self, data: bytes) -> bytes:
        if not data:
            return b"\x01"
        buf = bytearray(data)
        i = self.rng.randrange(len(buf))
        buf[i] ^= 1 << self.rng.randrange(8)
        return bytes(buf)

    def _bytewise(self, data: bytes, seeds: Sequence[Seed]) -> bytes:
        r = self.rng
        buf = bytearray(data)
        for _ in range(r.choice([1, 1, 1, 2, 3, 4])):
            op = r.randrange(10)
            n = len(buf)
            pos = r.randrange(n + 1)
            if op == 0 and n:
                buf[min(pos, n - 1)] ^= 1 << r.randrange(8)
            elif op == 1 and n:
                buf[min(pos, n - 1)] = r.choice(INTERESTING_BYTES)
            elif op == 2 and n:
                buf[min(pos, n - 1)] = r.randrange(256)
            elif op == 3:
                buf[pos:pos] = r.randbytes(r.choice([1, 2, 4, 16]))
            elif op == 4 and n:
                del buf[pos : pos + r.choice([1, 2, 4, 16])]
            elif op == 5:
                del buf[pos:]
            elif op == 6 and n >= 4:
                at = r.randrange(n - 3)
                buf[at : at + 4] = struct.pack(">I", r.choice(U32_VALUES))
            elif op == 7 and n:
                start = r.randrange(n)
                chunk = buf[start : start + r.choice([1, 8, 64, 512])]
                buf[pos:pos] = chunk
            elif op == 8:
                other = render(r.choice(seeds))
                buf = buf[:pos] + other[r.randrange(len(other) + 1) :]
            else:
                buf += r.randbytes(r.choice([1, 4, 32]))
        return bytes(buf)


# --------------------------------------------------------------------------------------------------
# Shared fixtures: keys, records, tensors
# --------------------------------------------------------------------------------------------------

KEYS: list[KeyPair] = [create_new_key_pair(bytes([i + 1]) * 32) for i in range(6)]
PEERS: list[ID] = [ID.from_pubkey(k.public_key) for k in KEYS]
MANIFEST = Manifest("fuzz-task", "a" * 64, "b" * 64, 1)
SWARM = "fuzz"
T0 = 1_700_000_000.0


def msg(message: Any) -> Part:
    """A message as it travels on a stream (length-prefixed)."""
    return ("msg", to_map(message))


def doc(message: Any) -> Part:
    """A message's bare msgpack payload (what ``decode_msg`` takes)."""
    return ("doc", to_map(message))


def frames(payloads: Sequence[bytes]) -> list[Part]:
    """PlainFrameChannel data frames, one part each (so frames can be dropped or repeated)."""
    return [("raw", FRAME_HEADER.pack(len(p), FRAME_DATA) + p) for p in payloads]


@cache
def replica_records() -> tuple[bytes, ...]:
    """Validly signed records of every kind, from three authors."""
    out: list[bytes] = []
    for i in range(3):
        s = SwarmState(KEYS[i])
        out.append(s.update_self(addrs=[f"/ip4/127.0.0.1/tcp/{4000 + i}"], outer_step=i, step=10 * i,
                                 loss=2.5, role="trainer").data)
        out.append(s.add_progress(samples=5 + i, tokens=50).data)
        if i == 0:
            signed = s.set_manifest(MANIFEST)
            assert signed is not None
            out.append(signed.data)
    return tuple(out)


def populated_state(key: KeyPair) -> SwarmState:
    s = SwarmState(key)
    s.update_self(outer_step=1)
    s.apply(replica_records())
    return s


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


def scratch_dir(stack: AsyncExitStack) -> str:
    """A temporary directory for files the decoders read, removed when ``stack`` closes. In memory
    where the system offers it: rewriting a file 100k times on a disk-backed /tmp costs minutes."""
    memory = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    return stack.enter_context(tempfile.TemporaryDirectory(prefix="starling-fuzz-", dir=memory))


def _category(text: str, words: int = 5) -> str:
    """A stable label for an error message: quoted values, paths and numbers removed, first words kept."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"|/\S+|0x[0-9a-f]+|\d+(\.\d+)?", "_", text)
    return " ".join(text.split()[:words])


# --------------------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------------------


class Target:
    """One decoder or protocol handler under fuzz.

    ``feed`` hands it one input and returns a label: ``"accepted..."`` or a rejection reason (handlers
    that absorb failures, like the averager's, report them this way). An exception of a type in
    ``allowed`` (the documented ones) is a rejection too; any other exception, a :class:`Violation`,
    or an input running past :data:`HANG_S` is unexpected. ``alive`` checks that a long-lived server
    still serves after the inputs so far. Targets holding resources open them in :meth:`setup`.
    """

    name: ClassVar[str]
    allowed: ClassVar[tuple[type[BaseException], ...]] = ()
    #: Already fuzzed by the unit tests of its module (tests/test_wire.py, tests/test_codec.py).
    fuzzed_elsewhere: ClassVar[bool] = False

    @classmethod
    def seeds(cls) -> list[Seed]:
        """Valid inputs the target must accept, to mutate. Called outside trio (some are built with
        ``trio.run``)."""
        raise NotImplementedError

    @classmethod
    def refusals(cls) -> list[Seed]:
        """Valid inputs the target refuses by design (busy, refuse, mismatch), mutated too."""
        return []

    async def setup(self, stack: AsyncExitStack) -> None:
        """Open what the target needs for its lifetime (servers, temp dirs) on ``stack``."""

    async def __aenter__(self) -> Target:
        self._stack = AsyncExitStack()
        await self._stack.__aenter__()
        try:
            await self.setup(self._stack)
        except BaseException:
            await self._stack.__aexit__(*sys.exc_info())
            raise
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return await self._stack.__aexit__(*exc_info)

    async def feed(self, data: bytes) -> str:
        raise NotImplementedError

    async def alive(self) -> None:
        pass

    def reason(self, exc: BaseException) -> str:
        reason = getattr(exc, "reason", None)
        if reason is not None:
            return f"{type(exc).__name__}:{getattr(reason, 'value', reason)}"
        return f"{type(exc).__name__}:{_category(str(exc))}"


# -- p2p.wire and protocols.codec (fuzzed in their own tests too) ---------------------------------


class WireDecodeMsg(Target):
    name = "wire.decode_msg"
    allowed = (ProtocolError,)
    fuzzed_elsewhere = True

    @classmethod
    def seeds(cls) -> list[Seed]:
        return AvgMessages.seeds() + StateMessages.seeds()

    async def feed(self, data: bytes) -> str:
        decode_msg(data, max_bytes=64 * 1024)
        return "accepted"


class WireRecvMsg(Target):
    name = "wire.recv_msg"
    allowed = (ProtocolError,)
    fuzzed_elsewhere = True

    @classmethod
    def seeds(cls) -> list[Seed]:
        return [[msg(m) for m in avg_messages()], [msg(m) for m in state_messages()], *StateResponder.seeds()]

    async def feed(self, data: bytes) -> str:
        # Short reads split headers and payloads at every offset; large inputs in larger pieces.
        stream = ScriptedStream(data, chunk=1 + len(data) % 13 if len(data) < 512 else 257 + len(data) % 1000)
        try:
            while True:
                await recv_msg(stream, max_bytes=64 * 1024)
        except ProtocolError as exc:
            if exc.reason.value == "closed" and stream.pos == len(data):
                return "accepted"  # every message read, then a clean end
            raise


class WireFrames(Target):
    name = "wire.PlainFrameChannel"
    allowed = (ProtocolError,)
    fuzzed_elsewhere = True

    @classmethod
    def seeds(cls) -> list[Seed]:
        close = ("raw", FRAME_HEADER.pack(0, 1))
        return [[*frames([b"a" * 10, b"b" * 300, b"c"]), close], [*frames([bytes(4096)]), close]]

    async def feed(self, data: bytes) -> str:
        channel = PlainFrameChannel(ScriptedStream(data), max_frame_size=4096)
        room = bytearray(4096)
        while await channel.recv_into(room):
            pass
        return "accepted"


def _codec_header(dtype: int, accumulate: bool, numel: int) -> bytes:
    return struct.pack(">BBH", dtype, accumulate, numel)


DTYPES = ("fp32", "bf16", "int8")
#: The codecs' fuzz targets also cover top-k (Delta under sync.compression): 8 of every 64 entries kept, with int8
#: values and with 2-bit ones (protocols/lowbit.py, on trial under issue #51).
CODEC_DTYPES = (*DTYPES, "topk", "topkq")


def _fuzz_codec(index: int) -> Any:
    name = CODEC_DTYPES[index % len(CODEC_DTYPES)]
    if name == "topkq":
        return TopKLowBitCodec(64, 8, 2)
    return get_codec(name, int8_block=64, topk_keep=8)


class CodecDecodeInto(Target):
    """``TensorCodec.decode_into``: input = dtype, accumulate flag, our numel, then the peer's chunk."""

    name = "codec.decode_into"
    allowed = (ProtocolError,)
    fuzzed_elsewhere = True

    @classmethod
    def seeds(cls) -> list[Seed]:
        x = np.random.default_rng(1).standard_normal(300, dtype=np.float32)
        return [
            [("raw", _codec_header(i, acc, 300)), ("raw", _fuzz_codec(i).encode(x))]
            for i, _ in enumerate(CODEC_DTYPES)
            for acc in (False, True)
        ]

    async def feed(self, data: bytes) -> str:
        if len(data) < 4:
            return "short header (harness)"
        dtype, accumulate, numel = struct.unpack(">BBH", data[:4])
        codec = _fuzz_codec(dtype)
        codec.decode_into(data[4:], np.zeros(numel % 4097, np.float32), accumulate=bool(accumulate & 1))
        return "accepted"


class CodecRecvTensor(Target):
    """``ChunkPlan.from_header`` with the peer's chunking, then ``recv_tensor`` over its frames."""

    name = "codec.recv_tensor"
    allowed = (ProtocolError,)
    fuzzed_elsewhere = True

    @classmethod
    def seeds(cls) -> list[Seed]:
        x = np.random.default_rng(2).standard_normal(300, dtype=np.float32)
        out = []
        for i, _ in enumerate(CODEC_DTYPES):
            codec = _fuzz_codec(i)
            plan = ChunkPlan.from_header(300, codec, 128, max_frame_size=4096)
            chunks = [codec.encode(x[a:b]) for a, b in plan]
            out.append([("raw", struct.pack(">BHI", i, 300, 128)), *frames(chunks)])
        return out

    async def feed(self, data: bytes) -> str:
        if len(data) < 7:
            return "short header (harness)"
        dtype, numel, chunk_elems = struct.unpack(">BHI", data[:7])
        codec = _fuzz_codec(dtype)
        out = np.zeros(numel % 4097, np.float32)  # our own array: its size is never the peer's to choose
        plan = ChunkPlan.from_header(out.size, codec, chunk_elems, max_frame_size=4096)
        await recv_tensor(PlainFrameChannel(ScriptedStream(data[7:]), max_frame_size=4096), out, plan)
        return "accepted"


# -- protocols.avg and the averager's responder -------------------------------------------------------

AVG_NUMEL = 300
AVG_LAYOUT = [("w", (20, 15))]
AVG_MANIFEST = "m" * 64


def avg_tensors(seed: int) -> avg.Tensors:
    """Replicas of one model: phis around a common point, within the averager's bounds (node/averaging/robust.py).
    numpy float32, as the daemon holds them (node/bridge/shm.py)."""
    g = np.random.default_rng(seed)
    base = np.random.default_rng(0).standard_normal(AVG_NUMEL, dtype=np.float32)
    return avg.Tensors(base + g.standard_normal(AVG_NUMEL, dtype=np.float32) * np.float32(0.01),
                       g.standard_normal(AVG_NUMEL, dtype=np.float32) * np.float32(0.01),
                       np.empty(AVG_NUMEL, np.float32), np.empty(AVG_NUMEL, np.float32))


def _avg_request(dtype: str, *, datapath: bool = False) -> avg.AvgRequest:
    return avg.AvgRequest(outer_step=3, manifest_hash=AVG_MANIFEST, layout_hash=layout_hash(AVG_LAYOUT),
                          numel=AVG_NUMEL, wire_dtype=dtype, int8_block=16, chunk_elems=64,
                          pubkey=KeyAgreement().public_key, datapath=datapath)


def _tensor_frames(dtype: str, int8_block: int, chunk_elems: int | None, seed: int) -> list[Part]:
    """The frames of a partner's phi and Delta, as the plain (libp2p stream) data path carries them."""
    t = avg_tensors(seed)
    plan = avg.make_plan(AVG_NUMEL, dtype, int8_block, chunk_elems)
    return frames([plan.codec.encode(v[a:b]) for v in (t.phi, t.delta) for a, b in plan])


def avg_messages() -> list[Any]:
    """One valid message of every kind and variant of /starling/avg."""
    return [
        _avg_request("int8"),
        _avg_request("fp32", datapath=True),
        avg.AvgAnswer(verdict="accept", outer_step=3, pubkey=bytes(range(32)), session_id=bytes(16),
                      datapath_port=4242),
        avg.AvgAnswer(verdict="busy", reason="not ready"),
        avg.AvgAnswer(verdict="busy", reason="not ready", code=avg.AnswerCode.NOT_READY.value),
        avg.AvgAnswer(verdict="refuse", reason="manifest mismatch", outer_step=9),
        avg.AvgPath("stream"),
        avg.AvgPath("datapath"),
    ]


class AvgMessages(Target):
    """The avg messages' strict schema (``from_map``) over a decoded payload."""

    name = "avg.messages"
    allowed = (ProtocolError,)

    @classmethod
    def seeds(cls) -> list[Seed]:
        return [[doc(m)] for m in avg_messages()]

    async def feed(self, data: bytes) -> str:
        kinds = (avg.AvgRequest, avg.AvgAnswer, avg.AvgPath)
        from_map(kinds, decode_msg(data, max_bytes=avg.MAX_CONTROL_BYTES))
        return "accepted"


class AvgResponder(Target):
    """The averager's stream handler (``Averager.run`` sets it on the host): a partner's whole conversation
    (request, path, frames) against a node that is pairing. Every input must end in a completed exchange, a
    busy/refuse answer or a *counted* failure, with the stream closed or reset, and never raise."""

    name = "avg.respond"

    @classmethod
    def seeds(cls) -> list[Seed]:
        return [[msg(_avg_request(d)), msg(avg.AvgPath("stream")), *_tensor_frames(d, 16, 64, seed=7)]
                for d in DTYPES]

    @classmethod
    def refusals(cls) -> list[Seed]:
        wrong_layout = dataclasses.replace(_avg_request("bf16"), layout_hash="0" * 64)
        return [
            [msg(_avg_request("bf16", datapath=True)), msg(avg.AvgPath("datapath"))],  # a channel never offered
            [msg(wrong_layout), msg(avg.AvgPath("stream"))],
        ]

    async def feed(self, data: bytes) -> str:
        cfg = SyncConfig(wire_dtype="fp32", datapath=False, pair_window_s=600, handshake_timeout_s=5)
        host = FakeHost(KEYS[0])
        averager = Averager(host, cfg, FakeSwarm(host, manifest=AVG_MANIFEST))
        t = avg_tensors(1)
        stream = FakeNetStream(data, PEERS[1])
        async with trio.open_nursery() as nursery:
            await nursery.start(averager.run)
            nursery.start_soon(averager.exchange, ExchangeRequest(3, t.phi, t.delta, t.phi_out, t.delta_out,
                                                                  AVG_LAYOUT, layout_hash(AVG_LAYOUT)))
            while averager.status()["state"] != "pairing":
                await trio.sleep(0)
            await host.handlers[avg.PROTOCOL_ID](stream)  # as the host hands an inbound stream over
            nursery.cancel_scope.cancel()
        if not (stream.closed or stream.was_reset):
            raise Violation("the responder left the stream open")
        stats = averager.status()
        if stats["rounds"]:
            return "accepted:averaged"
        if stats["failures"]:
            error = _averager_error(stats["last_error"])
            if not error.startswith(("ProtocolError", "Rejected")):
                # Only these two count as the partner's offence (and lead to a ban when repeated).
                raise Violation(f"a partner's garbage failed the exchange as {stats['last_error']!r}")
            return f"failed:{error}"
        verdict = _answer_verdict(bytes(stream.written))
        if verdict in ("busy", "refuse"):
            return f"answered:{verdict}"
        raise Violation(f"no exchange, no answer and no counted failure (last_error={stats['last_error']!r})")


def _averager_error(text: str | None) -> str:
    """'<peer>: ProtocolError: bad_field: ...' -> 'ProtocolError:bad_field'."""
    parts = (text or "").split(": ")
    if len(parts) >= 3 and parts[1] == "ProtocolError":
        return f"ProtocolError:{parts[2]}"
    return parts[1] if len(parts) >= 2 else "?"


def _answer_verdict(written: bytes) -> str | None:
    if len(written) < 4:
        return None
    (size,) = struct.unpack(">I", written[:4])
    try:
        return from_map(avg.AvgAnswer, decode_msg(written[4 : 4 + size])).verdict
    except ProtocolError:
        return None


class AvgInitiator(Target):
    """``avg.initiate`` against a partner whose answer and frames are the input."""

    name = "avg.initiate"
    allowed = (avg.Declined, avg.Rejected, ProtocolError)

    @classmethod
    def seeds(cls) -> list[Seed]:
        def accept() -> Part:
            return msg(avg.AvgAnswer(verdict="accept", outer_step=3, pubkey=KeyAgreement().public_key,
                                     session_id=os.urandom(16)))

        # The first byte picks the wire dtype this node asks for (the answer does not carry it).
        return [[("raw", bytes([i])), accept(), *_tensor_frames(d, 64, None, seed=9)] for i, d in enumerate(DTYPES)]

    @classmethod
    def refusals(cls) -> list[Seed]:
        return [
            [("raw", b"\x00"), msg(avg.AvgAnswer(verdict="busy", reason="already exchanging"))],
            [("raw", b"\x01"), msg(avg.AvgAnswer(verdict="refuse", reason="manifest mismatch"))],
        ]

    async def feed(self, data: bytes) -> str:
        dtype = DTYPES[data[0] % 3] if data else "fp32"
        ask = avg.Ask(avg.Contribution(outer_step=3), manifest_hash=AVG_MANIFEST, layout_hash=layout_hash(AVG_LAYOUT),
                      wire=avg.Wire(dtype, int8_block=64))
        session = avg.Session(PEERS[0].to_bytes(), PEERS[1].to_bytes(), HANG_S,
                              avg.TransferLimits(stall_s=HANG_S, max_s=HANG_S))
        await avg.initiate(FakeNetStream(data[1:], PEERS[1]), ask, avg_tensors(2), session, remote_ip=None)
        return "accepted"


# -- protocols.state ---------------------------------------------------------------------------------

LOCAL = state.LocalInfo(version="0.1.0", swarm=SWARM, manifest_hash=MANIFEST.hash)


#: The salt of every scripted session: the initiator's, and what a scripted responder echoes.
SALT = bytes(range(state.SALT_BYTES))
#: Bucket hashes that differ from any replica's in every bucket, so that entries and records follow.
ALL_DIFFER = b"\xff" * (state.BUCKETS * state.BUCKET_HASH_BYTES)


def _hello(replica: SwarmState, manifest_hash: str = "") -> state.Hello:
    del replica  # its entries go in _entries(); the hello claims a difference in every bucket
    return state.Hello("0.1.0", SWARM, manifest_hash, SALT, ALL_DIFFER)


def _intro_hello(record: bytes, manifest_hash: str = "") -> state.IntroHello:
    return state.IntroHello("0.1.0", SWARM, manifest_hash, SALT, ALL_DIFFER, record)


def _entries(replica: SwarmState) -> state.Entries:
    return state.Entries(encode_digest(replica.digest()))


def state_messages() -> list[Any]:
    """One valid message of every kind of /starling/state (2.0.0)."""
    return [
        _hello(populated_state(KEYS[3]), MANIFEST.hash),
        _entries(populated_state(KEYS[3])),
        state.Records(list(replica_records()), done=True),
        state.Records([], done=False),
        state.Error(state.MANIFEST_MISMATCH, "manifests differ", manifest_hash="f" * 64, swarm=SWARM),
        state.Error(state.BUSY, "too many sessions"),
        state.Error(state.BUSY, "too many sessions", referral=list(replica_records()[:4])),
    ]


class StateMessages(Target):
    """The state messages' strict schema (``from_map``) over a decoded payload."""

    name = "state.messages"
    allowed = (ProtocolError,)

    @classmethod
    def seeds(cls) -> list[Seed]:
        return [[doc(m)] for m in state_messages()]

    async def feed(self, data: bytes) -> str:
        from_map((state.Hello, state.Entries, state.Records, state.Error), decode_msg(data, max_bytes=2 << 20))
        return "accepted"


class StateResponder(Target):
    """``state.respond``: an initiator's hello and record batches against a fresh replica."""

    name = "state.respond"
    allowed = (ProtocolError, state.SyncRefused)

    @classmethod
    def seeds(cls) -> list[Seed]:
        records = list(replica_records())
        initiator = populated_state(KEYS[4])
        fresh = SwarmState(KEYS[5])
        return [
            [msg(_hello(initiator)), msg(_entries(initiator)), msg(state.Records(records[:3], done=False)),
             msg(state.Records(records[3:], done=True))],
            [msg(_hello(initiator, MANIFEST.hash)), msg(_entries(initiator)), msg(state.Records(records, done=True))],
            [msg(_hello(fresh)), msg(_entries(fresh)), msg(state.Records([], done=True))],
        ]

    @classmethod
    def refusals(cls) -> list[Seed]:
        other_run = populated_state(KEYS[4])
        return [[msg(_hello(other_run, "f" * 64)), msg(_entries(other_run)), msg(state.Records([], done=True))]]

    async def feed(self, data: bytes) -> str:
        replica = SwarmState(KEYS[5])
        replica.update_self(outer_step=2)
        result = await state.respond(ScriptedStream(data), replica, LOCAL, timeout_s=HANG_S, max_records=64)
        return "accepted" if not result.rejected else "accepted:with rejected records"


class StateResponderIntro(StateResponder):
    """``state.respond`` on 2.1.0: the initiator's hello introduces it (its own record, which the responder's
    replica as the session sees it takes only when the initiator signed it)."""

    name = "state.respond 2.1.0"

    @classmethod
    def seeds(cls) -> list[Seed]:
        records = list(replica_records())
        initiator = populated_state(KEYS[4])
        own = initiator.member_data(initiator.peer_id) or b""
        someone_elses = records[0]
        return [
            [msg(_intro_hello(own)), msg(_entries(initiator)), msg(state.Records(records, done=True))],
            [msg(_intro_hello(someone_elses)), msg(_entries(initiator)), msg(state.Records([], done=True))],
            [msg(_intro_hello(b"")), msg(_entries(initiator)), msg(state.Records([], done=True))],
        ]

    @classmethod
    def refusals(cls) -> list[Seed]:
        other_run = populated_state(KEYS[4])
        own = other_run.member_data(other_run.peer_id) or b""
        return [[msg(_intro_hello(own, "f" * 64)), msg(_entries(other_run)), msg(state.Records([], done=True))]]

    async def feed(self, data: bytes) -> str:
        replica = SwarmState(KEYS[5])
        replica.update_self(outer_step=2)
        session = DeliveredReplica(replica, Delivery(peer_id_of(KEYS[4].public_key), "loopback"))
        result = await state.respond(ScriptedStream(data), session, LOCAL, timeout_s=HANG_S, max_records=64,
                                     introduce=True)
        return "accepted" if not result.rejected else "accepted:with rejected records"


class StateInitiator(Target):
    """``state.initiate``: a responder's hello (or error) and record batches."""

    name = "state.initiate"
    allowed = (ProtocolError, state.SyncRefused)

    @classmethod
    def seeds(cls) -> list[Seed]:
        records = list(replica_records())
        responder = populated_state(KEYS[4])
        return [
            [msg(_hello(responder, MANIFEST.hash)), msg(_entries(responder)), msg(state.Records(records, done=True))],
            [msg(_hello(responder)), msg(_entries(responder)), msg(state.Records(records[:2], done=False)),
             msg(state.Records([], done=True))],
        ]

    @classmethod
    def refusals(cls) -> list[Seed]:
        return [
            [msg(state.Error(state.MANIFEST_MISMATCH, "differ", manifest_hash="f" * 64, swarm=SWARM))],
            [msg(state.Error(state.SWARM_MISMATCH, "other swarm", swarm="elsewhere"))],
            [msg(state.Error(state.BUSY, "busy"))],
            [msg(state.Error(state.BUSY, "busy", referral=list(replica_records()[:4])))],
        ]

    async def feed(self, data: bytes) -> str:
        replica = SwarmState(KEYS[5])
        replica.update_self(outer_step=2)
        with mock.patch.object(state, "_new_salt", lambda: SALT):  # the scripted responder echoes SALT
            result = await state.initiate(ScriptedStream(data), replica, LOCAL, timeout_s=HANG_S, max_records=64)
        return "accepted" if not result.rejected else "accepted:with rejected records"


# -- protocols.dialback --------------------------------------------------------------------------------

NONCE = bytes(range(16))
OFFERED = ("/ip4/127.0.0.1/tcp/4001", "/ip4/10.0.0.7/tcp/4001/p2p/" + str(PEERS[2]), "/ip6/::1/tcp/4002")


def dialback_messages() -> list[Any]:
    """One valid message of every kind of /starling/dialback."""
    return [
        dialback.DialbackRequest(nonce=NONCE, addrs=OFFERED),
        dialback.DialbackProbe(nonce=NONCE),
        dialback.ProbeAck(ok=True),
        dialback.DialbackResult(dialback.DialStatus.REFUSED, "/ip4/1.2.3.4/tcp/1", "1.2.3.4", "rst"),
        dialback.DialbackResult(dialback.DialStatus.REACHED),
    ]


class DialbackMessages(Target):
    """The dial-back messages' strict schema (``from_map``) over a decoded payload."""

    name = "dialback.messages"
    allowed = (ProtocolError,)

    @classmethod
    def seeds(cls) -> list[Seed]:
        return [[doc(m)] for m in dialback_messages()]

    async def feed(self, data: bytes) -> str:
        kinds = (dialback.DialbackRequest, dialback.DialbackProbe, dialback.ProbeAck, dialback.DialbackResult)
        from_map(kinds, decode_msg(data, max_bytes=dialback.MAX_MSG_BYTES))
        return "accepted"


class DialbackHandler(Target):
    """The dial-back stream handler (helper and probe roles) fed an asker's or prober's messages. It
    must answer or reset, close the stream, and never raise."""

    name = "dialback.handler"

    def __init__(self) -> None:
        ticks = itertools.count(0.0, 10.0)  # every request is past the per-asker rate limit
        self.service = dialback.DialbackService(FakeHost(KEYS[0]), make_prober=RefusingProber,
                                                clock=lambda: next(ticks))

    @classmethod
    def seeds(cls) -> list[Seed]:
        local = dialback.DialbackRequest(nonce=NONCE, addrs=("/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/2"))
        return [[msg(m)] for m in [*dialback_messages()[:2], local]]

    async def feed(self, data: bytes) -> str:
        stream = FakeNetStream(data, PEERS[1])
        await self.service._handle(stream)  # type: ignore[arg-type]
        if not (stream.closed or stream.was_reset):
            raise Violation("the dial-back handler left the stream open")
        if stream.was_reset:
            return "reset"
        reply = decode_msg(bytes(stream.written[4:]))
        return f"accepted:{reply.get('t')}:{reply.get('status', reply.get('ok'))}"


class DialbackAsk(Target):
    """``DialbackService.ask`` against a helper whose answer is the input: must return an outcome."""

    name = "dialback.ask"

    def __init__(self) -> None:
        self.data = b""
        self.service = dialback.DialbackService(FakeHost(KEYS[0], lambda: FakeNetStream(self.data, PEERS[1])))

    @classmethod
    def seeds(cls) -> list[Seed]:
        return [[msg(dialback.DialbackResult(s, "/ip4/127.0.0.1/tcp/4001", "127.0.0.1", "x"))]
                for s in dialback.DialStatus if s is not dialback.DialStatus.ERROR]

    @classmethod
    def refusals(cls) -> list[Seed]:
        return [[msg(dialback.DialbackResult(dialback.DialStatus.ERROR, detail="helper failed"))]]

    async def feed(self, data: bytes) -> str:
        self.data = data
        outcome = await self.service.ask(PEERS[1], OFFERED)
        if outcome.status is dialback.DialStatus.REACHED:
            raise Violation("a helper's claim was believed without a probe")
        if outcome.status is dialback.DialStatus.ERROR:
            return f"error:{_category(outcome.detail, 4)}"
        return f"accepted:{outcome.status.value}"


class DialbackTargets(Target):
    """``select_targets``: the addresses a helper dials must be at the observed IP, whatever is offered."""

    name = "dialback.select_targets"

    @classmethod
    def seeds(cls) -> list[Seed]:
        return [[("raw", "\n".join([ip, *OFFERED]).encode())] for ip in ("127.0.0.1", "10.0.0.7", "::1")]

    async def feed(self, data: bytes) -> str:
        observed, *offered = data.decode("utf-8", "replace").split("\n")
        targets = dialback.select_targets(offered, observed)
        if len(targets) > dialback.MAX_TARGETS:
            raise Violation(f"{len(targets)} targets")
        for t in targets:
            # Compared as addresses: multiaddr writes some IPv6 ones differently (::1:1 as ::0.1.0.1).
            ip = ipaddress.ip_address(t.value_for_protocol(t.protocols()[0].name))
            if ip != ipaddress.ip_address(observed):
                raise Violation(f"target {t} is not at the observed IP {observed!r}")
        return f"accepted:{len(targets)} targets" if targets else "no targets"


# -- node.swarm.crdt ----------------------------------------------------------------------------------------


class CrdtRecord(Target):
    name = "crdt.Verifier.decode"
    allowed = (RecordError,)

    @classmethod
    def seeds(cls) -> list[Seed]:
        return [[("doc", _unpack(r))] for r in replica_records()]

    async def feed(self, data: bytes) -> str:
        Verifier().decode(data)
        return "accepted"


class CrdtDigest(Target):
    name = "crdt.decode_digest"
    allowed = (RecordError,)

    @classmethod
    def seeds(cls) -> list[Seed]:
        return [[("doc", _unpack(encode_digest(populated_state(k).digest())))] for k in KEYS[:2]]

    async def feed(self, data: bytes) -> str:
        decode_digest(data, max_entries=256)
        return "accepted"


class CrdtStateFile(Target):
    """``SwarmState.load`` of a corrupt state file: ``StateFileError``, or a state with sane totals."""

    name = "crdt.SwarmState.load"
    allowed = (StateFileError,)

    async def setup(self, stack: AsyncExitStack) -> None:
        self.path = Path(scratch_dir(stack)) / "state"
        # Shared like the daemon's: the seeds' valid signatures are checked once, not per input.
        self.verifier = Verifier()

    @classmethod
    def seeds(cls) -> list[Seed]:
        # An hour ahead, the other members are gone; with room for two, they are evicted as records
        # arrive, so the file has tombstones and retired counts too.
        s = SwarmState(KEYS[0], max_members=2, clock=lambda: time.time() + 3600)
        s.update_self(outer_step=1)
        s.apply(replica_records())
        with tempfile.TemporaryDirectory() as d:
            s.save(Path(d) / "state")
            return [[("doc", _unpack((Path(d) / "state").read_bytes()))]]

    async def feed(self, data: bytes) -> str:
        self.path.write_bytes(data)
        loaded = SwarmState.load(self.path, KEYS[0], max_members=2, verifier=self.verifier)
        totals = loaded.counters()
        if totals.samples < 0 or totals.tokens < 0:
            raise Violation(f"negative swarm totals after loading: {totals}")
        return "accepted" if not loaded.rejected else "accepted:records dropped"


# -- node.ops.history ---------------------------------------------------------------------------------


class HistoryBytes(Target):
    name = "history.LossHistory.from_bytes"
    allowed = (HistoryError,)

    @classmethod
    def seeds(cls) -> list[Seed]:
        h = LossHistory()
        for m in range(2):
            for s in range(12):
                h.observe(f"peer{m}", s * 10, s // 3, 4.0 - 0.1 * s, None if s % 2 else 3.9, T0 + s)
        return [[("doc", _unpack(h.to_bytes()))]]

    def reason(self, exc: BaseException) -> str:
        return f"HistoryError:{_category(getattr(exc, 'problem', str(exc)))}"

    async def feed(self, data: bytes) -> str:
        LossHistory.from_bytes(data, max_points=16, max_members=4)
        return "accepted"


# -- p2p.datapath: the side channel's listener --------------------------------------------------------

_SESSION_ID = bytes(range(100, 116))


def _datapath_keys() -> tuple[Any, Any]:
    """Matching initiator and responder keys for one fixed session (re-registered for every input)."""
    initiator, responder = KeyAgreement(), KeyAgreement()
    ki = initiator.derive(role=Role.INITIATOR, peer_public_key=responder.public_key, session_id=_SESSION_ID,
                          local_peer_id=b"i", remote_peer_id=b"r", protocol_id=avg.KEYS_PROTOCOL_ID)
    kr = responder.derive(role=Role.RESPONDER, peer_public_key=initiator.public_key, session_id=_SESSION_ID,
                          local_peer_id=b"r", remote_peer_id=b"i", protocol_id=avg.KEYS_PROTOCOL_ID)
    return ki, kr


_KEYS_I, _KEYS_R = _datapath_keys()


class DatapathListener(Target):
    """Raw TCP input to the data-path listener, with the session the input names registered. After
    garbage the listener must still accept the real partner."""

    name = "datapath.listener"

    @classmethod
    def seeds(cls) -> list[Seed]:
        async def hello() -> bytes:
            """The initiator's encrypted HELLO frame, as connect_datapath sends it."""
            a, b = trio.socket.socketpair()
            with a, b:
                await SecureChannel(trio.SocketStream(a), _KEYS_I)._send_frame(FRAME_HELLO, b"")
                return await b.recv(4096)

        return [[("raw", MAGIC), ("raw", _SESSION_ID), ("raw", trio.run(hello))]]

    async def setup(self, stack: AsyncExitStack) -> None:
        nursery = await stack.enter_async_context(trio.open_nursery())
        stack.callback(nursery.cancel_scope.cancel)
        self.listener = DataPathListener("127.0.0.1", 0, max_frame_size=4096, handshake_timeout=2.0)
        await nursery.start(self.listener.serve)

    async def feed(self, data: bytes) -> str:
        rejected_before = self.listener.rejected
        got_channel = False
        async with self.listener.expect(_KEYS_R, timeout=HANG_S) as pending:
            client = await trio.open_tcp_stream("127.0.0.1", self.listener.port)
            async with client, trio.open_nursery() as nursery:

                async def collect() -> None:
                    nonlocal got_channel
                    async with await pending.wait():
                        got_channel = True  # leaving the block closes it, which ends the client's read

                nursery.start_soon(collect)
                try:
                    await client.send_all(data)
                    await client.send_eof()
                    while await client.receive_some(65536):
                        pass
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # the listener reset a connection it refused
                nursery.cancel_scope.cancel()
        if got_channel:
            return "accepted"
        while self.listener.rejected == rejected_before:  # its handler may still be closing the socket
            await trio.sleep(0.001)
        return "rejected"

    async def alive(self) -> None:
        async with self.listener.expect(_KEYS_R, timeout=5) as pending:
            async with await connect_datapath(("127.0.0.1", self.listener.port), _KEYS_I, timeout=5):
                async with await pending.wait():
                    pass


# -- node.ops.control: the local control socket --------------------------------------------------------


async def _control_handler(request: dict[str, Any]) -> dict[str, Any]:
    """The daemon's command set in miniature (node.daemon.Daemon._handle_control)."""
    if request["cmd"] == "ping":
        return {"ok": True}
    if request["cmd"] == "status":
        return {"ok": True, "status": {"peer_id": str(PEERS[0])}}
    return {"ok": False, "error": f"unknown command {request['cmd']!r}"}


class ControlSocket(Target):
    """One client line to ``serve_control``: every line gets one JSON answer and the server keeps
    serving (an exception escaping a client handler would take the whole daemon down)."""

    name = "control.socket"

    @classmethod
    def seeds(cls) -> list[Seed]:
        lines = [{"cmd": "status"}, {"cmd": "ping", "x": [1, 2.5, {"y": None}], "z": "\u00e9"}]
        return [[("raw", json.dumps(line).encode() + b"\n")] for line in lines]

    @classmethod
    def refusals(cls) -> list[Seed]:
        return [[("raw", b'{"cmd": "history"}\n')], [("raw", b'{"cmd": 7}\n')], [("raw", b"status\n")]]

    async def setup(self, stack: AsyncExitStack) -> None:
        self.path = Path(scratch_dir(stack)) / "control.sock"
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        stack.callback(self._nursery.cancel_scope.cancel)
        self.server_error: BaseException | None = None
        await self._start()

    async def _start(self) -> None:
        async def serve(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                await serve_control(self.path, _control_handler, task_status=task_status)
            except Exception as exc:  # recorded and reported as a violation; the next input restarts it
                self.server_error = exc

        self.server_error = None
        await self._nursery.start(serve)

    async def _ask(self, data: bytes) -> bytes:
        """Send ``data`` (then EOF) while reading the answer: the server may answer and hang up
        before it has read everything (an over-long line)."""
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.connect(str(self.path))
        answer = bytearray()
        async with trio.SocketStream(sock) as stream, trio.open_nursery() as nursery:

            async def send() -> None:
                try:
                    await stream.send_all(data)
                    await stream.send_eof()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

            nursery.start_soon(send)
            try:
                while chunk := await stream.receive_some(65536):
                    answer += chunk
            except trio.BrokenResourceError:
                pass
            nursery.cancel_scope.cancel()
        return bytes(answer)

    async def feed(self, data: bytes) -> str:
        if self.server_error is not None:
            await self._start()
        answer = await self._ask(data)
        try:
            decoded = json.loads(answer.split(b"\n", 1)[0])
        except ValueError:
            await self._check_server()
            raise Violation(f"no JSON answer to one request line (got {answer[:80]!r})") from None
        if decoded.get("ok"):
            return "accepted"
        return f"error:{_category(str(decoded.get('error')), 4)}"

    async def _check_server(self) -> None:
        await trio.sleep(0.05)  # let a crashed server task finish unwinding
        if self.server_error is not None:
            raise Violation(f"the control server died: {type(self.server_error).__name__}: {self.server_error}")

    async def alive(self) -> None:
        await self._check_server()
        if json.loads(await self._ask(b'{"cmd": "ping"}\n') or b"null") != {"ok": True}:
            raise Violation("the control server does not answer a ping")


# -- node.config.load ------------------------------------------------------------------------------------


class ConfigFile(Target):
    """``load_config`` of a garbage ``config.toml``: a ``ConfigError`` naming the problem, nothing else."""

    name = "config.load_config"
    allowed = (ConfigError,)

    @classmethod
    def seeds(cls) -> list[Seed]:
        from node.config.load import _sections, render_config_file

        full = {name: dataclasses.asdict(section()) for name, section in _sections().items()}
        return [
            [("toml", full)],
            [("toml", {"node": {"swarm": "lab", "listen": ["/ip4/127.0.0.1/tcp/0"], "target_peers": 4},
                       "sync": {"wire_dtype": "int8"}})],
            [("raw", render_config_file({"node": {"swarm": "lab"}}).encode())],
        ]

    async def setup(self, stack: AsyncExitStack) -> None:
        self.home = Path(scratch_dir(stack))

    def reason(self, exc: BaseException) -> str:
        return f"ConfigError:{_category(str(exc), 5)}"

    async def feed(self, data: bytes) -> str:
        Home(self.home).config.write_bytes(data)
        load_config(self.home, environ={})
        return "accepted"


# -- node.worker.checkpoint --------------------------------------------------------------------------------


@cache
def _checkpoint_file() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "ckpt-000000000001.pt"
        state = {"step": 1, "model": {"w": torch.arange(6.0).reshape(2, 3)}, "opt": {"lr": 0.1, "betas": (0.9, 0.99)}}
        ckpt.write_checkpoint(path, state)
        return path.read_bytes()


class CheckpointFile(Target):
    """``read_checkpoint`` of a corrupt file (mostly caught by the header and its hash)."""

    name = "checkpoint.file"
    allowed = (ckpt.CheckpointError,)

    @classmethod
    def seeds(cls) -> list[Seed]:
        return [[("raw", _checkpoint_file()[:48]), ("raw", _checkpoint_file()[48:])]]

    async def setup(self, stack: AsyncExitStack) -> None:
        directory = Path(scratch_dir(stack))
        self.path = directory / "ckpt-000000000001.pt"

    def reason(self, exc: BaseException) -> str:
        return f"CheckpointError:{_category(str(exc), 3)}"

    async def feed(self, data: bytes) -> str:
        self.path.write_bytes(self.wrap(data))
        ckpt.read_checkpoint(self.path)
        return "accepted"

    def wrap(self, data: bytes) -> bytes:
        return data


class CheckpointPayload(CheckpointFile):
    """A corrupt payload under a *valid* header and hash, so that ``torch.load`` itself sees garbage."""

    name = "checkpoint.payload"

    @classmethod
    def seeds(cls) -> list[Seed]:
        return [[("raw", _checkpoint_file()[48:])]]

    def wrap(self, data: bytes) -> bytes:
        return struct.pack(">8s32sQ", ckpt.MAGIC, hashlib.sha256(data).digest(), len(data)) + data

    async def feed(self, data: bytes) -> str:
        with warnings.catch_warnings():  # torch warns about the garbage pickle protocols it is shown
            warnings.simplefilter("ignore")
            return await super().feed(data)


#: Every target, in the order they run.
TARGETS: list[type[Target]] = [
    WireDecodeMsg, WireRecvMsg, WireFrames, CodecDecodeInto, CodecRecvTensor,
    AvgMessages, AvgResponder, AvgInitiator,
    StateMessages, StateResponder, StateResponderIntro, StateInitiator,
    DialbackMessages, DialbackHandler, DialbackAsk, DialbackTargets,
    CrdtRecord, CrdtDigest, CrdtStateFile, HistoryBytes,
    DatapathListener, ControlSocket, ConfigFile, CheckpointFile, CheckpointPayload,
]  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Running inputs
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    kind: str  # "accepted", "rejected" or "unexpected"
    label: str
    error: BaseException | None = None


async def check(target: Target, data: bytes) -> Outcome:
    """Feed one input and judge the result (see :class:`Target`)."""
    try:
        with trio.move_on_after(HANG_S) as guard:
            label = await target.feed(data)
    except Violation as exc:
        return Outcome("unexpected", f"violation: {exc}", exc)
    except target.allowed as exc:
        return Outcome("rejected", target.reason(exc))
    except Exception as exc:
        return Outcome("unexpected", f"{type(exc).__name__}: {str(exc)[:200]}", exc)
    if guard.cancelled_caught:
        return Outcome("unexpected", f"hang: no result within {HANG_S:.0f} s")
    return Outcome("accepted" if label.startswith("accepted") else "rejected", label)


async def check_alive(target: Target) -> Outcome | None:
    """None if a long-lived target still serves, else the unexpected outcome."""
    try:
        with trio.fail_after(HANG_S):
            await target.alive()
    except Exception as exc:
        return Outcome("unexpected", f"stopped serving: {type(exc).__name__}: {exc}", exc)
    return None


async def check_one(target_cls: type[Target], data: bytes) -> list[Outcome]:
    """One input against a fresh target, then its liveness check: what tests/test_fuzz.py runs."""
    async with target_cls() as target:
        outcomes = [await check(target, data)]
        dead = await check_alive(target)
        return outcomes + ([dead] if dead else [])


@dataclass
class Report:
    name: str
    inputs: int = 0
    accepted: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    unexpected: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    saved: list[Path] = field(default_factory=list)


@dataclass(frozen=True)
class SeedSet:
    accepted: list[Seed]  # Target.seeds()
    refused: list[Seed]  # Target.refusals()

    @property
    def all(self) -> list[Seed]:
        return self.accepted + self.refused


@cache
def seeds_of(target_cls: type[Target]) -> SeedSet:
    """A target's seeds, built once per process (outside trio: see :meth:`Target.seeds`)."""
    return SeedSet(target_cls.seeds(), target_cls.refusals())


def inputs_for(target_cls: type[Target], n: int, rng: random.Random) -> Iterator[bytes]:
    """The seeds themselves first, then mutations of them."""
    seeds = seeds_of(target_cls).all
    mutator = Mutator(rng)

    def generate() -> Iterator[bytes]:
        yield from (render(seed) for seed in seeds)
        for _ in range(n - len(seeds)):
            yield mutator.mutate(seeds)

    return generate()


async def fuzz_target(
    target_cls: type[Target], inputs: Iterator[bytes], save_dir: Path, *, alive_every: int = 100
) -> Report:
    """Run every input through one target; a liveness check every ``alive_every`` inputs and at the end."""
    report = Report(target_cls.name)
    began = time.perf_counter()
    async with target_cls() as target:
        for i, data in enumerate(inputs):
            outcome = await check(target, data)
            if outcome.kind == "unexpected" or (i + 1) % alive_every == 0:
                dead = await check_alive(target)
                if dead is not None:
                    outcome = dead if outcome.kind != "unexpected" else outcome
            report.inputs += 1
            if outcome.kind == "accepted":
                report.accepted += 1
            elif outcome.kind == "rejected":
                report.rejected[outcome.label] += 1
            else:
                report.unexpected[outcome.label] += 1
                if len(report.saved) < 20:
                    save_dir.mkdir(parents=True, exist_ok=True)
                    path = save_dir / f"{target_cls.name}-{i}.bin"
                    path.write_bytes(data)
                    report.saved.append(path)
        dead = await check_alive(target)
        if dead is not None:
            report.unexpected[dead.label] += 1
    report.seconds = time.perf_counter() - began
    report.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return report


def print_report(r: Report, *, reasons: int = 6) -> None:
    unexpected = sum(r.unexpected.values())
    rate = r.inputs / r.seconds if r.seconds else 0.0
    print(f"{r.name:32} {r.inputs:>8} {r.accepted:>9} {sum(r.rejected.values()):>9} {unexpected:>10}"
          f" {rate:>10.0f} {r.peak_rss_mb:>9.0f}")
    for label, count in r.rejected.most_common(reasons):
        print(f"{'':34}rejected {count:>7}  {label}")
    if len(r.rejected) > reasons:
        rest = sum(c for _, c in r.rejected.most_common()[reasons:])
        print(f"{'':34}rejected {rest:>7}  ({len(r.rejected) - reasons} other reasons)")
    for label, count in r.unexpected.most_common():
        print(f"{'':34}UNEXPECTED {count:>5}  {label}")
    for path in r.saved[:3]:
        print(f"{'':34}input saved to {path}")


def _run_target(job: tuple[str, int, int, Path]) -> Report:
    """One target's whole run, in a worker process."""
    name, n, seed, save_dir = job
    target_cls = next(t for t in TARGETS if t.name == name)
    return trio.run(fuzz_target, target_cls, inputs_for(target_cls, n, random.Random(seed)), save_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100_000, help="inputs per decoder (default 100000)")
    parser.add_argument("--quick", action="store_true", help="2000 inputs per decoder: a smoke run")
    parser.add_argument("--seed", type=int, default=1, help="random seed (the run is reproducible)")
    parser.add_argument("--only", action="append", default=[], help="run only targets whose name starts so")
    parser.add_argument("--list", action="store_true", help="list the targets and exit")
    parser.add_argument("--save-dir", type=Path, default=None, help="where unexpected inputs are written")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="targets fuzzed in parallel")
    args = parser.parse_args(argv)
    n = 2000 if args.quick else args.n
    targets = [t for t in TARGETS if not args.only or any(t.name.startswith(o) for o in args.only)]
    if args.list or not targets:
        print("\n".join(t.name for t in TARGETS))
        return 0 if args.list else 2
    logging.disable(logging.CRITICAL)  # the handlers log every refused peer; 100k warnings say nothing
    torch.set_num_threads(1)
    save_dir = args.save_dir or Path(tempfile.mkdtemp(prefix="starling-fuzz-failures-"))
    print(f"Starling fuzz: {n} inputs per decoder, seed {args.seed}, python {sys.version.split()[0]}")
    print(f"{'decoder':32} {'inputs':>8} {'accepted':>9} {'rejected':>9} {'unexpected':>10} {'inputs/s':>10}"
          f" {'peak MB':>9}")
    total_unexpected = 0
    began = time.perf_counter()
    jobs = [(t.name, n, args.seed * 1_000_003 + TARGETS.index(t), save_dir) for t in targets]
    # Forked workers share the imports; each target runs in its own trio loop, reports print in order.
    with multiprocessing.get_context("fork").Pool(max(1, min(args.jobs, len(jobs))), maxtasksperchild=1) as pool:
        for report in pool.imap(_run_target, jobs):
            print_report(report)
            sys.stdout.flush()
            total_unexpected += sum(report.unexpected.values())
    print(f"total: {len(targets)} decoders, {time.perf_counter() - began:.0f} s, {total_unexpected} unexpected")
    if total_unexpected:
        print(f"unexpected inputs are in {save_dir}")
    return 1 if total_unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
