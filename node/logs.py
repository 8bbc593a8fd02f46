"""Logging to stderr with levels, for the journal; py-libp2p's own chatter is tamed.

py-libp2p logs many recoverable events (a peer closing a DHT stream, a failed dial) at WARNING or ERROR
through its `libp2p` logger, which does not propagate and so falls through to Python's last-resort
handler. We give it our handler and a high threshold unless the operator asks for debug output.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def setup_logging(level: str = "info") -> None:
    numeric = getattr(logging, level.upper(), logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%Y-%m-%dT%H:%M:%S"))
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
    # Child loggers (libp2p.network.*) set their own levels, and propagation ignores ancestors' levels,
    # so the threshold is enforced by a filter on a dedicated handler.
    lib_threshold = logging.WARNING if numeric <= logging.DEBUG else logging.CRITICAL
    lib_handler = logging.StreamHandler(sys.stderr)
    lib_handler.setFormatter(handler.formatter)
    lib_handler.addFilter(lambda record: record.levelno >= lib_threshold)
    lib.addHandler(lib_handler)
    lib.propagate = False
    for noisy in ("multiaddr", "aioquic", "zeroconf", "grpc", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
