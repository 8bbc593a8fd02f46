"""Loss curves of a swarm as a PNG: ``starling plot`` and the plot ``make run`` writes at the end.

Input is the :class:`~node.ops.history.LossHistory` a node keeps of every member it heard of (saved as
``HOME/history.msgpack``). The figure has one colour per member: its training loss against its step as a
solid line and, when it reports one, its validation loss as a dashed line of the same colour. The legend
shows short peer ids (the tail of the id: libp2p ids share their first characters).

matplotlib runs with the Agg backend, selected before pyplot is imported, so plotting works on a
headless server and never tries to open a window.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.figure import Figure  # noqa: E402

from node.config.home import Home  # noqa: E402
from node.ops.history import HistoryError, LossHistory  # noqa: E402

#: Figure size in inches and resolution: 1200 x 720 pixels.
FIGSIZE = (10.0, 6.0)
DPI = 120
#: Members named in the legend at most; a larger swarm gets a legend title saying how many are listed.
MAX_LEGEND = 20
SHORT_ID_CHARS = 8

EXIT_OK, EXIT_USAGE = 0, 2


class PlotError(Exception):
    """Nothing to plot, or the plot cannot be written. The message is one line meant for the user."""


def short_ids(peer_ids: Iterable[str], chars: int = SHORT_ID_CHARS) -> dict[str, str]:
    """Map each peer id to its shortest tail of at least ``chars`` characters that is unique among them."""
    ids = sorted(set(peer_ids))
    out: dict[str, str] = {}
    for pid in ids:
        n = chars
        while n < len(pid) and sum(other.endswith(pid[-n:]) for other in ids) > 1:
            n += 1
        out[pid] = pid if n >= len(pid) else "…" + pid[-n:]
    return out


def _finite(values: list[float | None]) -> bool:
    return any(v is not None and math.isfinite(v) for v in values)


def _known_points(steps: list[int], values: list[float | None]) -> tuple[list[int], list[float]]:
    pairs = [(x, y) for x, y in zip(steps, values, strict=True) if y is not None and math.isfinite(y)]
    return [x for x, _ in pairs], [y for _, y in pairs]


def draw_history(history: LossHistory, *, title: str = "") -> tuple[Figure, int]:
    """Build the figure; return it and the number of members drawn. Raises :class:`PlotError` when no
    member has a loss. The caller owns the figure (``plt.close(fig)`` when done)."""
    series = {pid: s for pid, s in history.series().items() if _finite(s["loss"]) or _finite(s["val_loss"])}
    if not series:
        raise PlotError("no loss recorded yet: the history has no member with a training or validation loss")

    names = short_ids(series)
    cmap = plt.get_cmap("tab10" if len(series) <= 10 else "tab20" if len(series) <= 20 else "turbo")
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    for i, (pid, s) in enumerate(series.items()):
        colour = cmap(i % cmap.N) if len(series) <= 20 else cmap(i / max(1, len(series) - 1))
        # Only the known values: a validation loss comes every N steps, and NaN gaps between them would
        # leave nothing but isolated, invisible points. A line of one point gets a marker to be visible.
        for values, style in ((s["loss"], "-"), (s["val_loss"], "--")):
            xs, ys = _known_points(s["step"], values)
            if not xs:
                continue
            ax.plot(
                xs,
                ys,
                color=colour,
                linestyle=style,
                marker="o" if len(xs) == 1 else None,
                label=names[pid] if style == "-" or not _finite(s["loss"]) else "_nolegend_",
            )

    ax.set_xlabel("step")
    ax.set_ylabel("loss (solid: training, dashed: validation)")
    ax.set_title(title or f"Starling loss, {len(series)} member{'s' if len(series) != 1 else ''}")
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    legend_title = None if len(handles) <= MAX_LEGEND else f"{MAX_LEGEND} of {len(handles)} members"
    ax.legend(handles[:MAX_LEGEND], labels[:MAX_LEGEND], title=legend_title, fontsize="small", loc="best")
    fig.tight_layout()
    return fig, len(series)


def plot_history(history: LossHistory, out: Path, *, title: str = "") -> int:
    """Write the loss plot of ``history`` to ``out`` as a PNG; return the number of members drawn.

    Raises :class:`PlotError` when there is nothing to plot or the file cannot be written.
    """
    out = Path(out)
    fig, drawn = draw_history(history, title=title)
    try:
        fig.savefig(out, format="png")
    except OSError as exc:
        raise PlotError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return drawn


def _check_writable_dir(out: Path) -> None:
    """Fail early, with a clear message, when ``out`` cannot be created (before any plotting work)."""
    parent = out.parent
    if not parent.is_dir():
        raise PlotError(f"cannot write {out}: {parent} is not a directory")
    if out.is_dir():
        raise PlotError(f"cannot write {out}: it is a directory")


def plot_homes(homes: Iterable[Path], out: Path) -> bool:
    """Merge the histories in each home's history file (`Home.history`) and plot them to ``out``.

    For ``make run``: each home is a stopped node's HOME. A node's history already holds every member it
    heard of; merging the homes also covers a node that never heard of another. Unreadable histories are
    reported and skipped. Returns False, after printing why, when there is nothing to plot.
    """
    merged = LossHistory()
    for home in homes:
        path = Home(home).history
        try:
            merged.merge(LossHistory.load(path))
        except HistoryError as exc:
            print(f"loss plot: skipping {path}: {exc}", file=sys.stderr)
    try:
        _check_writable_dir(Path(out))
        plot_history(merged, Path(out))
    except PlotError as exc:
        print(f"loss plot: not written: {exc}", file=sys.stderr)
        return False
    return True


def daemon_history(home: Path) -> LossHistory | None:
    """The running daemon's loss history, asked over its control socket (None: no daemon answers).

    Why ask: the file is written only every ~30 s, so right after a start it does not exist yet and later
    it lags; the daemon's own copy is current. A daemon whose answer is unusable (too large for the socket,
    an older daemon) is the same as none: the caller falls back to the file.
    """
    from node.ops.control import ControlError, request_sync

    try:
        answer = request_sync(Home(home).control_socket, {"cmd": "history"}, timeout=10.0)
    except ControlError:
        return None
    if not answer.get("ok") or not isinstance(answer.get("history"), dict):
        return None
    try:
        return LossHistory.from_series(answer["history"])
    except HistoryError as exc:
        print(f"starling: warning: the daemon's loss history is unusable ({exc}); reading the file", file=sys.stderr)
        return None


def plot_main(home: Path, out: Path) -> int:
    """``starling plot --home DIR --out FILE.png``: exit 0 and print the path, or exit 2 with a one-line
    error (no history yet, unreadable history, output not writable). The running daemon's history is
    used when it answers, else the file it saved."""
    out = Path(out)
    path = Home(home).history
    try:
        _check_writable_dir(out)
        history = daemon_history(home)
        if history is not None and len(history) == 0:
            raise PlotError(f"no loss history yet: the daemon on {home} has not heard of a loss from any member")
        if history is None:
            history = LossHistory.load(path)
            if len(history) == 0:
                raise PlotError(f"no loss history in {path} and no daemon running on {home}")
        plot_history(history, out)
    except (PlotError, HistoryError) as exc:
        print(f"starling: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(out)
    return EXIT_OK
