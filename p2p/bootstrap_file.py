"""Bootstrap addresses shared through files (docker-compose, shared volumes, config management).

One node writes its dialable multiaddrs (`write_addr_file`); others read them (`BootstrapFileWatcher`),
waiting with back-off while the file does not exist yet and re-reading it so that a bootstrap node that
moved is found again. A malformed line is skipped with a warning naming the file and line.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import trio

from p2p.addrs import AddrError, parse_bootstrap
from p2p.connmgr import ConnManager

log = logging.getLogger("starling.bootstrap")

REREAD_S = 30.0


def write_addr_file(path: Path, addrs: list[str]) -> None:
    """Atomically write one multiaddr per line (mode 0644: addresses are not secret)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write("".join(a + "\n" for a in addrs))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_bootstrap_file(path: Path) -> list[str]:
    """Valid bootstrap multiaddrs from `path` (blank lines and # comments skipped)."""
    out: list[str] = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            parse_bootstrap(text)
        except AddrError as e:
            log.warning("%s:%d: skipped: %s", path, n, e)
            continue
        out.append(text)
    return out


async def watch_bootstrap_files(paths: list[Path], connmgr: ConnManager) -> None:
    """Feed the addresses in `paths` to the connection manager as bootstrap peers, forever."""
    delays = {p: 0.5 for p in paths}
    next_read = {p: 0.0 for p in paths}
    warned: set[Path] = set()
    while True:
        now = trio.current_time()
        for path in paths:
            if now < next_read[path]:
                continue
            try:
                addrs = read_bootstrap_file(path)
            except FileNotFoundError:
                if path not in warned:
                    log.info("waiting for bootstrap file %s", path)
                    warned.add(path)
                delays[path] = min(delays[path] * 2, REREAD_S)
                next_read[path] = now + delays[path]
                continue
            except OSError as e:
                log.warning("cannot read bootstrap file %s: %s", path, e)
                next_read[path] = now + REREAD_S
                continue
            for text in addrs:
                connmgr.add_candidate(parse_bootstrap(text), source="bootstrap", permanent=True)
            next_read[path] = now + REREAD_S
        await trio.sleep(max(0.1, min(next_read.values()) - trio.current_time()))
