"""`/starling/snapshot/1.0.0`: a late joiner downloads a donor's slow weights and step counters.

    joiner                                   donor
    SnapRequest(snapshot_id or "", from_chunk) ->
                                          <- SnapMeta(ok | busy | none, snapshot id, steps, layout,
                                                      numel, chunk size, sha256 of every chunk)
                                          <- chunks from_chunk.. (fp32, framed)

The joiner checks the meta against its own model (`ModelShape`: layout hash and number of values) before
it allocates or writes a byte: a donor that claims another model is refused (`DonorRefused`), so a
download's file never grows past the joiner's own model. Every chunk is checked against its hash before
it is written, so a download can stop at any point and resume later from the first missing chunk (`snapshot_id` pins the version; a donor that has moved on
answers with its new meta and the joiner starts that donor over). Donors limit how many downloads they serve
at once (`busy` beyond that).

What a donor serves: its current slow weights where its `live` source has them (the daemon reads them from the
worker's shared slot: node/bridge/livephi.py), else its newest verified checkpoint. A live snapshot is read
from memory the worker will change at its next outer step, so it carries a lease (`Snapshot.lease`): the
server copies each chunk out before it checks the lease, and ends the download at the first chunk the lease
no longer covers (what was sent matched its hash; the joiner keeps it and asks again). A joiner whose live
download was cut that way gets the checkpoint next, if there is one: over a link too slow for one version
the current weights would be cut every time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import statistics
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
import trio

from p2p.fsutil import open_private, private_dir
from p2p.wire import (
    LibP2PByteStream,
    PlainFrameChannel,
    ProtocolError,
    Reason,
    close_quietly,
    recv_as,
    send_msg,
    spec,
)
from protocols.codec import Flat, tensor_bytes

log = logging.getLogger("starling.snapshot")

PROTOCOL_ID = "/starling/snapshot/1.0.0"
CHUNK_ELEMS = 256 * 1024  # 1 MiB of fp32 per chunk
MAX_CHUNKS = 1 << 16  # 64 Gi parameters at most: bounds the meta message
MAX_META_BYTES = 64 + MAX_CHUNKS * 40
FRAME = CHUNK_ELEMS * 4


@dataclass(frozen=True)
class SnapRequest:
    KIND: ClassVar[str] = "snap.request"
    VERSION: ClassVar[int] = 1
    snapshot_id: str = spec(max_len=64, default="")
    from_chunk: int = spec(ge=0, le=MAX_CHUNKS, default=0)


@dataclass(frozen=True)
class SnapMeta:
    KIND: ClassVar[str] = "snap.meta"
    VERSION: ClassVar[int] = 1
    verdict: str = spec(min_len=1, max_len=8)  # ok | busy | none
    reason: str = spec(max_len=200, default="")
    snapshot_id: str = spec(max_len=64, default="")
    step: int = spec(ge=0, le=1 << 50, default=0)
    outer_step: int = spec(ge=0, le=1 << 50, default=0)
    layout_hash: str = spec(max_len=64, default="")
    numel: int = spec(ge=0, le=MAX_CHUNKS * CHUNK_ELEMS, default=0)
    chunk_hashes: list[bytes] = spec(max_len=MAX_CHUNKS, default_factory=list)

    def __post_init__(self) -> None:
        if self.verdict not in ("ok", "busy", "none"):
            raise ValueError(f"unknown verdict {self.verdict!r}")
        if self.verdict == "ok":
            if len(self.chunk_hashes) != -(-self.numel // CHUNK_ELEMS):
                raise ValueError("chunk hash count does not match numel")
            if any(len(h) != 32 for h in self.chunk_hashes):
                raise ValueError("chunk hashes must be 32 bytes")


# --- the donor ------------------------------------------------------------------------------------------------


class Lease(Protocol):
    """A live snapshot's hold on the memory it is read from."""

    def valid(self) -> bool: ...  # the memory still holds this snapshot

    def release(self) -> None: ...  # the download is over (idempotent)


@dataclass
class Snapshot:
    """Slow weights and counters, in memory, with the hash of every chunk (``phi``: flat float32).
    ``lease``: None for a snapshot that stays as it is (read from a checkpoint file); a live one's hold."""

    phi: Flat
    step: int
    outer_step: int
    layout_hash: str
    chunk_hashes: list[bytes]
    snapshot_id: str
    lease: Lease | None = None

    @classmethod
    def of(cls, phi: Any, step: int, outer_step: int, layout_hash: str) -> Snapshot:
        """``phi``: a numpy array or a CPU torch tensor, of any shape; served as flat float32 (a view where
        it already is contiguous float32, else a converted copy, as before)."""
        flat = _flat_float32(phi)
        raw = tensor_bytes(flat)
        hashes = [hashlib.sha256(raw[i * FRAME : (i + 1) * FRAME]).digest() for i in range(-(-flat.size // CHUNK_ELEMS))]
        sid = hashlib.sha256(b"".join(hashes) + f"{step}:{outer_step}:{layout_hash}".encode()).hexdigest()[:32]
        return cls(flat, step, outer_step, layout_hash, hashes, sid)

    def meta(self) -> SnapMeta:
        return SnapMeta(
            verdict="ok",
            snapshot_id=self.snapshot_id,
            step=self.step,
            outer_step=self.outer_step,
            layout_hash=self.layout_hash,
            numel=self.phi.size,
            chunk_hashes=self.chunk_hashes,
        )


def _flat_float32(phi: Any) -> Flat:
    """``phi`` flattened to contiguous float32 without importing torch: a tensor is recognised by its
    ``detach`` (one that requires grad refuses ``np.asarray``) and converted by its own ``float()`` (numpy
    cannot read bfloat16 or half tensors)."""
    if hasattr(phi, "detach"):
        phi = phi.detach().float()
    return np.ascontiguousarray(np.asarray(phi), dtype=np.float32).reshape(-1)


class Pacer:
    """Spaces the chunks of every download a donor serves so that together they stay under `bytes_per_s`
    (0: no limit). Each chunk reserves its slot before it waits, so concurrent downloads take turns."""

    def __init__(self, bytes_per_s: float = 0.0) -> None:
        self.bytes_per_s = bytes_per_s
        self._free_at = 0.0

    async def take(self, nbytes: int) -> None:
        if self.bytes_per_s <= 0:
            return
        start = max(trio.current_time(), self._free_at)
        self._free_at = start + nbytes / self.bytes_per_s
        await trio.sleep_until(start)


class _Moved(Exception):
    """A live snapshot's memory changed under its download."""


NO_SNAPSHOT = "no checkpoint yet, and the current weights were not still in time (an outer step being applied)"
MAX_CUT_PEERS = 256  # joiners remembered as having had a live download cut (bounded: peer ids are free)


class SnapshotServer:
    """Serves this node's newest snapshot; at most `max_serving` downloads at once.

    `live()`: the current weights (a leased snapshot) or None; `source()`: the newest checkpoint's, or None.
    A joiner whose live download was cut gets the checkpoint's from then on (`cut_peers`, bounded).
    `bytes_per_s`: what all downloads together may send (`sync.serve_mbps`; 0: as fast as the link goes).

    Admission takes a slot of a `trio.CapacityLimiter` without waiting (`acquire_nowait`) as soon as the
    request has arrived and holds it until the download ends, loading the checkpoint included. Checking a
    count, awaiting (the request, the checkpoint read), then incrementing let 8 simultaneous requests all
    pass a limit of 2: each saw the count before any had raised it.
    """

    def __init__(self, source: Callable[[], Snapshot | None], *, live: Callable[[], Awaitable[Snapshot | None]] | None = None,
                 max_serving: int = 2, timeout_s: float = 600.0, bytes_per_s: float = 0.0) -> None:
        self.source = source
        self.pacer = Pacer(bytes_per_s)
        self.live = live
        self.cut_peers: OrderedDict[str, None] = OrderedDict()
        self.max_serving = max_serving
        self.timeout_s = timeout_s
        # trio's limiter needs at least one token; max_serving = 0 (serve nobody) is handled before it.
        self._slots = trio.CapacityLimiter(max(1, max_serving))
        self.served = 0  # downloads served whole
        self.served_live = 0  # of those, live weights (a leased snapshot)
        self.refused_busy = 0

    @property
    def serving(self) -> int:
        """Downloads being served now."""
        return self._slots.borrowed_tokens

    async def handle(self, stream: Any) -> None:
        control = LibP2PByteStream(stream)
        token = object()  # the limiter counts borrowers; one per download
        admitted = False
        try:
            with trio.fail_after(10):
                req = await recv_as(control, SnapRequest, max_bytes=4096)
            if self.max_serving > 0:
                try:
                    self._slots.acquire_on_behalf_of_nowait(token)
                    admitted = True
                except trio.WouldBlock:
                    pass
            if not admitted:
                self.refused_busy += 1
                with trio.fail_after(10):
                    await send_msg(control, SnapMeta(verdict="busy", reason="serving other joiners"))
                return
            peer = str(stream.muxed_conn.peer_id)
            snap = await self._snapshot(peer)
            if snap is None:
                with trio.fail_after(10):
                    await send_msg(control, SnapMeta(verdict="none", reason=NO_SNAPSHOT if self.live else "no checkpoint yet"))
                return
            try:
                with trio.fail_after(self.timeout_s):
                    await send_msg(control, snap.meta(), max_bytes=MAX_META_BYTES)
                    start = req.from_chunk if req.snapshot_id == snap.snapshot_id else 0
                    channel = PlainFrameChannel(control, max_frame_size=FRAME)
                    raw = tensor_bytes(snap.phi)
                    for i in range(start, len(snap.chunk_hashes)):
                        await self.pacer.take(len(raw[i * FRAME : (i + 1) * FRAME]))
                        # Copied, then checked: a copy made while the lease held is what the hash says.
                        chunk = bytes(raw[i * FRAME : (i + 1) * FRAME])
                        if snap.lease is not None and not snap.lease.valid():
                            raise _Moved(f"the weights changed after {i} of {len(snap.chunk_hashes)} chunks")
                        await channel.send(chunk)
            finally:
                if snap.lease is not None:
                    snap.lease.release()
            self.served += 1
            self.served_live += snap.lease is not None
        except _Moved as e:
            self._remember_cut(str(stream.muxed_conn.peer_id))
            log.info("live snapshot download by %s cut: %s", stream.muxed_conn.peer_id, e)
        except (ProtocolError, trio.TooSlowError) as e:
            log.debug("snapshot download by %s ended: %s", stream.muxed_conn.peer_id, e)
        finally:
            if admitted:
                self._slots.release_on_behalf_of(token)
            await close_quietly(stream)


    async def _snapshot(self, peer: str) -> Snapshot | None:
        """The live weights, else the checkpoint's; the checkpoint's first for a joiner whose live download
        was cut before (the live weights still where there is no checkpoint: nothing else could serve it)."""
        if self.live is not None and peer not in self.cut_peers and (snap := await self.live()) is not None:
            return snap
        if (snap := await trio.to_thread.run_sync(self.source)) is not None:
            return snap
        return await self.live() if self.live is not None and peer in self.cut_peers else None

    def _remember_cut(self, peer: str) -> None:
        self.cut_peers[peer] = None
        self.cut_peers.move_to_end(peer)
        while len(self.cut_peers) > MAX_CUT_PEERS:
            self.cut_peers.popitem(last=False)


# --- the joiner -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The joiner's own model: the layout hash its worker computes and its number of trainable values.

    Why the joiner needs it before the download: the donor's meta chooses the size of the file the joiner
    writes. A donor that claimed numel = 2^34 made a joiner create a 64 GiB sparse file and write 2.41 GiB
    of hashed zeros while it sat at step 0; nothing compared the claim with the joiner's model until
    `combine`. Against this, the most a download writes is ``numel * 4`` bytes."""

    layout_hash: str
    numel: int

    def mismatch(self, layout_hash: str, numel: int) -> str:
        """Why a snapshot of ``(layout_hash, numel)`` cannot be ours ("" when it can)."""
        if layout_hash != self.layout_hash:
            return f"layout {layout_hash[:12]!r} is not ours ({self.layout_hash[:12]!r})"
        if numel != self.numel:
            return f"{numel} values, our model has {self.numel}"
        return ""


class DonorRefused(ProtocolError):
    """The donor's meta does not describe our model: dropped before a byte was written (an offence)."""

    def __init__(self, detail: str) -> None:
        super().__init__(Reason.BAD_FIELD, detail)


@dataclass
class DonorProgress:
    """What has been downloaded from one donor, on disk so that a restart resumes it."""

    donor: str
    meta: dict[str, Any] | None = None
    have: int = 0  # chunks written, a prefix
    error: str = ""
    done: bool = False
    bytes: int = 0
    refused: bool = False  # its meta was not our model: nothing of it was kept (an offence)


@dataclass
class JoinDownload:
    """Downloads from several donors at once into `directory` (`<donor>.bin` + `<donor>.json`), each of at
    most `model`'s size: a donor whose meta is not `model` is refused before its file is created."""

    directory: Path
    model: ModelShape
    progress: dict[str, DonorProgress] = field(default_factory=dict)

    def _paths(self, donor: str) -> tuple[Path, Path]:
        safe = "".join(c for c in donor if c.isalnum())
        return self.directory / f"{safe}.bin", self.directory / f"{safe}.json"

    def _load(self, donor: str) -> DonorProgress:
        _, meta_path = self._paths(donor)
        p = DonorProgress(donor)
        try:
            saved = json.loads(meta_path.read_text())
            meta, have = saved["meta"], int(saved["have"])
            # A progress file of another model (an earlier version saved any donor's meta) is not resumed.
            if not self.model.mismatch(str(meta["layout_hash"]), int(meta["numel"])):
                p.meta, p.have = meta, have
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return p

    def _save(self, p: DonorProgress) -> None:
        _, meta_path = self._paths(p.donor)
        tmp = meta_path.with_suffix(".tmp")
        with open_private(tmp, "w") as f:
            f.write(json.dumps({"meta": p.meta, "have": p.have}))
        os.replace(tmp, meta_path)

    async def fetch(self, open_stream: Callable[[str], Any], donor: str, *, timeout_s: float) -> DonorProgress:
        """Download (or resume) the snapshot of `donor`; never raises for network trouble. Files are 0600
        in a 0700 folder: they are a model's weights."""
        private_dir(self.directory)
        p = self.progress[donor] = self._load(donor)
        data_path, _ = self._paths(donor)
        p.have = _verified_prefix(data_path, p)
        try:
            with trio.fail_after(timeout_s):
                stream = await open_stream(donor)
                try:
                    await self._fetch_on(stream, p, data_path)
                finally:
                    await close_quietly(stream)
        except DonorRefused as e:
            p.refused, p.meta, p.have = True, None, 0
            p.error = f"refused: {e.detail}"[:200]
            log.warning("snapshot donor %s refused: %s", donor, e.detail)
            for path in self._paths(donor):  # whatever an earlier run kept of it
                path.unlink(missing_ok=True)
        except (ProtocolError, trio.TooSlowError, OSError) as e:
            p.error = f"{type(e).__name__}: {e}"[:200]
        except Exception as e:  # libp2p raises many types for a peer that went away
            p.error = f"{type(e).__name__}: {e}"[:200]
        if p.meta is not None:
            self._save(p)  # what arrived so far is kept for the next attempt
        return p

    async def _fetch_on(self, stream: Any, p: DonorProgress, data_path: Path) -> None:
        control = LibP2PByteStream(stream)
        sid = p.meta["snapshot_id"] if p.meta else ""
        await send_msg(control, SnapRequest(snapshot_id=sid, from_chunk=p.have if sid else 0))
        meta = await recv_as(control, SnapMeta, max_bytes=MAX_META_BYTES)
        if meta.verdict != "ok":
            p.error = f"{meta.verdict}: {meta.reason}"
            return
        # Before a byte is allocated: the file's size is the donor's claim, so the claim must be our model.
        if why := self.model.mismatch(meta.layout_hash, meta.numel):
            raise DonorRefused(why)
        fresh = {
            "snapshot_id": meta.snapshot_id,
            "step": meta.step,
            "outer_step": meta.outer_step,
            "layout_hash": meta.layout_hash,
            "numel": meta.numel,
            "chunk_hashes": [h.hex() for h in meta.chunk_hashes],
        }
        if p.meta != fresh:  # a new snapshot, or the same id with other hashes or counters: start over
            p.meta = fresh
            p.have = 0
            with open_private(data_path, "wb") as f:
                f.truncate(meta.numel * 4)
            self._save(p)
        hashes = meta.chunk_hashes
        channel = PlainFrameChannel(control, max_frame_size=FRAME)
        with open(data_path, "r+b") as f:
            for i in range(p.have, len(hashes)):
                chunk = await channel.recv()
                expected = min(CHUNK_ELEMS, meta.numel - i * CHUNK_ELEMS) * 4
                if len(chunk) != expected:
                    raise ProtocolError(Reason.BAD_SIZE, f"chunk {i}: {len(chunk)} bytes, expected {expected}")
                if hashlib.sha256(chunk).digest() != hashes[i]:
                    raise ProtocolError(Reason.BAD_FIELD, f"chunk {i} does not match its hash")
                f.seek(i * FRAME)
                f.write(chunk)
                p.have = i + 1
                p.bytes += len(chunk)
                if p.have % 16 == 0:
                    f.flush()
                    self._save(p)
            f.flush()
            os.fsync(f.fileno())
        p.done = True
        self._save(p)

    def complete(self) -> list[tuple[DonorProgress, Path]]:
        return [(p, self._paths(d)[0]) for d, p in self.progress.items() if p.done and p.meta]

    def clear(self) -> None:
        for path in self.directory.glob("*"):
            path.unlink(missing_ok=True)

    def prune(self, keep: list[str]) -> None:
        """Delete the partial downloads of donors other than `keep`: they will not be resumed, and a node
        that downloads again and again (catch-ups) must not pile them up."""
        wanted = {path for donor in keep for path in self._paths(donor)}
        for path in self.directory.glob("*"):
            if path not in wanted:
                path.unlink(missing_ok=True)


def _verified_prefix(data_path: Path, p: DonorProgress) -> int:
    """How many leading chunks on disk really match their hashes (the progress file may be ahead of the
    data after a crash, or behind it); resuming starts after them."""
    if not p.meta or p.have <= 0:
        return 0
    hashes = [bytes.fromhex(h) for h in p.meta["chunk_hashes"]]
    numel = p.meta["numel"]
    good = 0
    try:
        with open(data_path, "rb") as f:
            for i in range(min(p.have, len(hashes))):
                chunk = f.read(min(CHUNK_ELEMS, numel - i * CHUNK_ELEMS) * 4)
                if hashlib.sha256(chunk).digest() != hashes[i]:
                    break
                good = i + 1
    except OSError:
        return 0
    return good


COMBINE_BLOCK = 1 << 20  # values per donor in memory at a time while combining


def combine(downloads: list[tuple[DonorProgress, Path]]) -> dict[str, Any]:
    """The joiner's starting state from its complete downloads, none of which is trusted: a donor's chunks
    match the hashes it sent, but it chose those hashes, its counters and its layout itself.

    - The model is the majority's: the largest group of donors with the same ``(layout_hash, numel)``; a
      data file that does not hold exactly ``numel`` float32 values is left out. A tie between groups is a
      ``ValueError``: nothing says which is the swarm's (the worker refuses a layout that is not its own, so
      a donor that lies about it can only cost the joiner its head start, never its model).
    - A donor with a value that is not finite is left out.
    - ``"phi"`` (flat float32 numpy): the coordinate-wise median of three or more donors, so that one of
      three cannot move any value outside the range of the other two (NoLoCo keeps honest donors close, so
      their median is as good a start as their mean); the mean of two (which cannot be told apart), in
      float32 as before; the values of one.
    - ``"step"`` / ``"outer_step"``: the low median of the donors' counters, an honest donor's value where
      most are honest (a donor that claims 2^50 outer steps would otherwise put the joiner out of every
      partner's reach and at the end of its learning-rate schedule).

    ``ValueError`` if no donor is left. Reads each file twice, ``COMBINE_BLOCK`` values at a time: memory
    is the result plus a block per donor, whatever the model's size."""
    groups: dict[tuple[str, int], list[tuple[DonorProgress, Path]]] = {}
    for p, path in downloads:
        if not p.meta:
            continue
        numel = int(p.meta["numel"])
        try:
            size = path.stat().st_size
        except OSError:
            size = -1
        if size != numel * 4:
            log.warning("snapshot from %s: %d bytes on disk, not the %d values its meta says; left out",
                        p.donor, size, numel)
            continue
        groups.setdefault((str(p.meta["layout_hash"]), numel), []).append((p, path))
    if not groups:
        raise ValueError("no complete download")
    ranked = sorted(groups.items(), key=lambda kv: len(kv[1]), reverse=True)
    if len(ranked) > 1 and len(ranked[0][1]) == len(ranked[1][1]):
        raise ValueError("the donors disagree on the model (layout or size) and no majority decides: "
                         + ", ".join(f"{p.donor} {key[0][:12]}/{key[1]}" for key, ds in ranked for p, _ in ds))
    (layout, numel), candidates = ranked[0]
    usable = []
    for p, path in candidates:
        if _all_finite(path, numel):
            usable.append((p, path))
        else:
            log.warning("snapshot from %s holds values that are not finite; left out", p.donor)
    if not usable:
        raise ValueError("every donor's slow weights hold values that are not finite")
    phi = np.empty(numel, dtype=np.float32)
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(open(path, "rb")) for _, path in usable]
        for lo in range(0, numel, COMBINE_BLOCK):
            n = min(COMBINE_BLOCK, numel - lo)
            blocks = [np.fromfile(f, dtype="<f4", count=n) for f in files]
            if any(b.size != n for b in blocks):
                raise ValueError("a snapshot file changed while it was combined")
            out = phi[lo : lo + n]
            if len(blocks) >= 3:
                np.median(np.stack(blocks), axis=0, out=out)
            elif len(blocks) == 2:
                np.add(blocks[0], blocks[1], out=out)
                out /= np.float32(2)
            else:
                out[:] = blocks[0]
    metas = [p.meta for p, _ in usable]
    return {
        "format": "starling-snapshot-1",
        "phi": phi,
        "step": statistics.median_low(int(m["step"]) for m in metas),  # type: ignore[index]
        "outer_step": statistics.median_low(int(m["outer_step"]) for m in metas),  # type: ignore[index]
        "layout_hash": layout,
        "donors": [p.donor for p, _ in usable],
    }


def _all_finite(path: Path, numel: int) -> bool:
    with open(path, "rb") as f:
        for lo in range(0, numel, COMBINE_BLOCK):
            block = np.fromfile(f, dtype="<f4", count=min(COMBINE_BLOCK, numel - lo))
            if not np.isfinite(block).all():
                return False
    return True
