"""A peer that pushes data past a stream's receive window, against a real `starling run` daemon (issue 26 item 2).

The attack the issue measured (+3 GB of RSS for 3 GB sent, never freed): the attacker opens a
``/starling/state`` stream, says hello from another swarm, the victim answers ``swarm_mismatch`` and
closes its side (it will never read that stream again), and the attacker then writes raw Yamux DATA frames
on it, ignoring flow control. tests/test_p2p_limits.py proves the bound on an in-process host with 8 MiB;
this runs it against the real daemon (its own process, its real handlers, its real muxer), so that the
victim's resident memory is what is measured.

The victim closes a connection on the first frame past a window (p2p/limits.py, ``BoundedYamux``), so one
connection takes at most a window plus what the kernel buffers. The attacker therefore comes back with the
same identity on a new connection and starts again, until ``total`` bytes were offered or ``attempts`` ran
out; what it managed to write is counted (each write taken by the connection before it failed), and so is
how often the victim closed the connection on it.

`python bench/adversary.py --scenario window-flood --write-docs` records the figures in docs/reliability.md.
"""

from __future__ import annotations

import math
import struct
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.stream_muxer.yamux.yamux import (
    HEADER_SIZE,
    MAX_MESSAGE_SIZE,
    TYPE_DATA,
    YAMUX_HEADER_FORMAT,
)

from p2p.host import build_host
from p2p.wire import LibP2PByteStream
from protocols import state
from starling_testing.daemon import DaemonGroup

MIB = 1 << 20
GIB = 1 << 30
#: The acceptance bound (issue 26): 1 GiB pushed past a window grows the victim by less than this.
GROWTH_BOUND = 64 * MIB
LOOPBACK = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
#: The largest DATA payload py-libp2p's writer sends (one Noise message).
FRAME = MAX_MESSAGE_SIZE - HEADER_SIZE
#: One frame's write: a victim that stopped reading (without closing) stalls it; that ends the attempt.
WRITE_DEADLINE_S = 5.0
#: Connect, open the stream, hello and the victim's refusal; and, after the last write, the close.
ATTEMPT_DEADLINE_S = 15.0
#: The whole flood, however many attempts are left (the bench must end in about two minutes).
FLOOD_DEADLINE_S = 90.0
#: How often the victim's RSS is sampled during the flood (its peak is reported).
SAMPLE_S = 0.1
#: Before the "before" reading: the daemon's start-up allocations have settled.
SETTLE_S = 3.0

DOCS = Path(__file__).resolve().parent.parent / "docs" / "reliability.md"
PARAGRAPH = "**Stream receive windows.**"
#: Where the bench's sentence starts in that paragraph; it runs to the paragraph's end.
MARKER = "Measured against a real daemon"
COMMAND = "python bench/adversary.py --scenario window-flood --write-docs"


class _NoRecords:
    """The attacker's replica: it holds nothing (the session is refused before records move)."""

    def digest(self) -> Mapping[str, tuple[int, ...]]:
        return {}

    def missing_for(self, their_digest: Mapping[str, tuple[int, ...]]) -> list[bytes]:
        return []

    def apply(self, records: Any) -> Any:
        raise AssertionError("a refused session moves no records")


@dataclass
class FloodResult:
    """What the attacker did and what became of it; the victim's side is added by :func:`run_flood`."""

    offered: int = 0  # bytes of DATA after the refusal, written by the attacker before each connection failed
    past_window: int = 0  # of those, bytes beyond the window the victim had granted on that stream
    granted_max: int = 0  # the largest window the victim granted on a refused stream (it grows as it reads)
    attempts: int = 0  # connections that got a refused stream and were flooded
    closed_by_victim: int = 0  # of those, connections the victim closed
    refusals: dict[str, int] = field(default_factory=dict)  # the victim's answer to each hello, by code
    stalled: int = 0  # writes that hung (a victim that stopped reading but kept the connection)
    error: str = ""  # why the flood ended early (a connection or refusal that did not come in time)
    seconds: float = 0.0
    rss_before: int = 0
    rss_peak: int = 0
    rss_after: int = 0
    muxer: dict[str, int] = field(default_factory=dict)  # the victim's `status --json` muxer section

    @property
    def growth(self) -> int:
        return self.rss_after - self.rss_before

    @property
    def peak_growth(self) -> int:
        return self.rss_peak - self.rss_before

    @property
    def held(self) -> bool:
        """The acceptance: the peak stayed under the bound and every flooded connection was closed."""
        return self.peak_growth < GROWTH_BOUND and self.closed_by_victim == self.attempts > 0


def rss_of(pid: int) -> int:
    """Resident memory of a process in bytes (VmRSS of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def _until_gone(host: IHost, peer: ID, deadline_s: float) -> bool:
    """Wait (at most ``deadline_s``) until ``host``'s swarm holds no closed connection to ``peer`` (while it
    does, connect() returns at once and new_stream may pick it); whether it came. An open one may stay: the
    victim dials peers it learns of, the attacker included, and that connection serves as well."""
    with trio.move_on_after(deadline_s):
        while any(c.muxed_conn.is_closed for c in host.get_network().get_connections(peer)):
            await trio.sleep(0.02)
        return True
    return False


async def _refused_stream(host: IHost, info: Any, result: FloodResult) -> tuple[Any, int, int]:
    """A new connection to the victim and a state stream it refused and closed its side of: the muxed
    connection, the stream's id (the victim reads that stream no more) and the window the victim granted
    on it (py-libp2p grows a window as its reader reads, here the hello, so it may be more than 256 KiB;
    its WINDOW_UPDATEs came before the refusal, so they are counted by now)."""
    await host.connect(info)
    stream = await host.new_stream(info.peer_id, [state.PROTOCOL_ID])
    local = state.LocalInfo(version="attacker", swarm="not-the-victims-swarm", manifest_hash="")
    try:
        await state.initiate(LibP2PByteStream(stream), _NoRecords(), local, introduce=True)
        code = "accepted"
    except state.SyncRefused as e:
        code = e.code
    result.refusals[code] = result.refusals.get(code, 0) + 1
    granted = int(stream.muxed_stream.send_window)
    result.granted_max = max(result.granted_max, granted)
    return stream.muxed_conn, stream.muxed_stream.stream_id, granted


async def _push(muxed: Any, stream_id: int, budget: int, result: FloodResult) -> None:
    """Write DATA frames on ``stream_id`` by hand, ignoring the send window, until ``budget`` bytes went out
    or the connection failed; every frame the connection took is counted in ``result.offered``."""
    full = struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_DATA, 0, stream_id, FRAME) + bytes(FRAME)
    sent = 0
    while sent < budget and not muxed.is_closed:
        n = min(FRAME, budget - sent)
        frame = full if n == FRAME else struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_DATA, 0, stream_id, n) + bytes(n)
        try:
            with trio.fail_after(WRITE_DEADLINE_S):
                await muxed._write_frame(frame)
        except trio.TooSlowError:
            result.stalled += 1
            return
        except Exception:  # the victim closed the connection
            return
        sent += n
        result.offered += n


async def flood(addr: str, total: int, attempts: int) -> FloodResult:
    """Push ``total`` bytes past a refused stream's window, one connection after another (at most
    ``attempts``), from one identity; the attacker's side of the figures."""
    result = FloodResult()
    info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
    host = build_host(create_new_key_pair())
    began = time.monotonic()
    async with host.run([LOOPBACK]):
        with trio.move_on_after(FLOOD_DEADLINE_S):
            while result.offered < total and result.attempts < attempts:
                try:
                    with trio.fail_after(ATTEMPT_DEADLINE_S):
                        # The previous connection must be gone first, or connect() would return it.
                        await _until_gone(host, info.peer_id, ATTEMPT_DEADLINE_S)
                        muxed, stream_id, granted = await _refused_stream(host, info, result)
                except Exception as e:  # TooSlowError, or the victim refused the connection itself
                    result.error = f"attempt {result.attempts + 1}: {type(e).__name__} {e}"[:200]
                    break
                result.attempts += 1
                # Past the window every time, the last connection too (its bytes must not all fit in it).
                before = result.offered
                await _push(muxed, stream_id, max(total - result.offered, granted + FRAME), result)
                result.past_window += max(0, result.offered - before - granted)
                if result.stalled:
                    break  # the victim keeps the connection but reads no more: nothing left to measure
                with trio.move_on_after(ATTEMPT_DEADLINE_S):
                    await muxed.event_closed.wait()
                result.closed_by_victim += muxed.is_closed
                if not muxed.is_closed:
                    break
    result.seconds = time.monotonic() - began
    return result


async def _sample_peak(pid: int, result: FloodResult) -> None:
    """Track the victim's largest RSS until cancelled."""
    while True:
        result.rss_peak = max(result.rss_peak, rss_of(pid))
        await trio.sleep(SAMPLE_S)


async def _flood_sampled(pid: int, addr: str, total: int, attempts: int) -> FloodResult:
    async with trio.open_nursery() as nursery:
        peak = FloodResult()
        nursery.start_soon(_sample_peak, pid, peak)
        result = await flood(addr, total, attempts)
        nursery.cancel_scope.cancel()
    result.rss_peak = max(peak.rss_peak, rss_of(pid))
    return result


def run_flood(total: int = GIB, attempts: int = 200) -> FloodResult:
    """Start a network-only victim daemon on 127.0.0.1, flood it, and read its memory and status."""
    with tempfile.TemporaryDirectory() as tmp:
        group = DaemonGroup(Path(tmp))
        try:
            victim = group.start("victim", "--no-train", "--listen", "/ip4/127.0.0.1/tcp/0", "--swarm", "victim")
            addr = victim.addr(timeout=60)
            assert victim.pid is not None
            time.sleep(SETTLE_S)
            before = rss_of(victim.pid)
            result = trio.run(_flood_sampled, victim.pid, addr, total, attempts)
            time.sleep(SETTLE_S)  # what the victim keeps, once it has dealt with the last connection
            result.rss_before, result.rss_peak = before, max(result.rss_peak, before)
            result.rss_after = rss_of(victim.pid)
            st = victim.wait_status(timeout=10)
            result.muxer = dict(st.get("muxer") or {})
        finally:
            group.close()
    return result


def _mib(n: int) -> str:
    return f"{n / MIB:,.1f} MiB"


def report(r: FloodResult) -> str:
    rate = r.offered / MIB / r.seconds if r.seconds > 0 else math.nan
    answers = ", ".join(f"{k} {v}" for k, v in sorted(r.refusals.items()))
    return (
        f"{_mib(r.offered)} written on refused streams in {r.attempts} connections from one identity "
        f"({r.seconds:.1f} s, {rate:,.0f} MiB/s; answers: {answers}), {_mib(r.past_window)} of it past the "
        f"window granted (at most {_mib(r.granted_max)}); the victim closed {r.closed_by_victim} of "
        f"{r.attempts} connections{f', {r.stalled} writes stalled' if r.stalled else ''}; "
        f"victim RSS {_mib(r.rss_before)} before, {_mib(r.rss_peak)} at its peak (+{_mib(r.peak_growth)}), "
        f"{_mib(r.rss_after)} after (+{_mib(r.growth)}); its muxer counters: "
        f"{r.muxer.get('window_overruns', 0)} window overruns, {_mib(r.muxer.get('dropped_bytes', 0))} dropped, "
        f"{r.muxer.get('offenders', 0)} offender(s)" + (f"; ended early: {r.error}" if r.error else "")
    )


def docs_sentence(r: FloodResult) -> str:
    """The bench's sentences of the "Stream receive windows" paragraph."""
    return (
        f"{MARKER} (`{COMMAND}`, {r.seconds:.0f} s of flood): a network-only daemon refused a state hello "
        f"from another swarm and closed its side, and the attacker wrote {_mib(r.offered)} of raw DATA frames "
        f"on that stream, ignoring flow control, coming back with the same identity after each close "
        f"({r.attempts} connections). The victim closed {r.closed_by_victim} of the {r.attempts} connections "
        f"on the first frame past the window ({r.muxer.get('window_overruns', 0)} `window_overruns`, "
        f"{_mib(r.muxer.get('dropped_bytes', 0))} `dropped_bytes`); its RSS went from {_mib(r.rss_before)} to "
        f"a peak of {_mib(r.rss_peak)} (+{_mib(r.peak_growth)}) and was {_mib(r.rss_after)} afterwards "
        f"(bound: +{GROWTH_BOUND >> 20} MiB). Each connection buffers at most the window the victim granted "
        f"and the rest sits in the two sockets until the close: py-libp2p's window auto-tuning had grown "
        f"that window to {_mib(r.granted_max)} while the victim read the ~100-byte hello, so only "
        f"{_mib(r.past_window)} of the {_mib(r.offered)} was past a window."
    )


def write_docs(r: FloodResult, path: Path = DOCS) -> None:
    """Replace the bench's sentence (from MARKER to the end of the paragraph) in the paragraph PARAGRAPH,
    or add it at the paragraph's end."""
    doc = path.read_text()
    start = doc.find(PARAGRAPH)
    if start < 0:
        raise SystemExit(f"{path} has no paragraph '{PARAGRAPH}' to update")
    end = doc.find("\n\n", start)
    end = len(doc) if end < 0 else end
    paragraph = doc[start:end]
    cut = paragraph.find(MARKER)
    kept = paragraph[:cut].rstrip() if cut >= 0 else paragraph.rstrip()
    path.write_text(doc[:start] + kept + "\n" + _wrap(docs_sentence(r)) + doc[end:])


def _wrap(text: str, width: int = 110) -> str:
    """The doc's line length (its paragraphs are wrapped at about 110 columns)."""
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return "\n".join([*lines, line])
