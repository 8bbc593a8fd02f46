"""The averaging benchmark: one outer-step exchange against raw TCP, all-reduce, hivemind, and training.

Four parts, each printed as a ratio measured in the same run (and, with ``--write-docs``, recorded in the
``## Sync`` section of docs/benchmarks.md):

1. **Throughput.** Two Starling peers, each its own process (one libp2p host + one ``Averager``), exchange
   ``phi`` and ``Delta`` of a 100M-parameter fp32 state over 127.0.0.1, against the same two processes
   moving the same bytes both ways over one raw TCP socket (blocking ``sendall``/``recv_into`` straight
   from and into the tensors' memory: the fastest plain socket Python can do). Modes: fp32 and bf16 over
   the encrypted side channel, and fp32 over the libp2p stream fallback. "exchange" is the whole
   ``Averager.exchange()`` call (pairing handshake, key agreement, transfer, sums); "transfer" is the
   data movement plus the sums only.
2. **Scaling.** N = 2, 4, 8, 16 local peers, all ready at once, each round paired by a fresh random
   perfect matching (the NoLoCo reference pairing: every node averages with exactly one partner, so N/2
   disjoint exchanges run concurrently) against ``torch.distributed`` gloo ``all_reduce`` of the same
   tensors among N processes. All processes share this machine's cores, so wall times grow with N for
   both once N exceeds the cores; the CPU seconds each node spends per round show the per-node cost
   that a real swarm (one machine per node) would see.
3. **hivemind.** hivemind 1.1.12's ``DecentralizedAverager`` averaging the same tensors in groups of 2 on
   127.0.0.1, run by ``bench/hivemind_avg.py`` in a separate venv (created on first use, see
   :func:`ensure_hivemind_venv`), against Starling's exchange of the same tensors.
4. **Training.** Two whole daemons (``python -m node.cli run``) with the default-size model, each pinned
   to its own core (daemon and worker, torch threads = 1): each alone in its own swarm (solo outer
   steps), then the two in one swarm averaging at every outer step, then alone again. The ratio of the
   workers' samples/s is what averaging costs the training on the core it shares with it.

Usage: python bench/sync.py [--quick] [--parts 1 2 3 4] [--sizes 2 4 8 16] [--write-docs]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import random
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch
import trio
from records import RESULTS_DIR, keep_results, tree_id  # bench/records.py, beside this script

from node.bridge.exchange import ExchangeRequest
from node.worker.task import layout_hash
from starling_testing.daemon import DaemonProc
from starling_testing.report import replace_section

ROOT = Path(__file__).resolve().parent.parent

HOST = "127.0.0.1"
MB = 1e6
HIVEMIND_VENV = ROOT / "bench" / ".venv-hivemind"
HIVEMIND_SCRIPT = ROOT / "bench" / "hivemind_avg.py"
HIVEMIND_PINS = ["torch==2.13.0", "hivemind==1.1.12"]  # torch first: the CPU wheel, not GBs of CUDA
# A fork is instant and shares the already imported torch and libp2p: 16 spawned peers would spend a
# minute of this machine's CPU on imports alone. The parent never runs torch kernels or trio before forking.
MP = mp.get_context("fork")


class BenchError(Exception):
    """A part of the benchmark could not run; the message says why."""


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ==========================================================================================================
# A Starling peer in its own process (parts 1-3)
# ==========================================================================================================


def make_request(numel: int, seed: int) -> ExchangeRequest:
    """What the supervisor hands `Averager.exchange` (node/bridge/exchange.py): flat fp32 inputs and the outputs
    the group's sums land in."""
    # Replicas of one model: phis around a common point, as far apart as their Deltas are long (within
    # the averager's bounds, node/averaging/robust.py).
    # numpy float32, as the daemon holds them (views of the worker's shared memory, node/bridge/shm.py).
    phi = np.random.default_rng(0).standard_normal(numel, dtype=np.float32)
    g = np.random.default_rng(seed)
    phi += g.standard_normal(numel, dtype=np.float32) * np.float32(0.01)
    delta = g.standard_normal(numel, dtype=np.float32) * np.float32(0.01)
    # Outputs written once now so their pages exist before any clock starts (the daemon reuses its slots).
    phi_out, delta_out = np.empty(numel, np.float32), np.empty(numel, np.float32)
    phi_out.fill(0.0)
    delta_out.fill(0.0)
    layout = [("w", (numel,))]
    return ExchangeRequest(1, phi, delta, phi_out, delta_out, layout, layout_hash(layout))


class _PeerState:
    """The child's side: a host, the current Averager, and the commands the parent sends."""

    def __init__(self, host: Any, req: ExchangeRequest, nursery: trio.Nursery) -> None:
        self.host = host
        self.req = req
        self.nursery = nursery
        self.partner: str | None = None
        self.mode: tuple[str, bool] | None = None
        self.averager: Any = None
        self._scope: trio.CancelScope | None = None
        self._raw_listener: socket.socket | None = None

    def _eligible(self) -> list[str]:
        if self.partner is not None:
            return [self.partner]
        return [str(p) for p in self.host.get_connected_peers()]

    async def handle(self, cmd: str, kw: dict[str, Any]) -> Any:
        if cmd == "addr":
            return {"addr": str(self.host.get_addrs()[0]), "peer_id": str(self.host.get_id())}
        if cmd == "connect":
            import multiaddr
            from libp2p.peer.peerinfo import info_from_p2p_addr

            with trio.fail_after(30):
                await self.host.connect(info_from_p2p_addr(multiaddr.Multiaddr(kw["addr"])))
            return True
        if cmd == "configure":
            await self._configure(kw["wire_dtype"], kw["datapath"])
            return True
        if cmd == "exchange":
            return await self._exchange(kw.get("partner"), kw.get("timeout", 600.0))
        if cmd == "raw_listen":
            s = socket.create_server((HOST, 0))
            self._raw_listener = s
            return s.getsockname()[1]
        if cmd == "raw_transfer":
            return await trio.to_thread.run_sync(self._raw_transfer, kw.get("port"))
        raise BenchError(f"unknown command {cmd!r}")

    async def _configure(self, wire_dtype: str, datapath: bool) -> None:
        """A fresh Averager per mode (the side channel is set up by the constructor)."""
        from node.averaging.averager import Averager
        from node.config.sync import SyncConfig
        from starling_testing.averaging import FakeSwarm

        if self.mode == (wire_dtype, datapath):
            return
        if self._scope is not None:
            self._scope.cancel()
        cfg = SyncConfig(wire_dtype=wire_dtype, datapath=datapath, pair_window_s=60.0, handshake_timeout_s=30.0,
                         assumed_rate_mbps=100.0)
        cfg.validate()
        self.averager = Averager(self.host, cfg, FakeSwarm(self.host, manifest="bench", partners=self._eligible))
        self.mode = (wire_dtype, datapath)
        await self.nursery.start(self._run_averager, self.averager)

    async def _run_averager(self, averager: Any, *, task_status: trio.TaskStatus[None]) -> None:
        with trio.CancelScope() as scope:
            self._scope = scope
            await averager.run(task_status=task_status)

    async def _exchange(self, partner: str | None, timeout: float) -> dict[str, Any]:
        if self.averager is None:
            raise BenchError("exchange before configure")
        self.partner = partner
        cpu0, t0 = time.process_time(), time.perf_counter()
        with trio.fail_after(timeout):
            outcome = await self.averager.exchange(self.req)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        st = self.averager.status()
        if outcome.group_size < 2:
            raise BenchError(f"exchange ended solo: {st['last_error'] or 'no partner within the window'}")
        if not bool(np.isfinite(self.req.phi_out[:1000]).all()):
            raise BenchError("the averaged output is not finite")
        return {"wall_s": wall, "transfer_s": st["last_duration_s"], "path": st["last_path"], "cpu_s": cpu,
                "bytes": st["last_bytes"]}

    def _raw_transfer(self, port: int | None) -> dict[str, float]:
        """Move phi+Delta out and the partner's phi+Delta in at once over one plain TCP socket."""
        from protocols.codec import tensor_bytes

        if port is None:
            assert self._raw_listener is not None
            self._raw_listener.settimeout(30)
            conn, _ = self._raw_listener.accept()
            self._raw_listener.close()
            self._raw_listener = None
        else:
            conn = socket.create_connection((HOST, port), timeout=30)
        conn.settimeout(300)
        errors: list[BaseException] = []

        def send_side() -> None:
            try:
                conn.sendall(tensor_bytes(self.req.phi))
                conn.sendall(tensor_bytes(self.req.delta))
            except BaseException as e:  # reported by the receiving thread below
                errors.append(e)

        with conn:
            cpu0, t0 = time.process_time(), time.perf_counter()
            sender = threading.Thread(target=send_side)
            sender.start()
            for out in (self.req.phi_out, self.req.delta_out):
                view = tensor_bytes(out)
                got = 0
                while got < len(view):
                    n = conn.recv_into(view[got:])
                    if n == 0:
                        raise BenchError("raw partner closed early")
                    got += n
            sender.join()
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        if errors:
            raise BenchError(f"raw send failed: {errors[0]!r}")
        return {"wall_s": wall, "cpu_s": cpu}


def _peer_main(conn: Connection, numel: int, seed: int) -> None:
    torch.set_num_threads(1)
    try:
        trio.run(_peer_loop, conn, numel, seed)
    except KeyboardInterrupt:
        pass


async def _peer_loop(conn: Connection, numel: int, seed: int) -> None:
    import multiaddr
    from libp2p.crypto.ed25519 import create_new_key_pair

    from p2p.host import build_host

    req = make_request(numel, seed)
    host = build_host(create_new_key_pair())
    async with host.run([multiaddr.Multiaddr(f"/ip4/{HOST}/tcp/0")]):
        async with trio.open_nursery() as nursery:
            state = _PeerState(host, req, nursery)
            conn.send(("ok", "ready"))
            while True:
                msg = await trio.to_thread.run_sync(conn.recv)
                if msg is None:
                    break
                cmd, kw = msg
                try:
                    reply = ("ok", await state.handle(cmd, kw))
                except Exception as e:  # the parent reports it and stops the part
                    reply = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}")
                conn.send(reply)
            nursery.cancel_scope.cancel()


class Peer:
    """The parent's handle on one peer process. Every wait has a deadline."""

    def __init__(self, numel: int, seed: int, *, startup_timeout: float = 120.0) -> None:
        self.conn, child = MP.Pipe()
        self.proc = MP.Process(target=_peer_main, args=(child, numel, seed), daemon=True)
        self.proc.start()
        child.close()
        self._startup_timeout = startup_timeout
        self.addr = self.peer_id = ""

    def wait_ready(self) -> None:
        self.recv(self._startup_timeout)
        info = self.call("addr")
        self.addr, self.peer_id = info["addr"], info["peer_id"]

    def send(self, cmd: str, **kw: Any) -> None:
        self.conn.send((cmd, kw))

    def recv(self, timeout: float = 600.0) -> Any:
        if not self.conn.poll(timeout):
            raise BenchError(f"peer {self.proc.pid} did not answer within {timeout:.0f} s")
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise BenchError(f"peer {self.proc.pid} died (exit code {self.proc.exitcode})") from None
        if status != "ok":
            raise BenchError(f"peer {self.proc.pid}: {value}")
        return value

    def call(self, cmd: str, timeout: float = 600.0, **kw: Any) -> Any:
        self.send(cmd, **kw)
        return self.recv(timeout)

    def close(self) -> None:
        with contextlib.suppress(OSError, BrokenPipeError):
            self.conn.send(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


@contextlib.contextmanager
def peer_group(n: int, numel: int) -> Iterator[list[Peer]]:
    peers: list[Peer] = []
    try:
        for i in range(n):
            peers.append(Peer(numel, seed=i))
        for p in peers:
            p.wait_ready()
        yield peers
    finally:
        for p in peers:
            p.close()


def exchange_pairs(peers: list[Peer], pairs: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """Start every node's exchange at once (each restricted to its partner); one result per node."""
    for a, b in pairs:
        peers[a].send("exchange", partner=peers[b].peer_id)
        peers[b].send("exchange", partner=peers[a].peer_id)
    return [peers[i].recv() for pair in pairs for i in pair]


def configure(peers: list[Peer], wire_dtype: str, datapath: bool) -> None:
    for p in peers:
        p.send("configure", wire_dtype=wire_dtype, datapath=datapath)
    for p in peers:
        p.recv(60)


# ==========================================================================================================
# Part 1: exchange throughput against raw TCP
# ==========================================================================================================

MODES: dict[str, tuple[str, bool]] = {  # name -> (wire dtype, side channel)
    "fp32 side channel": ("fp32", True),
    "bf16 side channel": ("bf16", True),
    "fp32 libp2p stream": ("fp32", False),
}


@dataclass
class ThroughputRow:
    """One mode's trials: seconds per round (the slower side's) and CPU seconds per side."""

    mode: str
    numel: int
    exchange_s: list[float]
    transfer_s: list[float]
    cpu_s: list[float]

    @property
    def bytes_per_direction(self) -> int:
        """fp32 bytes of phi + Delta that each side sends (and gets); bf16 puts half of them on the wire."""
        return 2 * self.numel * 4

    def mbps(self, which: str, best: bool = False) -> float:
        """MB/s per direction, from the median (or the fastest) trial."""
        times = self.exchange_s if which == "exchange" else self.transfer_s
        return self.bytes_per_direction / (min(times) if best else median(times)) / MB

    @property
    def cpu_per_gb(self) -> float:
        return median(self.cpu_s) / (self.bytes_per_direction / 1e9)

    def paired_ratio(self, raw: ThroughputRow, which: str) -> float | None:
        """Median over trials of (raw trial's seconds / this mode's seconds in the same interleaved round).

        Why paired: this machine's speed drifts over seconds (other tenants, other sessions), and a round's
        raw trial runs just before its exchanges, under nearly the same conditions; the median of those
        per-round ratios cancels drift that the ratio of two separate medians keeps. None when the two rows
        were not measured side by side (different sizes or trial counts)."""
        times = self.exchange_s if which == "exchange" else self.transfer_s
        if self.numel != raw.numel or len(times) != len(raw.exchange_s) or not times:
            return None
        return median([r / t for r, t in zip(raw.exchange_s, times, strict=True)])

    def vs_raw(self, raw: ThroughputRow, which: str) -> tuple[float, float, float | None]:
        """This mode against raw TCP: (ratio of the medians, of the best trials, paired ratio or None)."""
        return (self.mbps(which) / raw.mbps(which), self.mbps(which, True) / raw.mbps(which, True),
                self.paired_ratio(raw, which))


def bench_throughput(numel: int, repeat: int, stream_numel: int) -> tuple[ThroughputRow, list[ThroughputRow]]:
    """Interleaved trials (raw, then each mode), `repeat` times. Returns raw and the modes."""
    print(f"\n[1] exchange throughput: 2 processes on {HOST}, phi + Delta of {numel / 1e6:.0f}M fp32 params each "
          f"({2 * numel * 4 / MB:.0f} MB per direction), median (best) of {repeat}", flush=True)
    raw = ThroughputRow("raw TCP", numel, [], [], [])
    rows = {m: ThroughputRow(m, stream_numel if not datapath else numel, [], [], [])
            for m, (_, datapath) in MODES.items()}

    def record(row: ThroughputRow, rnd: dict[str, Any]) -> None:
        row.exchange_s.append(rnd["wall_s"])
        row.transfer_s.append(rnd["transfer_s"])
        row.cpu_s.append(rnd["cpu_s"])

    with peer_group(2, numel) as peers:
        a, b = peers
        a.call("connect", addr=b.addr)
        for _ in range(repeat):
            port = a.call("raw_listen")
            a.send("raw_transfer")
            b.send("raw_transfer", port=port)
            sides = [a.recv(), b.recv()]
            wall = max(s["wall_s"] for s in sides)
            record(raw, {"wall_s": wall, "transfer_s": wall, "cpu_s": statistics.mean(s["cpu_s"] for s in sides)})
            for mode, (dtype, datapath) in MODES.items():
                if rows[mode].numel != numel:
                    continue  # measured below with its own peers
                configure(peers, dtype, datapath)
                record(rows[mode], _round(exchange_pairs(peers, [(0, 1)])))
    for mode, (dtype, datapath) in MODES.items():
        if rows[mode].numel != numel:
            print(f"    ({mode}: {rows[mode].numel / 1e6:.0f}M params, see --stream-params)", flush=True)
            with peer_group(2, rows[mode].numel) as peers:
                peers[0].call("connect", addr=peers[1].addr)
                configure(peers, dtype, datapath)
                for _ in range(repeat):
                    record(rows[mode], _round(exchange_pairs(peers, [(0, 1)])))

    def cells(r: ThroughputRow, which: str) -> str:
        ratio, best, paired = r.vs_raw(raw, which)
        return (f"{r.mbps(which):>6.0f} ({r.mbps(which, True):>5.0f}) {ratio:>5.2f} ({best:.2f})"
                f" {'-' if paired is None else f'{paired:.2f}':>6}")

    print(f"    {'mode':<20} {'exchange MB/s':>14} {'vs raw':>12} {'paired':>6} {'transfer MB/s':>14} {'vs raw':>12}"
          f" {'paired':>6} {'CPU s/GB':>9}")
    for r in [raw, *rows.values()]:
        print(f"    {r.mode:<20} {cells(r, 'exchange')} {cells(r, 'transfer')} {r.cpu_per_gb:>9.2f}")
    fp32 = rows["fp32 side channel"]
    ratio, best, paired = fp32.vs_raw(raw, "exchange")
    print(f"RATIO throughput fp32 exchange / raw TCP = {paired:.2f} (median of the {repeat} per-round ratios; "
          f"ratio of the medians {ratio:.2f}, of the best trials {best:.2f}; target >= 0.6); "
          f"CPU per byte raw / fp32 exchange = {raw.cpu_per_gb / fp32.cpu_per_gb:.2f} (what the ratio would be "
          "were both CPU-bound; robust to other load)", flush=True)
    return raw, list(rows.values())


def _round(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One pairwise round as the slower side saw it (an exchange is done when both are done)."""
    return {"wall_s": max(r["wall_s"] for r in results), "transfer_s": max(r["transfer_s"] for r in results),
            "cpu_s": statistics.mean(r["cpu_s"] for r in results)}


# ==========================================================================================================
# Part 2: one round as the swarm grows, against gloo all-reduce
# ==========================================================================================================


@dataclass
class RoundStats:
    """Many nodes' times over several rounds, boiled down."""

    node_s: float  # median over nodes and rounds of one node's time
    best_s: float  # the fastest round's median node
    round_s: float  # median over rounds of the slowest node
    cpu_s: float  # mean CPU seconds per node per round

    @classmethod
    def of(cls, rounds: list[list[dict[str, Any]]]) -> RoundStats:
        return cls(
            median([x["wall_s"] for rnd in rounds for x in rnd]),
            min(median([x["wall_s"] for x in rnd]) for rnd in rounds),
            median([max(x["wall_s"] for x in rnd) for rnd in rounds]),
            statistics.mean(x["cpu_s"] for rnd in rounds for x in rnd),
        )


@dataclass
class ScalingRow:
    n: int
    starling: RoundStats
    gloo: RoundStats


def random_matching(n: int, rng: random.Random) -> list[tuple[int, int]]:
    order = list(range(n))
    rng.shuffle(order)
    return [(min(order[i], order[i + 1]), max(order[i], order[i + 1])) for i in range(0, n - 1, 2)]


def starling_rounds(n: int, numel: int, rounds: int, seed: int = 0) -> list[list[dict[str, Any]]]:
    """`rounds` timed rounds (after one warm-up round) of N/2 concurrent exchanges, fp32 over the side
    channel. Before each round every pair is connected, so the clock covers the exchange alone."""
    rng = random.Random(seed)
    out = []
    with peer_group(n, numel) as peers:
        configure(peers, "fp32", True)
        for r in range(rounds + 1):
            pairs = random_matching(n, rng)
            for a, b in pairs:
                peers[a].send("connect", addr=peers[b].addr)
            for a, _ in pairs:
                peers[a].recv(60)
            results = exchange_pairs(peers, pairs)
            if r > 0:
                out.append(results)
    return out


def _gloo_main(conn: Connection, rank: int, world: int, port: int, numel: int, rounds: int) -> None:
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
        req = make_request(numel, rank)
        # gloo wants tensors: zero-copy views of the request's numpy arrays.
        phi, delta, phi_out, delta_out = (torch.from_numpy(a) for a in (req.phi, req.delta, req.phi_out, req.delta_out))
        times = []
        for r in range(rounds + 1):
            dist.barrier()
            cpu0, t0 = time.process_time(), time.perf_counter()
            phi_out.copy_(phi)
            delta_out.copy_(delta)
            dist.all_reduce(phi_out)
            dist.all_reduce(delta_out)  # sums, as Starling leaves them (the outer step divides)
            if r > 0:
                times.append({"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0})
        dist.destroy_process_group()
        conn.send(("ok", times))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


def gloo_rounds(n: int, numel: int, rounds: int) -> list[list[dict[str, Any]]]:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    procs, conns = [], []
    try:
        for rank in range(n):
            parent, child = MP.Pipe()
            p = MP.Process(target=_gloo_main, args=(child, rank, n, port, numel, rounds), daemon=True)
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        per_rank = []
        for rank, c in enumerate(conns):
            if not c.poll(600):
                raise BenchError(f"gloo rank {rank} did not finish within 600 s")
            status, value = c.recv()
            if status != "ok":
                raise BenchError(f"gloo rank {rank}: {value}")
            per_rank.append(value)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return [[per_rank[rank][r] for rank in range(n)] for r in range(rounds)]


def bench_scaling(sizes: list[int], numel: int, rounds: int) -> list[ScalingRow]:
    print(f"\n[2] one round as the swarm grows: phi + Delta of {numel / 1e6:.0f}M fp32 params per node, "
          f"median (best) of {rounds} rounds, {os.cpu_count()} cores shared by all N processes", flush=True)
    print(f"    {'N':>3} {'Starling node s':>15} {'round s':>8} {'CPU s':>6}   {'gloo node s':>15} {'round s':>8} "
          f"{'CPU s':>6} {'gloo/Starling':>13}", flush=True)
    rows = []
    for n in sizes:
        if n < 2 or n % 2:
            raise BenchError(f"swarm sizes must be even and >= 2, got {n}")
        row = ScalingRow(n, RoundStats.of(starling_rounds(n, numel, rounds)),
                         RoundStats.of(gloo_rounds(n, numel, rounds)))
        rows.append(row)
        cols = [f"{x.node_s:>7.2f} ({x.best_s:>5.2f}) {x.round_s:>8.2f} {x.cpu_s:>6.2f}" for x in (row.starling, row.gloo)]
        print(f"    {n:>3} {cols[0]}   {cols[1]} {row.gloo.node_s / row.starling.node_s:>13.2f}", flush=True)
    first = rows[0]
    for row in rows:
        print(f"RATIO scaling N={row.n}: Starling node time / at N={first.n} = "
              f"{row.starling.node_s / first.starling.node_s:.2f} (best {row.starling.best_s / first.starling.best_s:.2f}), "
              f"gloo all-reduce / at N={first.n} = {row.gloo.node_s / first.gloo.node_s:.2f} "
              f"(best {row.gloo.best_s / first.gloo.best_s:.2f}); CPU per node Starling "
              f"{row.starling.cpu_s / first.starling.cpu_s:.2f} vs gloo {row.gloo.cpu_s / first.gloo.cpu_s:.2f}",
              flush=True)
    return rows


# ==========================================================================================================
# Part 3: against hivemind's DecentralizedAverager
# ==========================================================================================================


@dataclass
class HivemindResult:
    numel: int
    starling_exchange_s: list[float] = field(default_factory=list)
    starling_transfer_s: list[float] = field(default_factory=list)
    hivemind_step_s: list[float] = field(default_factory=list)
    hivemind_allreduce_s: list[float] = field(default_factory=list)
    error: str | None = None

    def ratio(self, best: bool = False) -> float:
        """hivemind's step over Starling's exchange: how many times faster Starling is."""
        pick = min if best else median
        return pick(self.hivemind_step_s) / pick(self.starling_exchange_s)


def ensure_hivemind_venv(venv: Path = HIVEMIND_VENV) -> Path:
    """The benchmark venv's python, creating the venv on first use (`python -m venv`, then torch's CPU wheel,
    then hivemind). Raises BenchError with pip's last words when it cannot be installed."""
    python = venv / "bin" / "python"
    if python.exists():
        check = subprocess.run([str(python), "-c", "import hivemind, torch"], capture_output=True, text=True)
        if check.returncode == 0:
            return python
    print(f"    creating {venv} ({' '.join(HIVEMIND_PINS)}; a few minutes, once)", flush=True)
    steps = [[sys.executable, "-m", "venv", str(venv)]]
    steps += [[str(python), "-m", "pip", "install", "-q", pin] for pin in HIVEMIND_PINS]
    for i, cmd in enumerate(steps):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
            raise BenchError(f"`{' '.join(cmd[-2:])}` failed: {tail}")
        if i == 0:  # keep the venv (a GB of wheels) out of git, whatever the repository's .gitignore says
            (venv / ".gitignore").write_text("# created by bench/sync.py\n*\n")
    return python


class HivemindPeers:
    """bench/hivemind_avg.py in the hivemind venv: one averaging round per `step()`, every wait bounded."""

    def __init__(self, python: Path, numel: int) -> None:
        self._stderr = tempfile.TemporaryFile()  # hivemind logs a lot; kept for the error message only
        self.proc = subprocess.Popen([str(python), str(HIVEMIND_SCRIPT), "--numel", str(numel)], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self._read(180)  # {"ready": true}

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("{"):
            self.proc.poll()
            why = f"exited with {self.proc.returncode}" if self.proc.returncode is not None else "no answer"
            self._stderr.seek(0)
            tail = "\n".join(self._stderr.read().decode(errors="replace").strip().splitlines()[-6:])
            raise BenchError(f"bench/hivemind_avg.py: {why} within {timeout:.0f} s: {tail}")
        return json.loads(line)

    def step(self) -> dict[str, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return self._read(300)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._stderr.close()


def bench_hivemind(numel: int, rounds: int) -> HivemindResult:
    """Interleaved rounds (Starling, then hivemind), after one warm-up round of each."""
    print(f"\n[3] against hivemind 1.1.12 DecentralizedAverager: groups of 2 on {HOST}, phi + Delta of "
          f"{numel / 1e6:.0f}M fp32 params, median (best) of {rounds} interleaved rounds", flush=True)
    res = HivemindResult(numel)
    try:
        python = ensure_hivemind_venv()
    except (BenchError, subprocess.TimeoutExpired, OSError) as e:
        res.error = f"cannot install hivemind 1.1.12: {e}"
        print(f"    {res.error}", flush=True)
        return res
    hm: HivemindPeers | None = None
    with peer_group(2, numel) as peers:
        peers[0].call("connect", addr=peers[1].addr)
        configure(peers, "fp32", True)
        try:
            hm = HivemindPeers(python, numel)
            for r in range(rounds + 1):
                ours = _round(exchange_pairs(peers, [(0, 1)]))
                theirs = hm.step()
                if r > 0:
                    res.starling_exchange_s.append(ours["wall_s"])
                    res.starling_transfer_s.append(ours["transfer_s"])
                    res.hivemind_step_s.append(theirs["step_s"])
                    res.hivemind_allreduce_s.append(theirs["allreduce_s"])
        except (BenchError, OSError) as e:
            if not res.starling_exchange_s and hm is None:
                res.error = str(e)
                print(f"    hivemind could not run: {e}", flush=True)
                return res
            raise
        finally:
            if hm is not None:
                hm.close()
    m = {k: (median(v), min(v)) for k, v in (("ex", res.starling_exchange_s), ("tr", res.starling_transfer_s),
                                             ("st", res.hivemind_step_s), ("ar", res.hivemind_allreduce_s))}
    print(f"    Starling exchange() {m['ex'][0]:.2f} s ({m['ex'][1]:.2f}), of which transfer + sums "
          f"{m['tr'][0]:.2f} s; hivemind step() {m['st'][0]:.2f} s ({m['st'][1]:.2f}), of which all-reduce "
          f"{m['ar'][0]:.2f} s")
    print(f"RATIO hivemind step / Starling exchange = {res.ratio():.2f} (best rounds {res.ratio(best=True):.2f}; "
          f"target >= 2); all-reduce / transfer = {m['ar'][0] / m['tr'][0]:.2f}", flush=True)
    return res


# ==========================================================================================================
# Part 4: worker throughput while syncing
# ==========================================================================================================



@dataclass
class TrainingPhase:
    name: str
    averaging: bool
    samples_per_s: list[float]  # per node: from the step counter over the window
    reported_samples_per_s: list[float]  # per node: mean of status' training.samples_per_s polls
    averaged_rounds: int = 0
    solo_rounds: int = 0


@dataclass
class TrainingResult:
    model: str  # in words
    model_args: list[str]
    window_s: float
    cores: list[int | None]
    phases: list[TrainingPhase]  # alone, averaging, alone again (so a drift in the machine's load shows)

    @property
    def alone(self) -> list[TrainingPhase]:
        return [ph for ph in self.phases if not ph.averaging]

    @property
    def syncing(self) -> TrainingPhase:
        return next(ph for ph in self.phases if ph.averaging)

    @property
    def alone_rate(self) -> float:
        """The faster alone phase: a load spike during one of them must not flatter the ratio."""
        return max(statistics.mean(ph.samples_per_s) for ph in self.alone)

    @property
    def ratio(self) -> float:
        return statistics.mean(self.syncing.samples_per_s) / self.alone_rate


class Daemon(DaemonProc):
    """One `starling run` process, optionally pinned to one core (its worker inherits the affinity)."""

    error = BenchError

    def __init__(self, home: Path, args: list[str], core: int | None) -> None:
        home.mkdir(parents=True)
        super().__init__(home, args)
        self.start(append_log=False, core=core)

    def status(self, timeout: float = 10.0) -> dict[str, Any] | None:
        if self.exited():
            raise BenchError(f"daemon in {self.home} exited with {self.returncode()}:\n{self.log()[-2000:]}")
        return super().status(timeout)

    def stop(self, timeout: float = 20.0) -> int | None:
        return super().stop(timeout)


def _training(st: dict[str, Any]) -> dict[str, Any]:
    return st.get("training") or {}


def run_phase(name: str, root: Path, model: list[str], cores: list[int | None], *, averaging: bool,
              window_s: float, batch_size: int, warmup_timeout: float) -> TrainingPhase:
    base = ["--listen", f"/ip4/{HOST}/tcp/0", "--log-level", "warning", *model]
    daemons: list[Daemon] = []
    try:
        if averaging:
            first = Daemon(root / f"{name}-a", [*base, "--swarm", "bench-sync"], cores[0])
            daemons.append(first)
            addr = first.wait(lambda s: bool(s["addrs"]), 60, "listening")["addrs"][0]
            daemons.append(Daemon(root / f"{name}-b", [*base, "--swarm", "bench-sync", "--bootstrap", addr],
                                  cores[1]))
        else:  # each alone in its own swarm: solo outer steps after the shortest pairing window
            solo = [*base, "--set", "sync.pair_window_s=0.1"]
            daemons = [Daemon(root / f"{name}-{x}", [*solo, "--swarm", f"bench-solo-{x}"], core)
                       for x, core in zip("ab", cores, strict=True)]
        # Warm-up: past start-up, data loading and the first outer step (for averaging: a first exchange).
        for d in daemons:
            d.wait(lambda s: _training(s).get("outer_step", 0) >= 1
                   and (not averaging or s["sync"]["rounds"] >= 1), warmup_timeout, "first outer step")
        before = [d.wait(lambda s: True, 30, "status") for d in daemons]
        t0 = time.monotonic()
        polls: list[list[float]] = [[] for _ in daemons]
        while time.monotonic() - t0 < window_s:
            time.sleep(1.0)
            for i, d in enumerate(daemons):
                st = d.status()
                if st is not None:
                    polls[i].append(float(_training(st).get("samples_per_s") or 0.0))
        after = [d.wait(lambda s: True, 30, "status") for d in daemons]
        elapsed = time.monotonic() - t0
    finally:
        for d in daemons:
            d.stop()
    rates = [(_training(a)["step"] - _training(b)["step"]) * batch_size / elapsed for a, b in zip(after, before,
                                                                                                   strict=True)]
    phase = TrainingPhase(name, averaging, rates, [statistics.mean(p) if p else float("nan") for p in polls])
    if averaging:
        phase.averaged_rounds = sum(a["sync"]["rounds"] - b["sync"]["rounds"] for a, b in zip(after, before,
                                                                                               strict=True))
        phase.solo_rounds = sum(a["sync"]["solo_rounds"] - b["sync"]["solo_rounds"]
                                for a, b in zip(after, before, strict=True))
    return phase


def bench_training(model_desc: str, model: list[str], batch_size: int, window_s: float,
                   warmup_timeout: float) -> TrainingResult:
    available = sorted(os.sched_getaffinity(0))
    cores: list[int | None] = available[:2] if len(available) >= 2 else [None, None]
    where = f"pinned to cores {cores[0]} and {cores[1]}" if cores[0] is not None else "unpinned (1 core)"
    print(f"\n[4] worker throughput while syncing: 2 daemons {where}, torch threads = 1, {window_s:.0f} s window",
          flush=True)
    root = Path(tempfile.mkdtemp(prefix="starling-bench-sync-"))
    phases = []
    try:
        for name, averaging in (("alone", False), ("averaging", True), ("alone again", False)):
            ph = run_phase(name.replace(" ", "-"), root, model, cores, averaging=averaging, window_s=window_s,
                           batch_size=batch_size, warmup_timeout=warmup_timeout)
            ph.name = name
            phases.append(ph)
            extra = (f"; {ph.averaged_rounds} averaged and {ph.solo_rounds} solo outer steps (both nodes)"
                     if averaging else "")
            print(f"    {name + ':':<12} samples/s per node {', '.join(f'{x:.1f}' for x in ph.samples_per_s)} "
                  f"(status reports {', '.join(f'{x:.1f}' for x in ph.reported_samples_per_s)}){extra}; "
                  f"load average {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = TrainingResult(model_desc, model, window_s, cores, phases)
    first, again = result.alone
    drift = statistics.mean(again.samples_per_s) / statistics.mean(first.samples_per_s) - 1
    print(f"    the two alone phases differ by {drift:+.1%}: the noise floor of this ratio", flush=True)
    print(f"RATIO training throughput averaging / alone = {result.ratio:.3f} (against the faster alone phase; "
          "target >= 0.95)", flush=True)
    return result


# ==========================================================================================================
# docs/benchmarks.md
# ==========================================================================================================


def write_docs(command: str, elapsed_s: float, load: str, parts: dict[str, Any], args: argparse.Namespace) -> None:
    lines = ["## Sync", "",
             f"`{command}` on {os.cpu_count()} cores ({platform.machine()}, {platform.python_version()}, "
             f"torch {torch.__version__}), {time.strftime('%Y-%m-%d')}, {elapsed_s / 60:.1f} min in all; {load}. "
             "Numbers are medians of interleaved trials in that one run (the best trial in brackets where "
             f"shown); peers are separate processes on {HOST}. With a load average above the core count, "
             "every process waits for a core, so wall times and their ratios are noisy; the CPU-time "
             "columns are the steadier measure.", ""]
    if "1" in parts:
        raw, rows = parts["1"]
        fp32 = rows[0]
        lines += ["### 1. Exchange throughput against raw TCP", "",
                  f"Two peer processes (one libp2p host + one `Averager` each) exchange phi and Delta of "
                  f"{raw.numel / 1e6:.0f}M fp32 parameters ({raw.bytes_per_direction / MB:.0f} MB each way, both "
                  "ways at once). *raw TCP* moves the same bytes between the same processes over one plain "
                  "socket (blocking `sendall`/`recv_into` from and into the tensors). *exchange* is the whole "
                  "`exchange()` call (pairing, key agreement, side-channel connect, transfer, sums); "
                  "*transfer* is the data movement and the sums only. MB/s are fp32-equivalent bytes of "
                  "phi + Delta per direction (bf16 puts half of them on the wire). Interleaved rounds: "
                  f"{len(raw.exchange_s)}, each a raw trial and then one trial of each mode (MB/s: median, "
                  "the best one in brackets). *vs raw*: ratio of the medians (of the best trials); *paired*: "
                  "median of the per-round ratios, each trial against the raw trial of its own round, which "
                  "cancels the drift of this machine's speed between rounds.", "",
                  "| mode | exchange MB/s | vs raw | paired | transfer MB/s | vs raw | paired | CPU s per GB |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in [raw, *rows]:
            size = f" ({r.numel / 1e6:.0f}M params)" if r.numel != raw.numel else ""
            cells = []
            for which in ("exchange", "transfer"):
                ratio, best, paired = r.vs_raw(raw, which)
                cells += [f"{r.mbps(which):.0f} ({r.mbps(which, True):.0f})", f"{ratio:.2f} ({best:.2f})",
                          "-" if paired is None else f"{paired:.2f}"]
            lines.append(f"| {r.mode}{size} | {' | '.join(cells)} | {r.cpu_per_gb:.2f} |")
        ratio, best, paired = fp32.vs_raw(raw, "exchange")
        lines += ["", f"**fp32 exchange / raw TCP = {paired:.2f}** (median of the per-round ratios; {ratio:.2f} "
                  f"between the medians, {best:.2f} between the best trials; "
                  f"target >= 0.6). CPU seconds per byte, raw / fp32 exchange = "
                  f"{raw.cpu_per_gb / fp32.cpu_per_gb:.2f}: the throughput ratio were both CPU-bound, and much "
                  "less sensitive than wall time to other work on the machine.", "",
                  "Where the CPU goes: besides the kernel copies that raw TCP makes too, each peer encrypts what "
                  "it sends and decrypts what it gets (AES-256-GCM, about 0.1 s per GB each way on this machine), "
                  "and checks, measures and adds each received chunk into the sums as it lands. Each direction "
                  "runs in its own thread, so on a machine of its own a peer spreads that work over two cores; here "
                  "both peers share two cores, so the exchange is CPU-bound.", ""]
    if "2" in parts:
        rows2: list[ScalingRow] = parts["2"]
        first = rows2[0]
        lines += ["### 2. One round as the swarm grows, against gloo all-reduce", "",
                  f"N peer processes, phi + Delta of {args.params / 1e6:.0f}M fp32 parameters each, all ready at "
                  "once. Each round pairs them by a fresh random perfect matching (as NoLoCo's reference code "
                  "does), so N/2 exchanges (fp32, side channel) run concurrently; the pairs are connected "
                  "before the clock starts. gloo: `torch.distributed` `all_reduce` of the same two tensors "
                  "among the same N (plus the copy in; both leave the sums, which the outer step divides by N). "
                  "*node s*: median over nodes and rounds of one node's time (in brackets: the fastest "
                  "round's median node); *round s*: median over rounds of the slowest node; CPU: seconds per "
                  f"node per round. Timed rounds: {args.rounds}, after a warm-up round.",
                  "",
                  f"All N processes share {os.cpu_count()} cores, so every wall time here grows about "
                  "linearly once N exceeds the cores: the machine does N/2 exchanges' work in the time a "
                  "real swarm (one machine per node) would do one. The per-node CPU column is the "
                  "machine-independent cost: flat in N for a pairwise exchange, while a ring all-reduce "
                  "moves 2(N-1)/N of the tensor per node and needs 2(N-1) sequential steps.", "",
                  "| N | Starling node s | round s | CPU s/node | gloo node s | round s | CPU s/node | gloo / Starling |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows2:
            cols = [f"{x.node_s:.2f} ({x.best_s:.2f}) | {x.round_s:.2f} | {x.cpu_s:.2f}" for x in (r.starling, r.gloo)]
            lines.append(f"| {r.n} | {cols[0]} | {cols[1]} | {r.gloo.node_s / r.starling.node_s:.2f} |")
        last = rows2[-1]
        lines += ["", f"From N = {first.n} to N = {last.n}: Starling's time per node "
                  f"x{last.starling.node_s / first.starling.node_s:.2f}, gloo's x{last.gloo.node_s / first.gloo.node_s:.2f}; "
                  f"CPU per node x{last.starling.cpu_s / first.starling.cpu_s:.2f} for Starling, "
                  f"x{last.gloo.cpu_s / first.gloo.cpu_s:.2f} for gloo.", ""]
    if "3" in parts:
        h: HivemindResult = parts["3"]
        lines += ["### 3. Against hivemind 1.1.12", "",
                  f"hivemind's `DecentralizedAverager` (target group size 2, no compression, its own p2pd "
                  f"daemons on {HOST}) averaging phi + Delta of {h.numel / 1e6:.0f}M fp32 parameters, run by "
                  "`bench/hivemind_avg.py` in `bench/.venv-hivemind` (created on first use: `python -m venv`, "
                  "`pip install torch==2.13.0 hivemind==1.1.12`). *step* is the whole `step()` call "
                  "(matchmaking through the DHT, then all-reduce); *all-reduce* is its "
                  "`_aggregate_with_group` alone. Starling: two peer processes, fp32 over the side channel.", ""]
        if h.error is not None:
            lines += [f"hivemind could not run here: `{h.error.splitlines()[0][:300]}`.", ""]
        else:
            ex, tr = h.starling_exchange_s, h.starling_transfer_s
            st, ar = h.hivemind_step_s, h.hivemind_allreduce_s
            lines += [f"Interleaved rounds (Starling, hivemind, Starling, ...): {len(ex)} after a warm-up round "
                      "of each (median, the best one in brackets).", "",
                      "| | Starling | hivemind | hivemind / Starling |", "|---|---|---|---|",
                      f"| whole call (exchange / step) | {median(ex):.2f} s ({min(ex):.2f}) | {median(st):.2f} s "
                      f"({min(st):.2f}) | {h.ratio():.2f} ({h.ratio(best=True):.2f}) |",
                      f"| data movement (transfer + sums / all-reduce) | {median(tr):.2f} s | {median(ar):.2f} s | "
                      f"{median(ar) / median(tr):.2f} |",
                      "", f"**Starling is {h.ratio():.2f}x as fast per averaging call** "
                      f"({h.ratio(best=True):.2f}x between the best rounds; target >= 2x).", ""]
    if "4" in parts:
        t: TrainingResult = parts["4"]
        pinned = t.cores[0] is not None
        lines += ["### 4. Worker throughput while syncing", "",
                  f"Two whole daemons (`python -m node.cli run`, {t.model}; options `{' '.join(t.model_args)}`), "
                  + (f"each pinned with its worker to one core ({t.cores[0]} and {t.cores[1]}), "
                     if pinned else "unpinned, ")
                  + "torch threads = 1. *alone*: each in its own swarm, solo outer steps (pairing window "
                  "0.1 s, the shortest, so a solo step costs the worker nothing). *averaging*: the two in one swarm, averaging at "
                  "every outer step (bf16 wire, the default). Pinning gives each node one core in both "
                  "phases, so the difference is what the averaging (encryption, codec, sums, libp2p) takes "
                  "from the worker on the core it shares with its daemon. samples/s from the workers' step "
                  f"counters in `status --json` over a {t.window_s:.0f} s window after the first outer step "
                  "(the mean of the polled `training.samples_per_s` in brackets).", "",
                  "| phase | samples/s node a | node b | outer steps in the window |", "|---|---|---|---|"]
        for ph in t.phases:
            steps = (f"{ph.averaged_rounds} averaged, {ph.solo_rounds} solo (both nodes)" if ph.averaging
                     else "solo")
            lines.append(f"| {ph.name} | {ph.samples_per_s[0]:.1f} ({ph.reported_samples_per_s[0]:.1f}) | "
                         f"{ph.samples_per_s[1]:.1f} ({ph.reported_samples_per_s[1]:.1f}) | {steps} |")
        first, again = t.alone
        lines += ["", f"**averaging / alone = {t.ratio:.3f}** (target >= 0.95), against the faster of the two "
                  "alone phases, which ran before and after the averaging one so that a drift in the machine's "
                  f"load shows: they differ by {statistics.mean(again.samples_per_s) / statistics.mean(first.samples_per_s) - 1:+.0%} "
                  "here.", ""]
    replace_section(ROOT / "docs" / "benchmarks.md", "## Sync", "\n".join(lines).rstrip("\n") + "\n")
    print("\nwrote the ## Sync section of docs/benchmarks.md", flush=True)


# ==========================================================================================================
# main
# ==========================================================================================================

# --quick: a tiny model; H = max_lag = 50 so its ~10 ms steps do not outrun the pairing window.
TINY_MODEL = ["--set", "train.d_model=32", "--set", "train.n_layers=1", "--set", "train.n_heads=2",
              "--set", "train.seq_len=32", "--set", "train.batch_size=4", "--set", "train.inner_steps=50",
              "--set", "train.max_lag=50", "--set", "train.data_bytes=300000", "--set", "train.eval_batches=1"]
# The default model (d_model 256, 4 layers, 4 heads, seq 128, batch 16: ~3.4M parameters) with outer steps
# every 10 inner steps instead of 50, so the window holds several exchanges (and averaging costs the most);
# less text to read at start-up.
DEFAULT_MODEL = ["--set", "train.inner_steps=10", "--set", "train.data_bytes=2000000"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, one trial each: seconds, not minutes")
    p.add_argument("--parts", nargs="+", choices=["1", "2", "3", "4"], default=["1", "2", "3", "4"])
    p.add_argument("--big-params", type=float, default=None, help="part 1 parameters (default 100M; quick 2M)")
    p.add_argument("--stream-params", type=float, default=None,
                   help="part 1 parameters for the libp2p-stream mode (default: --big-params)")
    p.add_argument("--repeat", type=int, default=None, help="part 1 trials per mode (default 7; quick 1)")
    p.add_argument("--params", type=float, default=None, help="parts 2-3 parameters (default 10M; quick 1M)")
    p.add_argument("--sizes", type=int, nargs="+", default=None, help="part 2 swarm sizes (default 2 4 8 16)")
    p.add_argument("--rounds", type=int, default=None, help="parts 2-3 timed rounds (default 5; quick 1)")
    p.add_argument("--window", type=float, default=None,
                   help="part 4 window per phase in seconds (default 60; quick 10)")
    p.add_argument("--write-docs", action="store_true", help="record the results in docs/benchmarks.md")
    p.add_argument("--jsonl", type=Path, default=None, help="append the raw results here (default "
                   "bench/results/sync.jsonl; a --quick run keeps none unless given)")
    args = p.parse_args()
    q = args.quick
    args.big_params = int(args.big_params or (2e6 if q else 100e6))
    args.stream_params = int(args.stream_params or args.big_params)
    args.repeat = args.repeat or (1 if q else 7)
    args.params = int(args.params or (1e6 if q else 10e6))
    args.sizes = args.sizes or ([2] if q else [2, 4, 8, 16])
    args.rounds = args.rounds or (1 if q else 5)
    args.window = args.window or (10.0 if q else 60.0)
    if min(args.big_params, args.stream_params, args.params) < 1000 or args.repeat < 1 or args.rounds < 1:
        p.error("sizes must be >= 1000 parameters and --repeat/--rounds >= 1")
    if any(n < 2 or n % 2 for n in args.sizes):
        p.error("--sizes: even numbers >= 2 (every node needs a partner)")

    began = time.monotonic()
    tree = tree_id()  # read at the start: HEAD may move during a long run
    load_before = os.getloadavg()[0]
    print(f"{os.cpu_count()} cores, load average {load_before:.1f} (other work on this machine skews every number)",
          flush=True)
    results: dict[str, Any] = {}
    loads = [load_before]
    try:
        if "1" in args.parts:
            results["1"] = bench_throughput(args.big_params, args.repeat, args.stream_params)
            loads.append(os.getloadavg()[0])
        if "2" in args.parts:
            results["2"] = bench_scaling(args.sizes, args.params, args.rounds)
            loads.append(os.getloadavg()[0])
        if "3" in args.parts:
            results["3"] = bench_hivemind(args.params, args.rounds)
            loads.append(os.getloadavg()[0])
        if "4" in args.parts:
            if q:
                results["4"] = bench_training("a tiny model", TINY_MODEL, 4, args.window, warmup_timeout=120)
            else:
                desc = "the default model: ~3.4M parameters, d_model 256, 4 layers, batch 16 x 128 bytes"
                results["4"] = bench_training(desc, DEFAULT_MODEL, 16, args.window, warmup_timeout=300)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    elapsed = time.monotonic() - began
    loads.append(os.getloadavg()[0])
    load = (f"1-minute load average {' / '.join(f'{x:.1f}' for x in loads)} at the start and after each part "
            f"(other sessions' work on this machine: {os.cpu_count()} cores)")
    print(f"\ndone in {elapsed / 60:.1f} min; {load}", flush=True)
    keep_results(args.jsonl or (None if q else RESULTS_DIR / "sync.jsonl"), "sync", results,
                 "python bench/sync.py " + " ".join(sys.argv[1:]), tree, parts=args.parts, loads=loads,
                 seconds=round(elapsed, 1), settings={k: getattr(args, k) for k in
                                                      ("big_params", "stream_params", "repeat", "params", "sizes",
                                                       "rounds", "window")})
    if args.write_docs:
        write_docs("python bench/sync.py " + " ".join(sys.argv[1:]), elapsed, load, results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
