"""Bounded loss history of every swarm member, for plots and for ``starling plot``.

Why this exists: the swarm state (:mod:`node.swarm.crdt`) keeps only the *latest* member record of each peer,
which is what convergence needs but not what a loss curve needs. The daemon therefore feeds every member
record it sees into a :class:`LossHistory`, which remembers a time series per member:
``(wall_time, step, outer_step, loss, val_loss)``.

Memory is bounded however long the run and however large the swarm:

* a member's series is strictly increasing in ``step``; an observation whose step is not newer than the
  member's last point is ignored (gossip and anti-entropy deliver the same record many times). The one
  exception: an observation *at* the last step that carries a loss or validation loss the last point lacks
  fills it in, because a node may publish its validation loss in a later record for the same step;
* at most ``max_points`` points per member (default 2000). When a series is full it is *thinned*: every
  other point is dropped, always keeping the first and the newest, so the curve still spans the whole run
  at half the resolution instead of forgetting its beginning. Later observations are then kept at the
  new, coarser spacing (see :class:`_Series`), so the points stay evenly spread over the run;
* at most ``max_members`` members (default 256). Beyond that, the member whose last observation is the
  oldest is evicted (ties: lowest peer id), which is usually a peer that left long ago.

Points are stored column-wise in :mod:`array` arrays (40 bytes a point, ~20 MB at the default limits)
rather than as Python objects (several times more). A missing or non-finite loss is stored as NaN and
reported as ``None`` (JSON has no NaN; the plot skips such points). Observations carrying neither a loss
nor a validation loss (a relay, a node that has not trained yet) are not recorded: they have nothing to
draw.

The history is persisted as HOME/history.msgpack (`Home.history`) (the daemon saves it every ~30 s
and on stop) so that ``starling plot`` can read it while the daemon runs and after it stopped. The file is
msgpack, versioned, columns as little-endian binary, decoded strictly with size limits; any problem is a
:class:`HistoryError`.
"""

from __future__ import annotations

import math
import os
import sys
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack

from p2p.fsutil import atomic_write_bytes

#: Version of the file format written by :meth:`LossHistory.to_bytes`.
FORMAT_VERSION = 1
FORMAT_NAME = "starling-loss-history"

DEFAULT_MAX_POINTS = 2000
DEFAULT_MAX_MEMBERS = 256

# Decoding limits. They are deliberately looser than the defaults, so that a file written with larger
# limits still loads (it is then trimmed to the reader's limits), yet bound what a hostile or garbled file
# can make the reader allocate.
MAX_FILE_BYTES = 64 * 1024 * 1024
MAX_DECODE_MEMBERS = 4096
MAX_DECODE_POINTS = 65536
MAX_PEER_ID_CHARS = 128
MAX_STEP = 2**63 - 1

_FLOAT, _INT = "d", "q"  # 8-byte double, 8-byte signed integer
_ITEM_BYTES = 8
_COLUMNS = ("t", "step", "outer_step", "loss", "val_loss")
_TYPECODES = (_FLOAT, _INT, _INT, _FLOAT, _FLOAT)


class HistoryError(Exception):
    """A history file or buffer that cannot be read; the message names the file when there is one."""

    def __init__(self, problem: str, path: Path | None = None) -> None:
        if path is None:
            message = f"invalid loss history: {problem}"
        else:
            message = f"loss history file {path} {problem}; delete it or move it aside to start a new history"
        super().__init__(message)
        self.problem = problem
        self.path = path


def _missing_to_nan(value: float | None) -> float:
    """Store a loss: ``None`` and non-finite values become NaN (a gap in the plot)."""
    if value is None:
        return math.nan
    value = float(value)
    return value if math.isfinite(value) else math.nan


def _nan_to_none(value: float) -> float | None:
    return None if math.isnan(value) else value


def series_of(snapshot: dict[str, tuple[array, ...]], max_total_points: int | None = None
              ) -> dict[str, dict[str, list[Any]]]:
    """:meth:`LossHistory.series` of a :meth:`LossHistory.snapshot` (pure: safe in a worker thread)."""
    per_member = None
    if max_total_points is not None and snapshot:
        per_member = max(2, max_total_points // len(snapshot))
    out: dict[str, dict[str, list[Any]]] = {}
    for peer_id, columns in snapshot.items():
        n = len(columns[0])
        if per_member is None or n <= per_member:
            keep: range | list[int] = range(n)
        else:
            stride = -(-(n - 1) // (per_member - 1))  # ceil: the kept points fit the share
            keep = list(range(0, n - 1, stride)) + [n - 1]
        named = dict(zip(_COLUMNS, columns, strict=True))
        out[peer_id] = {
            name: [_nan_to_none(named[name][i]) for i in keep] if name in ("loss", "val_loss")
            else [named[name][i] for i in keep]
            for name in ("t", "step", "outer_step", "loss", "val_loss")
        }
    return out


class _Series:
    """One member's points, column-wise, strictly increasing in step.

    Thinning alone would squeeze the run's end: after each halving the new points arrive at full density
    again, so the curve would keep ever fewer old points and ever more recent ones. So each series also
    keeps ``min_gap``, the spacing in steps that thinning left (0 until the first thinning): a new point
    closer than that to the previous kept one *replaces* the newest point instead of being added. The
    newest observation is therefore always shown, and the kept points stay evenly spread over the run.
    """

    __slots__ = ("t", "step", "outer_step", "loss", "val_loss", "min_gap")

    def __init__(self, min_gap: float = 0.0) -> None:
        self.t = array(_FLOAT)
        self.step = array(_INT)
        self.outer_step = array(_INT)
        self.loss = array(_FLOAT)
        self.val_loss = array(_FLOAT)
        self.min_gap = min_gap

    def __len__(self) -> int:
        return len(self.step)

    def columns(self) -> tuple[array, ...]:
        return (self.t, self.step, self.outer_step, self.loss, self.val_loss)

    def append(self, t: float, step: int, outer_step: int, loss: float, val_loss: float) -> None:
        """Add a point at the end, unconditionally (decoding, merging)."""
        self.t.append(t)
        self.step.append(step)
        self.outer_step.append(outer_step)
        self.loss.append(loss)
        self.val_loss.append(val_loss)

    def add(self, t: float, step: int, outer_step: int, loss: float, val_loss: float) -> None:
        """Add a newer observation. If the newest point is closer than ``min_gap`` to its predecessor (it
        was kept only for being the newest), the observation replaces it, unless that would lose a loss
        the newest point has and the observation lacks (validation losses are usually sparse)."""
        point = (t, step, outer_step, loss, val_loss)
        if (
            len(self) >= 2
            and self.step[-1] - self.step[-2] < self.min_gap
            and _known(point) >= _known(self.point(-1))
        ):
            for column, value in zip(self.columns(), point, strict=True):
                column[-1] = value
        else:
            self.append(*point)

    def point(self, i: int) -> tuple[float, int, int, float, float]:
        return (self.t[i], self.step[i], self.outer_step[i], self.loss[i], self.val_loss[i])

    def points(self) -> Iterator[tuple[float, int, int, float, float]]:
        return zip(self.t, self.step, self.outer_step, self.loss, self.val_loss, strict=True)

    def thin(self) -> None:
        """Halve the points: keep the first and the newest, and one of each pair in between, the one with
        more losses known (ties: the later, so
        that the kept points are every other one). Same span, half the resolution, sparse validation points
        kept. Needs at least 5 points to shrink (hence ``max_points >= 4``)."""
        n = len(self)
        keep = [0]
        for i in range(1, n - 1, 2):
            j = i + 1
            keep.append(j if j < n - 1 and _known(self.point(j)) >= _known(self.point(i)) else i)
        keep.append(n - 1)
        for name in _COLUMNS:
            column: array = getattr(self, name)
            setattr(self, name, array(column.typecode, (column[i] for i in keep)))
        self.min_gap = (self.step[-1] - self.step[0]) / (len(self) - 1)


class LossHistory:
    """Per-member loss time series with bounded memory. Plain synchronous code, not thread-safe: the
    daemon calls it from one trio task (serialise with :meth:`to_bytes` there, write the bytes anywhere)."""

    def __init__(
        self, *, max_points: int = DEFAULT_MAX_POINTS, max_members: int = DEFAULT_MAX_MEMBERS
    ) -> None:
        if max_points < 4:
            raise ValueError(f"max_points must be at least 4, got {max_points}")
        if max_members < 1:
            raise ValueError(f"max_members must be at least 1, got {max_members}")
        self.max_points = max_points
        self.max_members = max_members
        self._members: dict[str, _Series] = {}

    def __len__(self) -> int:
        """Number of members with at least one point."""
        return len(self._members)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._members

    def members(self) -> list[str]:
        """Peer ids, sorted."""
        return sorted(self._members)

    def points(self, peer_id: str) -> int:
        """Number of points held for a member (0 if unknown)."""
        series = self._members.get(peer_id)
        return 0 if series is None else len(series)

    # ---- recording -------------------------------------------------------------------------------

    def observe(
        self,
        peer_id: str,
        step: int,
        outer_step: int,
        loss: float | None,
        val_loss: float | None,
        t: float,
    ) -> bool:
        """Record one observation of a member's progress; return whether it changed the history.

        Ignored: observations without any finite loss, and those whose step is not newer than the
        member's last point (except to fill in a loss the last point lacks at the same step).
        Raises ``ValueError`` for arguments no member record can carry (they indicate a caller bug).
        """
        _check_peer_id(peer_id)
        _check_step("step", step)
        _check_step("outer_step", outer_step)
        if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t):
            raise ValueError(f"observation time must be a finite number, got {t!r}")
        loss_v, val_v = _missing_to_nan(loss), _missing_to_nan(val_loss)
        if math.isnan(loss_v) and math.isnan(val_v):
            return False

        series = self._members.get(peer_id)
        if series is not None:
            last_step = series.step[-1]
            if step < last_step:
                return False
            if step == last_step:
                return self._fill_in_last(series, loss_v, val_v)
        else:
            series = self._members[peer_id] = _Series()
        series.add(float(t), step, outer_step, loss_v, val_v)
        if len(series) > self.max_points:
            series.thin()
        self._evict_beyond_capacity()
        return peer_id in self._members

    @staticmethod
    def _fill_in_last(series: _Series, loss: float, val_loss: float) -> bool:
        changed = False
        if math.isnan(series.loss[-1]) and not math.isnan(loss):
            series.loss[-1] = loss
            changed = True
        if math.isnan(series.val_loss[-1]) and not math.isnan(val_loss):
            series.val_loss[-1] = val_loss
            changed = True
        return changed

    def _evict_beyond_capacity(self) -> None:
        while len(self._members) > self.max_members:
            oldest = min(self._members, key=lambda pid: (self._members[pid].t[-1], pid))
            del self._members[oldest]

    def merge(self, other: LossHistory) -> None:
        """Add every point of ``other`` (the union by step, per member); used to combine several nodes'
        histories. At a step both hold, the point with more losses known wins (ties: this history's)."""
        for peer_id, theirs in other._members.items():
            mine = self._members.get(peer_id)
            min_gap = theirs.min_gap
            if mine is None:
                merged = list(theirs.points())
            else:
                by_step = {p[1]: p for p in theirs.points()}
                for p in mine.points():
                    q = by_step.get(p[1])
                    if q is None or _known(p) >= _known(q):
                        by_step[p[1]] = p
                merged = [by_step[s] for s in sorted(by_step)]
                min_gap = max(min_gap, mine.min_gap)
            self._members[peer_id] = self._build_series(merged, min_gap)
        self._evict_beyond_capacity()

    def _build_series(self, points: list[tuple[float, int, int, float, float]], min_gap: float) -> _Series:
        series = _Series(min_gap)
        for p in points:
            series.append(*p)
        while len(series) > self.max_points:
            series.thin()
        return series

    # ---- reading ---------------------------------------------------------------------------------

    def series(self, max_total_points: int | None = None) -> dict[str, dict[str, list[Any]]]:
        """``{peer_id: {"t": [...], "step": [...], "outer_step": [...], "loss": [...], "val_loss": [...]}}``
        sorted by peer id; a missing loss is ``None``. Plain lists: ready for JSON and for plotting.

        `max_total_points`: at most about that many points in all, each member's spread evenly over its
        span (its first and newest kept). Why: at the history's own bounds (256 members x 2,000 points) the
        full answer is ~34 MiB of JSON, over the control client's 16 MiB limit (`starling plot` failed)."""
        return series_of(self.snapshot(), max_total_points)

    def snapshot(self) -> dict[str, tuple[array, ...]]:
        """Copies of every member's columns (``_COLUMNS`` order): cheap memory copies, taken on the caller's
        thread, so that :func:`series_of` can build the lists on another while this history changes."""
        return {peer_id: tuple(array(c.typecode, c) for c in (getattr(s, name) for name in _COLUMNS))
                for peer_id, s in sorted(self._members.items())}

    @classmethod
    def from_series(
        cls, series: object, *, max_points: int = DEFAULT_MAX_POINTS, max_members: int = DEFAULT_MAX_MEMBERS
    ) -> LossHistory:
        """The inverse of :meth:`series`: how ``starling plot`` reads a running daemon's history (its control
        socket answers ``history`` with that JSON). Checked as strictly as a file; raises
        :class:`HistoryError`. Thinning spacing is not part of the series, so later observations would be
        kept at full density: fine for drawing, which is all this is for."""
        history = cls(max_points=max_points, max_members=max_members)
        if not isinstance(series, dict) or len(series) > MAX_DECODE_MEMBERS:
            raise HistoryError(f"is not a mapping of at most {MAX_DECODE_MEMBERS} members")
        for peer_id, columns in series.items():
            try:
                _check_peer_id(peer_id)
            except ValueError as exc:
                raise HistoryError(f"has a bad member id: {exc}") from None
            values = [columns.get(name) for name in _COLUMNS] if isinstance(columns, dict) else [None]
            if not all(isinstance(v, list) for v in values) or len({len(v) for v in values}) != 1:
                raise HistoryError(f"member {peer_id}: expected equally long lists {', '.join(_COLUMNS)}")
            if not 0 < len(values[0]) <= MAX_DECODE_POINTS:
                raise HistoryError(f"member {peer_id}: between 1 and {MAX_DECODE_POINTS} points expected")
            points = []
            for t, step, outer_step, loss, val_loss in zip(*values, strict=True):
                try:
                    _check_step("step", step)
                    _check_step("outer_step", outer_step)
                    if not _is_number(t) or not math.isfinite(t):
                        raise ValueError(f"observation time must be a finite number, got {t!r:.40}")
                    if not all(v is None or _is_number(v) for v in (loss, val_loss)):
                        raise ValueError("a loss must be a number or null")
                except ValueError as exc:
                    raise HistoryError(f"member {peer_id}: {exc}") from None
                points.append((float(t), step, outer_step, _missing_to_nan(loss), _missing_to_nan(val_loss)))
            if any(b[1] <= a[1] for a, b in zip(points, points[1:], strict=False)):
                raise HistoryError(f"member {peer_id}: steps are not strictly increasing")
            history._members[peer_id] = history._build_series(points, 0.0)
        history._evict_beyond_capacity()
        return history

    # ---- persistence -----------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """Serialise: ``{"format", "v", "members": [[peer_id, min_gap, t, step, outer_step, loss, val_loss],
        ...]}`` with each column as little-endian 8-byte binary."""
        members = [
            [peer_id, series.min_gap, *(_to_little_endian(c) for c in series.columns())]
            for peer_id, series in sorted(self._members.items())
        ]
        return msgpack.packb(
            {"format": FORMAT_NAME, "v": FORMAT_VERSION, "members": members}, use_bin_type=True
        )

    @classmethod
    def from_bytes(
        cls, data: bytes, *, max_points: int = DEFAULT_MAX_POINTS, max_members: int = DEFAULT_MAX_MEMBERS
    ) -> LossHistory:
        """Decode :meth:`to_bytes` output strictly; raise :class:`HistoryError` on anything else. A history
        larger than this reader's limits is trimmed to them (thinned, oldest members evicted)."""
        history = cls(max_points=max_points, max_members=max_members)
        if len(data) > MAX_FILE_BYTES:
            raise HistoryError(f"is {len(data)} bytes, more than the {MAX_FILE_BYTES} allowed")
        try:
            doc = msgpack.unpackb(
                data,
                raw=False,
                strict_map_key=True,
                use_list=True,
                max_str_len=max(MAX_PEER_ID_CHARS, len(FORMAT_NAME)),
                max_bin_len=MAX_DECODE_POINTS * _ITEM_BYTES,
                max_array_len=MAX_DECODE_MEMBERS,
                max_map_len=8,
                max_ext_len=0,
            )
        except Exception as exc:  # msgpack raises many types (ValueError, ExtraData, StackError, ...)
            raise HistoryError(f"is not valid msgpack ({type(exc).__name__}: {str(exc)[:80]})") from None

        if not isinstance(doc, dict) or set(doc) != {"format", "v", "members"}:
            raise HistoryError("is not a loss history (expected the keys format, v, members)")
        if doc["format"] != FORMAT_NAME:
            raise HistoryError(f"is not a loss history (format {doc['format']!r})")
        if doc["v"] != FORMAT_VERSION:
            raise HistoryError(f"has unsupported version {doc['v']!r} (this node reads {FORMAT_VERSION})")
        if not isinstance(doc["members"], list):
            raise HistoryError("has a members field that is not a list")

        for entry in doc["members"]:
            peer_id, min_gap, columns = _decode_member(entry)
            if peer_id in history._members:
                raise HistoryError(f"lists member {peer_id} twice")
            history._members[peer_id] = history._build_series(list(zip(*columns, strict=True)), min_gap)
        history._evict_beyond_capacity()
        return history

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the history to ``path`` atomically (see :func:`atomic_write_bytes`)."""
        atomic_write_bytes(Path(path), self.to_bytes())

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        max_points: int = DEFAULT_MAX_POINTS,
        max_members: int = DEFAULT_MAX_MEMBERS,
    ) -> LossHistory:
        """Read a history saved by :meth:`save`. A missing file gives an empty history; an unreadable or
        corrupt one raises :class:`HistoryError` naming the file (the caller decides to start empty)."""
        path = Path(path)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return cls(max_points=max_points, max_members=max_members)
        except OSError as exc:
            raise HistoryError(f"cannot be read ({exc.strerror})", path) from None
        if size > MAX_FILE_BYTES:
            raise HistoryError(f"is {size} bytes, more than the {MAX_FILE_BYTES} allowed", path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise HistoryError(f"cannot be read ({exc.strerror})", path) from None
        try:
            return cls.from_bytes(data, max_points=max_points, max_members=max_members)
        except HistoryError as exc:
            raise HistoryError(exc.problem, path) from None


# --------------------------------------------------------------------------------------------------
# Validation and column encoding


def _check_peer_id(peer_id: object) -> None:
    if not isinstance(peer_id, str) or not 0 < len(peer_id) <= MAX_PEER_ID_CHARS:
        raise ValueError(
            f"peer id must be a string of 1..{MAX_PEER_ID_CHARS} characters, got {peer_id!r:.80}"
        )


def _check_step(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_STEP:
        raise ValueError(f"{name} must be an integer in 0..2**63-1, got {value!r:.80}")


def _known(point: tuple[float, int, int, float, float]) -> int:
    """How many of a point's two losses are known."""
    return (not math.isnan(point[3])) + (not math.isnan(point[4]))


def _to_little_endian(column: array) -> bytes:
    if sys.byteorder == "little":
        return column.tobytes()
    swapped = array(column.typecode, column)
    swapped.byteswap()
    return swapped.tobytes()


def _from_little_endian(typecode: str, data: bytes) -> array:
    column = array(typecode)
    column.frombytes(data)
    if sys.byteorder != "little":
        column.byteswap()
    return column


def _decode_member(entry: object) -> tuple[str, float, tuple[array, ...]]:
    """Validate one ``[peer_id, min_gap, t, step, outer_step, loss, val_loss]`` entry; return its parts
    with non-finite losses normalised to NaN."""
    if not isinstance(entry, list) or len(entry) != 2 + len(_COLUMNS):
        raise HistoryError(f"has a member entry that is not a list of {2 + len(_COLUMNS)} fields")
    peer_id, min_gap, *raw = entry
    try:
        _check_peer_id(peer_id)
    except ValueError as exc:
        raise HistoryError(f"has a bad member id: {exc}") from None
    if not isinstance(min_gap, int | float) or isinstance(min_gap, bool) or not 0 <= min_gap <= MAX_STEP:
        raise HistoryError(f"member {peer_id}: bad min_gap {min_gap!r:.40}")
    lengths = set()
    for name, value in zip(_COLUMNS, raw, strict=True):
        if not isinstance(value, bytes) or len(value) % _ITEM_BYTES:
            raise HistoryError(f"member {peer_id}: column {name} is not packed 8-byte values")
        lengths.add(len(value))
    if len(lengths) != 1 or 0 in lengths:
        raise HistoryError(f"member {peer_id}: columns are empty or of different lengths")

    t, step, outer_step, loss, val_loss = (
        _from_little_endian(code, value) for code, value in zip(_TYPECODES, raw, strict=True)
    )
    if not all(math.isfinite(v) for v in t):
        raise HistoryError(f"member {peer_id}: non-finite observation time")
    if step[0] < 0 or any(b <= a for a, b in zip(step, step[1:], strict=False)):
        raise HistoryError(f"member {peer_id}: steps are not non-negative and strictly increasing")
    if any(v < 0 for v in outer_step):
        raise HistoryError(f"member {peer_id}: negative outer step")
    for column in (loss, val_loss):
        for i, v in enumerate(column):
            if not math.isfinite(v):
                column[i] = math.nan
    return peer_id, float(min_gap), (t, step, outer_step, loss, val_loss)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
