"""Tests for the loss plot (node/ops/plot.py): PNG output, one line per member, CLI exit codes."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

import node.ops.plot
from node.config.home import Home
from node.ops.history import LossHistory
from node.ops.plot import (
    DPI,
    FIGSIZE,
    PlotError,
    draw_history,
    plot_history,
    plot_homes,
    plot_main,
    short_ids,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
T0 = 1_700_000_000.0
PEERS = [f"12D3KooWSharedPrefix{i}xyzTail{i:03d}" for i in range(4)]


def history_of(peers: list[str], *, val_every: int = 2, steps: int = 20) -> LossHistory:
    h = LossHistory()
    for m, pid in enumerate(peers):
        for s in range(steps):
            val = 3.0 - 0.05 * s if s % val_every == 0 else None
            h.observe(pid, s * 5, s // 4, 4.0 - 0.1 * s + 0.2 * m, val, T0 + s)
    return h


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the IHDR chunk, which the PNG format puts first."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_is_a_png_with_one_line_per_member(tmp_path: Path) -> None:
    out = tmp_path / "loss.png"
    assert plot_history(history_of(PEERS), out) == len(PEERS)
    width, height = png_size(out)
    assert (width, height) == (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))


def test_figure_has_a_solid_loss_line_and_a_dashed_val_line_per_member_in_one_colour() -> None:
    fig, drawn = draw_history(history_of(PEERS, val_every=5))
    try:
        lines = fig.axes[0].get_lines()
        solid = [ln for ln in lines if ln.get_linestyle() == "-"]
        dashed = [ln for ln in lines if ln.get_linestyle() == "--"]
        assert drawn == len(solid) == len(dashed) == len(PEERS)
        assert [ln.get_color() for ln in solid] == [ln.get_color() for ln in dashed]
        # Every known point is on its line, and no NaN gap breaks a line into invisible dots.
        assert all(len(ln.get_xdata()) == 20 for ln in solid)
        assert all(len(ln.get_xdata()) == 4 for ln in dashed)
        assert all(math.isfinite(y) for ln in lines for y in ln.get_ydata())
        assert len({str(ln.get_color()) for ln in solid}) == len(PEERS)
        legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert legend == [short_ids(PEERS)[p] for p in sorted(PEERS)]
        assert fig.axes[0].get_xlabel() == "step" and "loss" in fig.axes[0].get_ylabel()
    finally:
        plt.close(fig)


def test_member_without_validation_loss_gets_no_dashed_line() -> None:
    h = history_of(PEERS[:1])
    h.observe("no-val", 1, 0, 2.0, None, T0)
    fig, drawn = draw_history(h)
    try:
        assert drawn == 2
        assert sum(ln.get_linestyle() == "--" for ln in fig.axes[0].get_lines()) == 1
    finally:
        plt.close(fig)


def test_short_ids_are_unique_tails_of_the_peer_ids() -> None:
    ids = ["12D3KooWAAAA1234abcd", "12D3KooWBBBB1234abcd", "12D3KooWCCCC9999zzzz", "short"]
    names = short_ids(ids)
    assert len(set(names.values())) == len(ids)
    assert names["short"] == "short"
    assert names["12D3KooWCCCC9999zzzz"] == "…9999zzzz"
    for pid, name in names.items():
        assert pid.endswith(name.lstrip("…"))


def test_large_swarm_legend_lists_a_bounded_number_of_members() -> None:
    peers = [f"peer-{i:04d}" for i in range(30)]
    fig, drawn = draw_history(history_of(peers, steps=3))
    try:
        legend = fig.axes[0].get_legend()
        assert drawn == 30
        assert len(legend.get_texts()) == 20
        assert "20 of 30" in legend.get_title().get_text()
    finally:
        plt.close(fig)


def test_empty_history_raises_plot_error(tmp_path: Path) -> None:
    with pytest.raises(PlotError, match="no loss"):
        plot_history(LossHistory(), tmp_path / "loss.png")
    assert not (tmp_path / "loss.png").exists()


def test_plot_homes_merges_every_readable_home_and_skips_the_rest(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    drawn: list[int] = []
    monkeypatch.setattr(node.ops.plot, "plot_history", lambda h, out: drawn.append(plot_history(h, out)))
    homes = [tmp_path / n for n in ("a", "b", "missing", "corrupt")]
    for home in homes:
        home.mkdir()
    history_of(PEERS[:2]).save(Home(homes[0]).history)
    history_of(PEERS[1:3]).save(Home(homes[1]).history)
    (Home(homes[3]).history).write_bytes(b"\xc1garbage")
    out = tmp_path / "loss.png"

    assert plot_homes(homes, out)
    assert drawn == [3]  # the union of both homes' members
    assert png_size(out)[0] > 0
    assert "corrupt" in capsys.readouterr().err


def test_plot_homes_without_any_history_returns_false_and_says_why(tmp_path: Path, capsys) -> None:
    out = tmp_path / "loss.png"
    assert not plot_homes([tmp_path], out)
    assert not out.exists()
    assert "no loss" in capsys.readouterr().err


def test_plot_main_prints_the_path_and_exits_zero(tmp_path: Path, capsys) -> None:
    history_of(PEERS).save(Home(tmp_path).history)
    out = tmp_path / "plot.png"
    assert plot_main(tmp_path, out) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert png_size(out)[1] > 0


def test_plot_main_without_history_exits_two_with_one_line(tmp_path: Path, capsys) -> None:
    assert plot_main(tmp_path, tmp_path / "plot.png") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no loss history" in err and str(Home(tmp_path).history) in err


def test_plot_main_with_corrupt_history_exits_two_naming_the_file(tmp_path: Path, capsys) -> None:
    (Home(tmp_path).history).write_bytes(b"\x00\x01")
    assert plot_main(tmp_path, tmp_path / "plot.png") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(Home(tmp_path).history) in err


@pytest.mark.parametrize("where", ["missing-dir", "file-as-dir", "out-is-dir"])
def test_plot_main_with_unwritable_output_exits_two(tmp_path: Path, capsys, where: str) -> None:
    history_of(PEERS).save(Home(tmp_path).history)
    blocker = tmp_path / "blocker"
    if where == "missing-dir":
        out = tmp_path / "nope" / "plot.png"
    elif where == "file-as-dir":
        blocker.write_text("")
        out = blocker / "plot.png"
    else:
        blocker.mkdir()
        out = blocker
    assert plot_main(tmp_path, out) == 2
    err = capsys.readouterr().err
    assert err.startswith("starling: error: cannot write") and err.count("\n") == 1
