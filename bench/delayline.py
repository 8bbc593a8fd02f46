"""What the network lab's delay line does to a link, measured (section "The lab's delay line" of docs/benchmarks.md).

The kernel here has no netem, so latency, jitter and loss come from a userspace delay line on NFQUEUE
(starling_testing/delayline.py, set with ``Lab.limit(host, rate, delay_ms=, jitter_ms=, loss=)``). Every
latency figure of the other lab benchmarks rests on it, so this bench checks it against what it is set to:

* round trip: UDP pings from a host whose link has ``delay_ms = RTT / 2`` each way to an unshaped host, for
  RTTs of 10 to 300 ms (and one with jitter): the median and spread against the setting (target: within 2 ms);
* loss: 40,000 datagrams one way through a line set to lose 0.5%, 1% and 5% (target: within 20% of it);
* throughput: one TCP flow through a 20 Mbit/s tbf link, alone and with 50 and 100 ms of RTT added by the line
  (target: within 10% of tbf's), and the line's own CPU over it, per second and per 1,000 packets.

Run as root: ``make bench-delayline`` (about 2 minutes). Prints the table; ``--write-docs`` writes the section.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from starling_testing.delayline import UDP_ECHO  # noqa: E402
from starling_testing.netlab import Host, Lab, bench_exit_code  # noqa: E402
from starling_testing.report import publish  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
SECTION = "## The lab's delay line"


PINGS = r"""
import socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((host, port)); s.settimeout(2)
for i in range(n):
    t = time.monotonic(); s.send(b"%d" % i)
    try:
        while int(s.recv(64)) != i:
            pass
        print(f"{(time.monotonic() - t) * 1000:.3f}")
    except socket.timeout:
        print("lost")
    time.sleep(0.05)
"""

# Counts datagrams until 1.5 s pass without one (after the first), then prints the count.
UDP_COUNT = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
s.bind(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
n = 0
s.recv(64); n = 1
s.settimeout(1.5)
try:
    while True:
        s.recv(64); n += 1
except socket.timeout:
    print("received", n, flush=True)
"""

UDP_SEND = r"""
import socket, sys, time
host, port, n, rate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((host, port))
start = time.monotonic()
for i in range(n):
    s.send(b"x" * 32)
    if i % 100 == 0:
        time.sleep(max(0.0, start + i / rate - time.monotonic()))
"""

TCP_SINK = r"""
import socket, sys, time
srv = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
conn, _ = srv.accept()
n, first = 0, None
while True:
    b = conn.recv(1 << 16)
    if not b:
        break
    if first is None:
        first = time.monotonic()
    n += len(b)
    last = time.monotonic()
print("received", n, "seconds", last - first, flush=True)
"""

TCP_SOURCE = r"""
import socket, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.create_connection((host, port))
buf = b"\0" * (1 << 16)
end = time.monotonic() + seconds
while time.monotonic() < end:
    s.sendall(buf)
s.close()
"""


def rtt_row(lab: Lab, a: Host, b: Host, rtt_ms: float, jitter_ms: float, n: int) -> str:
    lab.limit(a, None, delay_ms=rtt_ms / 2, jitter_ms=jitter_ms / 2)
    out = a.python(PINGS, str(b.ip), "7100", str(n), timeout=n * (0.05 + 2) + 30).stdout.split()
    rtts = [float(x) for x in out if x != "lost"]
    med = statistics.median(rtts)
    q = statistics.quantiles(rtts, n=20)
    jitter = f" +- {jitter_ms:g} ms" if jitter_ms else ""
    return (f"| {rtt_ms:g} ms{jitter} | {med:.2f} | {med - rtt_ms:+.2f} | {min(rtts):.2f} - {max(rtts):.2f} | "
            f"{q[0]:.2f} - {q[-1]:.2f} | {out.count('lost')} of {n} |")  # fmt: skip


def loss_row(lab: Lab, a: Host, b: Host, loss: float, n: int) -> str:
    lab.limit(a, None, delay_ms=1, loss=loss, ingress=False)
    sink = b.spawn_python(UDP_COUNT, "7200")
    sink.wait_for("listening", timeout=10)
    a.python(UDP_SEND, str(b.ip), "7200", str(n), "8000", timeout=n / 8000 + 30)
    got = int(sink.wait_for(r"received (\d+)", timeout=30)[1])
    measured = 1 - got / n
    return f"| {loss:.1%} | {n:,} | {n - got:,} | {measured:.3%} | {measured / loss:.2f} |"


def throughput(lab: Lab, a: Host, b: Host, seconds: float, port: int) -> float:
    sink = b.spawn_python(TCP_SINK, str(port))
    sink.wait_for("listening", timeout=10)
    a.python(TCP_SOURCE, str(b.ip), str(port), str(seconds), timeout=seconds + 60)
    m = sink.wait_for(r"received (\d+) seconds ([\d.]+)", timeout=60)
    return int(m[1]) * 8 / float(m[2]) / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pings", type=int, default=40, help="pings per RTT setting")
    parser.add_argument("--datagrams", type=int, default=40_000, help="datagrams per loss setting")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each TCP flow")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    if (code := bench_exit_code()) is not None:
        return code

    lines = [SECTION, "",
             f"`python bench/delayline.py{' ' + ' '.join(argv or sys.argv[1:]) if (argv or sys.argv[1:]) else ''}` "
             f"(`make bench-delayline`), {time.strftime('%Y-%m-%d')}, on this 2-core machine. The lab's links take "
             "latency, jitter and loss from a userspace delay line on NFQUEUE (starling_testing/delayline.py; the "
             "kernel has no netem). Round trips: UDP pings from a host whose link holds each packet RTT/2 each way "
             "to an unshaped host.", ""]  # fmt: skip
    with Lab() as lab:
        a, b = lab.public_host("a"), lab.public_host("b")
        b.spawn_python(UDP_ECHO, "7100").wait_for("listening", timeout=10)
        lines += ["| RTT set | median ms | off by ms | min - max | 5th - 95th pct | lost |", "|---|---|---|---|---|---|"]
        for rtt, jitter in ((10, 0), (50, 0), (100, 0), (200, 0), (300, 0), (100, 10), (300, 50)):
            lines.append(rtt_row(lab, a, b, rtt, jitter, args.pings))
            print(lines[-1], flush=True)
        lines += ["", f"Loss: {args.datagrams:,} datagrams one way at 8,000 a second, per setting.", "",
                  "| loss set | sent | lost | measured | measured / set |", "|---|---|---|---|---|"]  # fmt: skip
        for loss in (0.005, 0.01, 0.05):
            lines.append(loss_row(lab, a, b, loss, args.datagrams))
            print(lines[-1], flush=True)
        lines += ["", f"Throughput: one TCP flow for {args.seconds:g} s through a 20 Mbit/s tbf link on the sender, "
                  "then the same with the line adding RTT (kernel autotuned buffers, the default congestion "
                  "control); the line's CPU over that flow (two processes: the upload's line in the bridge's namespace, the download's in the host's). Each direction is held where its packets have left the sender's namespace: held in the sender's own (an egress hook), a flow's packets still count against its socket (TCP Small Queues) and the same 20 Mbit/s link carried 1.84 Mbit/s at 50 ms of RTT. With jitter the round trip is the sum of two uniform draws, so its median over 40 pings moves by a few ms from run to run.", "",
                  "| link | Mbit/s | vs tbf alone | line CPU s/s | line CPU per 1,000 packets |",
                  "|---|---|---|---|---|"]  # fmt: skip
        lab.limit(a, 20)
        base = throughput(lab, a, b, args.seconds, 7300)
        lines.append(f"| 20 Mbit/s, no line | {base:.2f} | 1.00 | - | - |")
        for i, rtt in enumerate((50, 100)):
            lab.limit(a, 20, delay_ms=rtt / 2)
            cpu0, t0 = lab.delay_line_cpu_s(a), time.monotonic()
            got = throughput(lab, a, b, args.seconds, 7301 + i)
            cpu, wall = lab.delay_line_cpu_s(a) - cpu0, time.monotonic() - t0
            packets = got * 1e6 / 8 / 1448 * args.seconds * 1.5  # data segments and about one ACK per two
            lines.append(f"| 20 Mbit/s, {rtt} ms RTT | {got:.2f} | {got / base:.2f} | {cpu / wall:.3f} | "
                         f"{cpu / packets * 1000 * 1000:.1f} ms |")  # fmt: skip
            print(lines[-1], flush=True)
    lines.append("")
    publish("\n".join(lines), DOCS, SECTION, write=args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
