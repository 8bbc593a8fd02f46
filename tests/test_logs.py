"""Logs for the journal: sd-daemon priorities under systemd, one entry per record, py-libp2p kept quiet,
no INFO line per averaging round but a periodic summary."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio
from test_averaging import pair, request

from node.config.sync import SyncConfig
from node.ops.logs import SUMMARY_EVERY_S, JournalFormatter, Libp2pFilter, libp2p_dir, log_summary_loop
from starling_testing.averaging import exchange_both, group_sizes
from starling_testing.daemon import STARLING


def stderr_under_journal(argv: list[str], env: dict[str, str], *, matching: bool = True) -> list[str]:
    """Run argv with stderr on a pipe that JOURNAL_STREAM names (as systemd does), return its lines."""
    read_end, write_end = os.pipe()
    st = os.fstat(write_end)
    stream = f"{st.st_dev}:{st.st_ino}" if matching else f"{st.st_dev}:{st.st_ino + 1}"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("STARLING_")}
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=write_end,
                            env={**clean, "JOURNAL_STREAM": stream, **env})
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        out = f.read().decode()
    assert proc.wait(timeout=60) is not None
    return [line for line in out.splitlines() if line]


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_under_systemd_every_stderr_line_carries_its_journal_priority(tmp_path: Path) -> None:
    # A quick start-up failure: an INFO line (new identity), a WARNING (misspelt variable), the CLI's error.
    lines = stderr_under_journal(
        [*STARLING, "run", "--home", str(tmp_path / "h"), "--no-train",
         "--set", f"node.swarm_key_file={tmp_path / 'missing.key'}"],
        {"STARLING_NODE_BOOTSTARP": "x"},
    )

    assert lines and all(line[:3] in ("<2>", "<3>", "<4>", "<6>", "<7>") for line in lines), lines
    assert any(line.startswith("<6>INFO starling.cli: created a new identity") for line in lines), lines
    assert any(line.startswith("<4>WARNING starling.cli: environment variable STARLING_NODE_BOOTSTARP")
               and "STARLING_NODE_BOOTSTRAP" in line for line in lines), lines
    assert any(line.startswith("<3>starling: error: ") and "missing.key" in line for line in lines), lines


def test_a_journal_stream_that_is_not_our_stderr_gets_plain_lines(tmp_path: Path) -> None:
    """A child inherits JOURNAL_STREAM even when its stderr goes elsewhere: no prefixes then."""
    lines = stderr_under_journal(
        [*STARLING, "run", "--home", str(tmp_path / "h"), "--no-train",
         "--set", f"node.swarm_key_file={tmp_path / 'missing.key'}"],
        {}, matching=False,
    )

    assert lines and not any(line.startswith("<") for line in lines), lines


def test_under_systemd_a_traceback_is_one_journal_entry_with_error_priority() -> None:
    code = (
        "import logging\n"
        "from node.ops.logs import setup_logging\n"
        "setup_logging('info')\n"
        "try:\n"
        "    1 / 0\n"
        "except ZeroDivisionError:\n"
        "    logging.getLogger('starling.x').exception('step failed')\n"
        "raise RuntimeError('not caught')\n"
    )
    lines = stderr_under_journal(python(code), {})

    assert len(lines) == 2, lines
    assert lines[0].startswith("<3>ERROR starling.x: step failed\\nTraceback") and "ZeroDivisionError" in lines[0]
    assert lines[1].startswith("<2>CRITICAL starling.crash: uncaught RuntimeError: not caught\\nTraceback")


def test_journal_formatter_escapes_newlines_in_the_message_itself() -> None:
    record = logging.LogRecord("starling.y", logging.WARNING, __file__, 1, "two\nlines", None, None)
    assert JournalFormatter("%(levelname)s %(name)s: %(message)s").format(record) == "<4>WARNING starling.y: two\\nlines"


@pytest.mark.parametrize("level, shown", [("info", False), ("debug", True)])
def test_py_libp2p_warnings_are_shown_only_at_debug_even_when_it_is_imported_late(level: str, shown: bool) -> None:
    # libp2p's import resets its logger (no handler, no propagation): its warnings used to reach Python's
    # last-resort handler at every level. One of its modules logs through the root logger itself.
    code = (
        "import logging, os\n"
        "from node.ops.logs import setup_logging, libp2p_dir\n"
        f"setup_logging({level!r})\n"
        "import libp2p\n"
        "logging.getLogger('libp2p.network.swarm').warning('late import warning')\n"
        "path = os.path.join(libp2p_dir(), 'network', 'connection', 'swarm_connection.py')\n"
        "logging.root.handle(logging.root.makeRecord('root', logging.WARNING, path, 1, 'root call', (), None))\n"
        "logging.getLogger('starling.z').warning('ours')\n"
    )
    r = subprocess.run(python(code), capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"})
    lines = r.stderr.splitlines()

    assert r.returncode == 0, r.stderr
    assert any(line.endswith("WARNING starling.z: ours") for line in lines)
    assert any(line.endswith("WARNING libp2p.network.swarm: late import warning") for line in lines) == shown
    assert any(line.endswith("WARNING libp2p.network.connection.swarm_connection: root call")
               for line in lines) == shown
    assert len(lines) == (3 if shown else 1), lines


def test_libp2p_filter_leaves_other_root_records_alone() -> None:
    filt = Libp2pFilter(logging.CRITICAL, libp2p_dir())
    ours = logging.LogRecord("root", logging.WARNING, __file__, 1, "x", None, None)
    assert filt.filter(ours) and ours.name == "root"


async def test_an_averaging_round_is_logged_at_debug_not_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="starling.averager")
    cfg = SyncConfig(wire_dtype="fp32", pair_window_s=10)
    async with AsyncExitStack() as stack:
        avs, nursery = await pair(stack, cfg, cfg)
        assert group_sizes(await exchange_both(avs, [request(1), request(2)])) == [2, 2]
        nursery.cancel_scope.cancel()
    rounds = [r for r in caplog.records if r.name == "starling.averager" and r.getMessage().startswith("averaged with")]

    assert len(rounds) == 2
    assert {r.levelno for r in rounds} == {logging.DEBUG}


async def test_the_summary_is_logged_at_info_once_per_interval(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="starling.summary")
    calls = iter(["peers 1", "boom", "peers 2 | sync 4 rounds (0 solo, 0 failed)", "peers 3"])

    def summary() -> str:
        text = next(calls)
        if text == "boom":
            raise KeyError(text)
        return text

    with trio.move_on_after(SUMMARY_EVERY_S * 3.5):
        await log_summary_loop(summary)
    logged = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "starling.summary"]

    assert logged == [
        (logging.INFO, "peers 1"),
        (logging.WARNING, "cannot summarize the status: KeyError: 'boom'"),
        (logging.INFO, "peers 2 | sync 4 rounds (0 solo, 0 failed)"),
    ]
