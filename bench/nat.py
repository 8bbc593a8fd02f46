"""NAT traversal benchmark: how soon two NATed daemons get a direct path, and how fast they average over it.

Both parts run whole `starling run` daemons in the network lab (starling_testing/netlab.py: one network namespace
per host, nftables NAT routers, tc shaping), so the benchmark needs root. Every daemon knows only the
bootstrap address; everything else comes from the product itself (DHT, swarm state, relays, DCUtR).

1. **Time to a direct path.** On the public segment a bootstrap node and a relay (network-only); A
   (network-only) behind home NAT 1, holding relay slots. For each trial a fresh B (new identity,
   network-only) starts behind home NAT 2, and B's status is polled for: listening, connected to A
   (which can only happen through a relay), and A ``hole-punched``. Times are from B's process start.
2. **Averaging throughput behind NAT.** Trainers A and B, each behind its own home NAT, with a model
   big enough that a round takes seconds; B's link is shaped to ``--rate-mbit`` each way (tc tbf on
   both ends of its veth, so A's traffic to B crosses it too). Once hole-punched they average at every
   outer step (they are each other's only partner); the workers wait for each exchange instead of
   training through it (``train.overlap=false``). Per round, the throughput is the bytes that crossed
   the link each way over the transfer time, ``sync.last_bytes / 2 / sync.last_duration_s`` (the
   exchange is full duplex: half of ``last_bytes`` goes each way, at the same time), against the link
   rate; target >= 0.9. ``last_duration_s`` is the transfer itself, after pairing and the choice of
   the path (side channel or libp2p stream), on two clocks: the limited trainer's own, and the longer
   of the two trainers' (until the last byte reached the partner). Two references in the same lab and
   shaping: raw TCP (Python sockets sending both ways at once, timed the same two ways: the ceiling,
   since headers and the other direction's ACKs share the link), and two public trainers, whose rounds
   use the direct encrypted side channel.

Everything shares this machine's cores, and the libp2p stream path is CPU-bound in Python: other work
on the machine lowers the figures (the load average is printed and recorded).

With `--rtt-ms 100,300` (and `--jitter-ms`, `--loss`), part 1 runs once per round trip between A and B, held by
the lab's delay line on each NAT router's link to the internet; such a run writes "## NAT with latency".

Usage: sudo .venv/bin/python bench/nat.py [--trials 3] [--rate-mbit 100] [--d-model 768] [--layers 2]
                                          [--rounds 5] [--rtt-ms 0] [--jitter-ms 0] [--loss 0] [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from starling_testing import netlab
from starling_testing.daemon import PORT, DaemonError, LabDaemon, path_to, spawn_daemon, start_daemon
from starling_testing.netlab import Host, Lab, LabError, Proc
from starling_testing.report import replace_section

ROOT = Path(__file__).resolve().parent.parent

SWARM = "natbench"
TARGET_RATIO = 0.9


class BenchError(Exception):
    """A part of the benchmark could not run; the message says why (with the daemon's log tail)."""


# ==========================================================================================================
# Daemons in the lab
# ==========================================================================================================


def spawn(host: Host, root: Path, name: str, args: list[str]) -> LabDaemon:
    """Start `starling run` in `host`'s namespace (HOME = root/name) without waiting for it."""
    return spawn_daemon(host, root / name, ["--swarm", SWARM, *args])


def start(host: Host, root: Path, name: str, args: list[str]) -> LabDaemon:
    return start_daemon(host, root / name, ["--swarm", SWARM, *args])


def public_segment(lab: Lab, root: Path) -> tuple[list[str], list[LabDaemon]]:
    """A bootstrap node and a relay, both network-only; returns the --bootstrap flags and the daemons."""
    boot_host, relay_host = lab.public_host("boot"), lab.public_host("relay")
    boot = start(boot_host, root, "boot", ["--no-train"])
    join = ["--bootstrap", f"/ip4/{boot_host.ip}/tcp/{PORT}/p2p/{boot.peer_id}"]
    relay = start(relay_host, root, "relay", ["--no-train", *join])
    return join, [boot, relay]


# ==========================================================================================================
# Part 1: time to a direct path
# ==========================================================================================================


def bench_direct_path(root: Path, trials: int, rtt_ms: float = 0.0, jitter_ms: float = 0.0,
                      loss: float = 0.0) -> dict[str, Any]:
    """Part 1, with `rtt_ms` (+- `jitter_ms`) of round trip and `loss` each way between A and B: the delay
    line (starling_testing/delayline.py) on each NAT router's link to the internet, a quarter of the round
    trip on each of the four lines it crosses; A's and B's round trip to a public node is half of it."""
    shape = f" at {rtt_ms:g} +-{jitter_ms:g} ms RTT, {loss:.1%} loss each way" if rtt_ms or loss else ""
    print(f"\n1. time to a direct path{shape}: B starts behind home NAT 2, A waits behind home NAT 1", flush=True)
    rows: list[dict[str, float]] = []
    root = root / f"direct-{rtt_ms:g}ms"
    with Lab(log_dir=root / "logs-direct") as lab:
        join, _ = public_segment(lab, root)
        nats = [lab.nat("nat1", style="home"), lab.nat("nat2", style="home")]
        if rtt_ms or loss:
            each_way = 1 - (1 - loss) ** 0.5  # two lines per direction between A and B
            for nat in nats:
                lab.limit(nat, None, delay_ms=rtt_ms / 4, jitter_ms=jitter_ms / 4, loss=each_way)
        a_host = lab.private_host("a", nats[0])
        b_host = lab.private_host("b", nats[1])
        a = start(a_host, root, "a", ["--no-train", *join])
        a.wait(lambda s: bool(s["nat"]["relay_addrs"]), 60, "relay slot for A")
        for trial in range(trials):
            b = spawn(b_host, root, f"b{trial}", ["--no-train", *join])
            listening = b.wait(lambda s: bool(s.get("addrs")), 90, "start-up", interval=0.1)
            t_listen = time.monotonic() - b.started
            b.peer_id = listening["peer_id"]
            b.wait(lambda s: path_to(s, a.peer_id) != "none", 120, "connection to A", interval=0.1)
            t_connected = time.monotonic() - b.started
            b.wait(lambda s: path_to(s, a.peer_id) == "hole-punched", 120, "hole-punched path to A", interval=0.1)
            t_direct = time.monotonic() - b.started
            rows.append({"listening_s": t_listen, "connected_s": t_connected, "direct_s": t_direct})
            print(f"   trial {trial + 1}: listening {t_listen:.1f} s, connected to A (relayed) {t_connected:.1f} s,"
                  f" hole-punched {t_direct:.1f} s after B's start", flush=True)
            b.proc.stop(grace=10)
    summary = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    summary["direct_max_s"] = max(r["direct_s"] for r in rows)
    summary["trials"] = len(rows)
    summary.update(rtt_ms=rtt_ms, jitter_ms=jitter_ms, loss=loss)
    print(f"   median: hole-punched {summary['direct_s']:.1f} s after B's start"
          f" (worst {summary['direct_max_s']:.1f} s)", flush=True)
    return summary


# ==========================================================================================================
# Part 2: averaging throughput over a shaped link
# ==========================================================================================================


# Full-duplex raw TCP over the shaped link: both ends send and receive N MiB at once from Python sockets
# (no encryption, no framing), which is the most any averaging round can get out of the link. Each end
# prints, on the clock all namespaces share (CLOCK_MONOTONIC), when it began and when its receiving and its
# sending were done.
RAW_TCP = r"""
import socket, sys, threading, time
mib, peer = int(sys.argv[1]), sys.argv[2]
if peer == "serve":
    srv = socket.create_server(("0.0.0.0", 5001))
    print("listening", flush=True)
    conn, _ = srv.accept()
else:
    conn = socket.create_connection((peer, 5001), timeout=30)
    conn.settimeout(120)
block = bytes(1 << 20)
sent = []
def send():
    for _ in range(mib):
        conn.sendall(block)
    sent.append(time.monotonic())
sender = threading.Thread(target=send)
began = time.monotonic()
sender.start()
buf, got = memoryview(bytearray(1 << 20)), 0
while got < mib << 20:
    n = conn.recv_into(buf)
    if n == 0:
        raise SystemExit("peer closed early")
    got += n
received = time.monotonic()
sender.join()
print("times", began, received, sent[0], flush=True)
"""


def raw_tcp_mbit(server: Host, client: Host, mib: int, trials: int = 3) -> dict[str, float]:
    """Mbit/s each way of full-duplex raw TCP transfers of `mib` MiB between two public hosts (medians).

    Two clocks: ``own``, the client's own view (from its start until it has received everything and its
    last ``sendall`` returned, which is how a daemon times its side of a round), and ``delivered``, until
    both ends have received everything. They differ by what still sits in the kernel's queues when the
    last ``sendall`` returns (about 2 % of a 5 s transfer at 100 Mbit/s)."""
    own, delivered = [], []
    pattern = r"^times (\S+) (\S+) (\S+)"
    for trial in range(trials):
        serving = server.spawn_python(RAW_TCP, str(mib), "serve", log=f"raw-server-{trial}.log")
        serving.wait_for(r"^listening", timeout=30)
        c = client.spawn_python(RAW_TCP, str(mib), str(server.ip), log=f"raw-client-{trial}.log")
        c_began, c_received, c_sent = map(float, c.wait_for(pattern, timeout=180).groups())
        s_began, s_received, _ = map(float, serving.wait_for(pattern, timeout=60).groups())
        serving.wait(timeout=30)
        bits = mib * (1 << 20) * 8 / 1e6
        own.append(bits / (max(c_received, c_sent) - c_began))
        delivered.append(bits / (max(c_received, s_received) - min(c_began, s_began)))
    return {"own": statistics.median(own), "delivered": statistics.median(delivered), "trials": trials}


def trainer_args(d_model: int, layers: int) -> list[str]:
    """A model whose exchange takes seconds at 100 Mbit/s; everything else as small and quick as possible.

    No overlap: the worker waits for each exchange instead of training through it, so the transfer does
    not compete with training for the cores (this measures the link, not the CPU).
    """
    sets = {
        "train.d_model": d_model, "train.n_layers": layers, "train.n_heads": 4, "train.seq_len": 32,
        "train.batch_size": 2, "train.inner_steps": 5, "train.max_lag": 5, "train.warmup": 5,
        "train.data_bytes": 300000, "train.eval_batches": 1, "train.checkpoint_every": 100000,
        "train.threads": 1, "train.overlap": "false",
        "sync.pair_window_s": 5, "sync.join_wait_s": 1, "sync.max_step_gap": 1000, "sync.backoff_s": 1,
    }  # fmt: skip
    return [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]


def cpu_seconds(proc: Proc) -> float:
    """CPU time (user + system) the process itself has used so far: /proc/<pid>/stat fields 14 and 15."""
    fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def time_rounds(limited: LabDaemon, partner: LabDaemon, rounds: int, rate_mbit: float) -> dict[str, Any]:
    """Read `rounds` averaging rounds between the two off both trainers' status, one at a time.

    Two clocks per round: the limited trainer's own ``last_duration_s`` (its transfer ends when it has
    everything and its last send returned), and the round as both see it, the longer of the two sides'
    durations (the partner's ends when the limited side's last bytes reached it). Also the CPU time
    each daemon spent per round (between two round completions, which with overlap off is the exchange
    plus a little idle bookkeeping): close to the transfer time means the transfer was CPU-bound rather
    than link-bound.
    """
    samples: list[dict[str, Any]] = []
    seen = limited.wait(lambda s: "sync" in s, 60, "sync status")["sync"]["rounds"]
    partner_seen = partner.wait(lambda s: "sync" in s, 60, "sync status")["sync"]["rounds"]
    cpu = (cpu_seconds(limited.proc), cpu_seconds(partner.proc))
    deadline = time.monotonic() + 120 + 60 * rounds
    while len(samples) < rounds:
        st = limited.wait(lambda s, seen=seen: s["sync"]["rounds"] > seen, max(1.0, deadline - time.monotonic()),
                          f"averaging round {len(samples) + 1} of {rounds}", interval=0.25)
        pst = partner.wait(lambda s, seen=partner_seen: s["sync"]["rounds"] > seen, 30,
                           f"the partner's side of round {len(samples) + 1}", interval=0.1)
        now = (cpu_seconds(limited.proc), cpu_seconds(partner.proc))
        sync, psync = st["sync"], pst["sync"]
        whole = (sync["rounds"] == seen + 1 and sync["last_partner"] == partner.peer_id
                 and psync["rounds"] == partner_seen + 1 and psync["last_partner"] == limited.peer_id)
        if whole:  # one new round on each side, read whole
            both_s = max(sync["last_duration_s"], psync["last_duration_s"])
            each_way = sync["last_bytes"] / 2 * 8 / 1e6
            samples.append({"bytes": sync["last_bytes"], "seconds": sync["last_duration_s"],
                            "mbit": each_way / both_s, "mbit_own": each_way / sync["last_duration_s"],
                            "path": f"{sync['last_path']} over {path_to(st, partner.peer_id)}",
                            "cpu": max(now[0] - cpu[0], now[1] - cpu[1])})
            print(f"   round {len(samples)}: {sync['last_bytes'] / 2 / 1e6:.1f} MB each way in"
                  f" {sync['last_duration_s']:.2f} s (both sides: {both_s:.2f} s), {samples[-1]['path']}:"
                  f" {samples[-1]['mbit']:.1f} Mbit/s = {samples[-1]['mbit'] / rate_mbit:.2f} x the link"
                  f" ({samples[-1]['mbit_own'] / rate_mbit:.2f} on the limited side's clock);"
                  f" busier daemon used {samples[-1]['cpu']:.1f} CPU s", flush=True)
        seen, partner_seen, cpu = sync["rounds"], psync["rounds"], now
    mbit, mbit_own = statistics.median(s["mbit"] for s in samples), statistics.median(s["mbit_own"] for s in samples)
    print(f"   median {mbit:.1f} Mbit/s each way = {mbit / rate_mbit:.2f} x the link"
          f" ({mbit_own / rate_mbit:.2f} on the limited side's clock)", flush=True)
    return {
        "rounds": len(samples), "mbit": mbit, "ratio": mbit / rate_mbit,
        "mbit_own": mbit_own, "ratio_own": mbit_own / rate_mbit,
        "mb_each_way": statistics.median(s["bytes"] for s in samples) / 2 / 1e6,
        "seconds": statistics.median(s["seconds"] for s in samples),
        "mbit_min": min(s["mbit"] for s in samples), "mbit_max": max(s["mbit"] for s in samples),
        "cpu_s": statistics.median(s["cpu"] for s in samples),
        "paths": sorted({s["path"] for s in samples}),
    }  # fmt: skip


def bench_throughput(root: Path, rate_mbit: float, d_model: int, layers: int, rounds: int) -> dict[str, Any]:
    print(f"\n2. averaging throughput over a link shaped to {rate_mbit:g} Mbit/s each way (d_model {d_model},"
          f" {layers} layer(s))", flush=True)
    out: dict[str, Any] = {"rate_mbit": rate_mbit, "d_model": d_model, "layers": layers}
    with Lab(log_dir=root / "logs-throughput") as lab:
        join, _ = public_segment(lab, root)
        p_host, q_host = lab.public_host("p"), lab.public_host("q")
        a_host = lab.private_host("a", lab.nat("nat1", style="home"))
        b_host = lab.private_host("b", lab.nat("nat2", style="home"))
        for limited in (q_host, b_host):
            lab.limit(limited, rate_mbit=rate_mbit)

        raw = raw_tcp_mbit(p_host, q_host, mib=max(8, int(rate_mbit * 0.125 * 4)))  # ~4 s of traffic each
        out["raw_mbit"], out["raw_mbit_own"], out["raw_trials"] = raw["delivered"], raw["own"], raw["trials"]
        print(f"   ceiling: raw TCP, both ways at once, {out['raw_mbit']:.1f} Mbit/s each way"
              f" = {out['raw_mbit'] / rate_mbit:.2f} x the link ({out['raw_mbit_own'] / rate_mbit:.2f} on the"
              f" limited side's clock; median of {raw['trials']})", flush=True)

        print("   trainers A and B behind home NATs (B's link shaped): waiting for the hole punch", flush=True)
        a = start(a_host, root, "ta", [*join, *trainer_args(d_model, layers)])
        b = start(b_host, root, "tb", [*join, *trainer_args(d_model, layers)])
        b.wait(lambda s: path_to(s, a.peer_id) == "hole-punched", 180, "hole-punched path to A")
        out["nat"] = time_rounds(b, a, rounds, rate_mbit)
        for daemon in (a, b):
            daemon.proc.stop(grace=15)

        print("   for comparison, public trainers P and Q (Q's link shaped): the direct path", flush=True)
        p = start(p_host, root, "tp", [*join, *trainer_args(d_model, layers)])
        q = start(q_host, root, "tq", [*join, *trainer_args(d_model, layers)])
        out["direct"] = time_rounds(q, p, rounds, rate_mbit)
    nat = out["nat"]
    print(f"   behind NAT: {nat['ratio']:.2f} x the link, both sides' clocks, {nat['mbit'] / out['raw_mbit']:.2f} x raw"
          f" TCP; {nat['ratio_own']:.2f} x the link on the limited side's clock (target {TARGET_RATIO}),"
          f" {nat['mbit_own'] / out['raw_mbit_own']:.2f} x raw TCP on the same clock", flush=True)
    return out


# ==========================================================================================================
# Report
# ==========================================================================================================


LATENCY_HEADING = "## NAT with latency"


def write_docs(command: str, load: str, directs: list[dict[str, Any]], tput: dict[str, Any] | None) -> None:
    """"## NAT" for a run without latency, "## NAT with latency" for one with (each keeps its own)."""
    latency = any(d["rtt_ms"] or d["loss"] for d in directs)
    lines = [
        LATENCY_HEADING if latency else "## NAT", "",
        f"`{command}` on {os.cpu_count()} cores ({platform.machine()}), {time.strftime('%Y-%m-%d')}; {load}.",
        "Whole daemons in the network lab (network namespaces, nftables NATs, tc shaping); every daemon is "
        "given only the bootstrap address.", "",
    ]  # fmt: skip
    if directs:
        trials = directs[0]["trials"]
        lines += [
            f"**Time to a direct path** ({trials} trials per row, medians): a fresh network-only B starts "
            "behind home NAT 2; A waits behind home NAT 1 with relay slots. Times from B's process start."
            + (" The round trip between A and B comes from the lab's delay line on each NAT router's link to "
               "the internet (starling_testing/delayline.py; a quarter of it on each of the four lines a round "
               "trip crosses, so A's and B's round trip to the public nodes is half of it)." if latency else ""),
            "",
            "| RTT between A and B | B listening (s) | connected to A via a relay (s) | hole-punched (s) "
            "| worst hole-punched (s) |",
            "|---|---|---|---|---|",
        ]  # fmt: skip
        for d in directs:
            path = (f"{d['rtt_ms']:g} +-{d['jitter_ms']:g} ms" + (f", {d['loss']:.1%} loss each way" if d["loss"] else "")
                    if d["rtt_ms"] or d["loss"] else "none added")
            lines.append(f"| {path} | {d['listening_s']:.1f} | {d['connected_s']:.1f} | {d['direct_s']:.1f} "
                         f"| {d['direct_max_s']:.1f} |")
        lines.append("")
    if tput is not None:
        rate = tput["rate_mbit"]
        lines += [
            f"**Averaging throughput** (medians of {tput['nat']['rounds']} rounds): d_model {tput['d_model']} x "
            f"{tput['layers']} layer(s); one trainer's link shaped to {rate:g} Mbit/s each way (tbf). Throughput = "
            "bytes each way (`sync.last_bytes / 2`: the exchange is full duplex) / transfer time, on two clocks: "
            "*both sides*, the longer of the two daemons' `sync.last_duration_s` for the round (until the last "
            "byte reached the partner), and *limited side*, that trainer's own `last_duration_s` (until it has "
            "everything and its last send returned; bytes may still sit in its kernel's queue, about 2 % of a "
            f"round). Raw TCP: Python sockets sending both ways at once over the same shaping, median of "
            f"{tput['raw_trials']} transfers timed the same two ways: the ceiling (headers and the other "
            "direction's ACKs share the link). Daemon CPU s per round: the busier daemon's CPU time from one "
            "round's end to the next (the exchange, with overlap off); near the transfer time means the round "
            "was CPU-bound, not link-bound.", "",
            "| pair | path | MB each way | transfer (s) | daemon CPU s per round | Mbit/s each way, both sides "
            "(range) | x link, both sides | x link, limited side (target >= 0.9) | x raw TCP (same clock) |",
            "|---|---|---|---|---|---|---|---|---|",
            f"| raw TCP | - | - | - | - | {tput['raw_mbit']:.1f} | {tput['raw_mbit'] / rate:.2f} "
            f"| {tput['raw_mbit_own'] / rate:.2f} | 1.00 |",
        ]  # fmt: skip
        for label, key in (("A, B behind home NATs", "nat"), ("P, Q public", "direct")):
            r = tput[key]
            lines.append(
                f"| {label} | {', '.join(r['paths'])} | {r['mb_each_way']:.1f} | {r['seconds']:.2f} "
                f"| {r['cpu_s']:.1f} | {r['mbit']:.1f} ({r['mbit_min']:.0f}-{r['mbit_max']:.0f}) | {r['ratio']:.2f} "
                f"| {r['ratio_own']:.2f} | {r['mbit'] / tput['raw_mbit']:.2f} ({r['mbit_own'] / tput['raw_mbit_own']:.2f}) |"
            )
        nat, direct_path = tput["nat"], tput["direct"]
        lines += [
            "",
            f"Behind NAT the rounds reach {nat['ratio_own']:.2f} x the link on the limited trainer's own clock "
            f"({'meeting' if nat['ratio_own'] >= TARGET_RATIO else 'short of'} the {TARGET_RATIO} target) and "
            f"{nat['ratio']:.2f} x until both sides have everything, against raw TCP's "
            f"{tput['raw_mbit_own'] / rate:.2f} and {tput['raw_mbit'] / rate:.2f} timed the same ways "
            f"({nat['mbit_own'] / tput['raw_mbit_own']:.2f} and {nat['mbit'] / tput['raw_mbit']:.2f} x raw TCP). "
            "What keeps even raw TCP below the link rate is the full duplex itself: the ACKs for each "
            "direction queue behind the other direction's data in the tbf queue (sending alone, one direction "
            "gets about 0.96 x the link). The side channel's bulk transfer lifts trio's 16 KiB "
            "`TCP_NOTSENT_LOWAT` for its length (`p2p/datapath.py`): with it, the sending thread had to refill "
            "the socket every few milliseconds, and rounds here reached 0.88 x the link. The NATed pair's rounds went "
            f"{' / '.join(nat['paths'])}: the side channel's listener is behind the responder's NAT, so the two "
            "punch a side channel of their own (a TCP simultaneous open over fresh ports, p2p/punch.py), and "
            "fall back to the libp2p stream only where that fails. Per round it took "
            f"{nat['cpu_s'] / max(direct_path['cpu_s'], 1e-9):.1f} x the public pair's CPU and reached "
            f"{nat['mbit'] / max(direct_path['mbit'], 1e-9):.2f} x its throughput.",
            "",
        ]
    replace_section(ROOT / "docs" / "benchmarks.md", lines[0], "\n".join(lines))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=["1", "2"], default=["1", "2"])
    p.add_argument("--trials", type=int, default=3, help="part 1: fresh B daemons to time (default 3)")
    p.add_argument("--rate-mbit", type=float, default=100.0, help="part 2: B's link rate each way (default 100)")
    p.add_argument("--d-model", type=int, default=768, help="part 2: model width (default 768)")
    p.add_argument("--layers", type=int, default=2, help="part 2: transformer blocks (default 2)")
    p.add_argument("--rounds", type=int, default=5, help="part 2: timed rounds (default 5)")
    p.add_argument("--rtt-ms", default="0", help="part 1: round trips between A and B to run, comma-separated "
                   "ms (e.g. 100,300; default 0: none added)")
    p.add_argument("--jitter-ms", type=float, default=0.0,
                   help="part 1: +- ms of jitter on each round trip (default 0; at most the smallest --rtt-ms)")
    p.add_argument("--loss", type=float, default=0.0, help="part 1: packet loss each way between A and B "
                   "(0.01 = 1%%; default 0)")
    p.add_argument("--write-docs", action="store_true", help="record the results in docs/benchmarks.md")
    args = p.parse_args()
    if args.trials < 1 or args.rounds < 1 or args.rate_mbit <= 0 or args.d_model < 8 or args.layers < 1:
        p.error("--trials/--rounds/--layers >= 1, --rate-mbit > 0, --d-model >= 8")
    try:
        rtts = [float(x) for x in args.rtt_ms.split(",") if x.strip()]
    except ValueError:
        p.error("--rtt-ms: comma-separated numbers of ms")
    if not rtts or any(not 0 <= r <= 2000 for r in rtts) or not 0 <= args.jitter_ms <= min(rtts) \
            or not 0 <= args.loss < 0.5:
        p.error("--rtt-ms between 0 and 2000, --jitter-ms between 0 and the smallest of them, --loss in [0, 0.5)")
    if args.d_model % 4:
        p.error("--d-model must be a multiple of 4 (the model has 4 attention heads)")
    reason = netlab.unavailable_reason()
    if reason is not None:
        print(f"bench/nat.py needs the network lab, which is unavailable here: {reason}", file=sys.stderr)
        return 2

    load_before = os.getloadavg()[0]
    print(f"{os.cpu_count()} cores, load average {load_before:.1f} (other work on this machine lowers the figures)",
          flush=True)
    root = Path(tempfile.mkdtemp(prefix="starling-natbench-"))
    directs: list[dict[str, Any]] = []
    tput = None
    try:
        if "1" in args.parts:
            directs = [bench_direct_path(root, args.trials, rtt, args.jitter_ms if rtt else 0.0, args.loss)
                       for rtt in rtts]
        if "2" in args.parts:
            tput = bench_throughput(root, args.rate_mbit, args.d_model, args.layers, args.rounds)
    except (BenchError, DaemonError, LabError) as e:
        print(f"error: {e}\n(logs kept in {root})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    shutil.rmtree(root, ignore_errors=True)
    load = f"1-minute load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    print(load, flush=True)
    if args.write_docs:
        write_docs("python bench/nat.py " + " ".join(sys.argv[1:]), load, directs, tput)
    return 0


if __name__ == "__main__":
    sys.exit(main())
