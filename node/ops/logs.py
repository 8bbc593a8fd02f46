"""Logging to stderr with levels, for the journal; py-libp2p's own chatter is tamed.

py-libp2p logs many recoverable events (a peer closing a DHT stream, a failed dial) at WARNING or ERROR,
through its `libp2p.*` loggers and, in some modules (`libp2p/network/connection/swarm_connection.py`),
through the root logger itself. Its import resets its `libp2p` logger (no handlers, no propagation), so
those records would fall through to Python's last-resort handler. All of them are shown only from
CRITICAL up unless the operator asks for debug output (then from WARNING up).

Under systemd (stderr is the stream named by JOURNAL_STREAM) each line starts with its sd-daemon(3)
priority (`<3>` error, `<4>` warning, `<6>` info, `<7>` debug) so that `journalctl -p warning` and the
journal's colours work, and a record is kept on one line (a traceback's newlines written as `\\n`):
journald makes an entry of every line, so a multi-line record would become many entries, the later
ones without a priority. The journal stamps each entry itself, so the timestamp is left out there.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO

FORMAT = "%(asctime)s.%(msecs)03d %(levelname)-7s %(name)s: %(message)s"
JOURNAL_FORMAT = "%(levelname)s %(name)s: %(message)s"
#: A periodic INFO summary replaces the per-round INFO lines (those are DEBUG): a journal at `info`
#: keeps a heartbeat of progress, 12 lines an hour, instead of one line per outer step.
SUMMARY_EVERY_S = 300.0


def stderr_is_journal(environ: Mapping[str, str] | None = None, stream: IO[str] | None = None) -> bool:
    """Whether `stream` (stderr) is the journal stream systemd connected: JOURNAL_STREAM is "<dev>:<inode>"
    of that stream (systemd.exec(5)). Comparing with the stream itself, not just checking the variable,
    matters because children inherit the variable even when their stderr is redirected to a file."""
    environ = os.environ if environ is None else environ
    dev, sep, ino = environ.get("JOURNAL_STREAM", "").partition(":")
    if not sep:
        return False
    stream = sys.stderr if stream is None else stream
    try:
        st = os.fstat(stream.fileno())
        return (int(dev), int(ino)) == (st.st_dev, st.st_ino)
    except (ValueError, OSError, AttributeError):  # not a number, no file descriptor (a test's capture)
        return False


def syslog_priority(levelno: int) -> int:
    """The sd-daemon(3) / syslog priority of a logging level."""
    if levelno >= logging.CRITICAL:
        return 2
    if levelno >= logging.ERROR:
        return 3
    if levelno >= logging.WARNING:
        return 4
    if levelno >= logging.INFO:
        return 6
    return 7


def journal_prefix(levelno: int) -> str:
    """`<N>` when stderr is the journal, else ''; for lines written to stderr without logging (CLI errors)."""
    return f"<{syslog_priority(levelno)}>" if stderr_is_journal() else ""


class JournalFormatter(logging.Formatter):
    """`<N>` + the record on one line: journald cuts entries at newlines and reads `<N>` per line."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record).replace("\r", "\\r").replace("\n", "\\n")
        return f"<{syslog_priority(record.levelno)}>{text}"


def libp2p_dir() -> str | None:
    """py-libp2p's package directory, found without importing it (the worker never needs libp2p)."""
    try:
        spec = importlib.util.find_spec("libp2p")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return str(Path(locations[0])) + os.sep if locations else None


class Libp2pFilter(logging.Filter):
    """Lets py-libp2p's records through only from `threshold` up, whichever logger they used.

    Records it sends to the root logger are renamed `libp2p.<module>`, so the line says where it came from.
    A handler filter (not a logger level) because py-libp2p's child loggers set their own levels.
    """

    def __init__(self, threshold: int, package_dir: str | None) -> None:
        super().__init__()
        self.threshold = threshold
        self.package_dir = package_dir

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "root" and self.package_dir and record.pathname.startswith(self.package_dir):
            module = record.pathname[len(self.package_dir) :].removesuffix(".py").replace(os.sep, ".")
            record.name = f"libp2p.{module}"
        if record.name == "libp2p" or record.name.startswith("libp2p."):
            return record.levelno >= self.threshold
        return True


def setup_logging(level: str = "info", *, environ: Mapping[str, str] | None = None) -> None:
    """Log to stderr at `level`; journald-formatted when stderr is the journal (see the module docstring)."""
    numeric = getattr(logging, level.upper(), logging.INFO)
    journal = stderr_is_journal(environ)
    handler = logging.StreamHandler(sys.stderr)
    if journal:
        handler.setFormatter(JournalFormatter(JOURNAL_FORMAT))
    else:
        handler.setFormatter(logging.Formatter(FORMAT, datefmt="%Y-%m-%dT%H:%M:%S"))
    lib_threshold = logging.WARNING if numeric <= logging.DEBUG else logging.CRITICAL
    handler.addFilter(Libp2pFilter(lib_threshold, libp2p_dir()))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(numeric)
    starling = logging.getLogger("starling")
    starling.setLevel(numeric)
    lib = logging.getLogger("libp2p")
    for h in list(lib.handlers):
        lib.removeHandler(h)
    lib.propagate = True
    # py-libp2p's import (if it comes after this call) turns its logger's propagation off again; records of
    # a logger with no handler go to the last-resort handler, so that is ours too, with the same filter.
    logging.lastResort = handler
    for noisy in ("multiaddr", "aioquic", "zeroconf", "grpc", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if journal:
        _route_uncaught_to_logging()


def _route_uncaught_to_logging() -> None:
    """Under journald, uncaught exceptions and Python warnings go through logging: one entry each, with a
    priority, instead of one unprioritized entry per traceback line."""
    crash = logging.getLogger("starling.crash")

    def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        crash.critical("uncaught %s: %s", kind.__name__, value, exc_info=(kind, value, tb))

    def thread_excepthook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "?"
        crash.critical("uncaught %s in thread %s: %s", args.exc_type.__name__, name, args.exc_value,
                       exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
    logging.captureWarnings(True)


async def log_summary_loop(summary: Callable[[], str], *, every_s: float = SUMMARY_EVERY_S) -> None:
    """Log `summary()` at INFO every `every_s` seconds until cancelled (see SUMMARY_EVERY_S for why)."""
    import trio

    log = logging.getLogger("starling.summary")
    while True:
        await trio.sleep(every_s)
        try:
            text = summary()
        except Exception as e:  # a bug in a summary line must not stop the daemon
            log.warning("cannot summarize the status: %s: %s", type(e).__name__, e)
            continue
        log.info("%s", text)
