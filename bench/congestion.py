"""One TCP flow over a long, lossy path: the congestion control decides (section "Congestion control over long,
lossy paths" of docs/benchmarks.md).

The averaging side channel (p2p/datapath.py) asks its sockets for BBR (`prefer_congestion`): a loss-based
congestion control halves its window at each loss, so at 1% loss and 300 ms of round trip one flow moves a few
hundred kbit/s, whatever the link. This bench measures it in the network lab: host a behind a tbf-shaped link
with the lab's delay line (starling_testing/delayline.py) holding each packet RTT/2 on each direction of a's
link and losing `loss` of them each way, host b unshaped; one flow a -> b for `--seconds` with the sender's
socket on CUBIC (most hosts' default), then on BBR, alternately, `--repeats` times each; the receiver counts
the bytes from its first to its last. The lab's namespaces otherwise run the machine's default (read and
printed: on this machine it is BBR, so every other lab figure paced as the side channel now asks).

Run as root: ``make bench-congestion`` (about 3 minutes). Prints the table; ``--write-docs`` writes the section.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from delayline import TCP_SINK  # noqa: E402  # bench/delayline.py, beside this script

from starling_testing.netlab import Host, Lab, bench_exit_code  # noqa: E402
from starling_testing.report import publish  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
SECTION = "## Congestion control over long, lossy paths"
ALGORITHMS = ("cubic", "bbr")
TCP_CONGESTION = 13  # Linux's socket option

SOURCE = r"""
import socket, sys, time
host, port, seconds, algorithm = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4].encode()
s = socket.socket()
s.setsockopt(socket.IPPROTO_TCP, 13, algorithm)
used = s.getsockopt(socket.IPPROTO_TCP, 13, 16).rstrip(b"\0").decode()
s.connect((host, port))
buf = b"\0" * (1 << 16)
end = time.monotonic() + seconds
while time.monotonic() < end:
    s.sendall(buf)
s.close()
print("used", used, flush=True)
"""

PATHS = ((100.0, 0.0), (100.0, 0.005), (300.0, 0.01))  # (RTT ms, loss each way)


def flow(a: Host, b: Host, algorithm: str, seconds: float, port: int) -> float:
    """Mbit/s of one flow a -> b whose sender paces with `algorithm` (a sink of its own on `port`)."""
    sink = b.spawn_python(TCP_SINK, str(port))
    sink.wait_for("listening", timeout=10)
    done = a.python(SOURCE, str(b.ip), str(port), str(seconds), algorithm, timeout=seconds + 120)
    used = done.stdout.split()[-1]
    if used != algorithm:
        raise SystemExit(f"the sender's socket runs {used}, not {algorithm}: this kernel does not offer it")
    m = sink.wait_for(r"received (\d+) seconds ([\d.]+)", timeout=120)
    return int(m[1]) * 8 / max(float(m[2]), 1e-9) / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate-mbit", type=float, default=20.0, help="a's link rate each way (20)")
    parser.add_argument("--seconds", type=float, default=12.0, help="length of each flow (12)")
    parser.add_argument("--repeats", type=int, default=2, help="flows per algorithm and path (2)")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    if args.rate_mbit <= 0 or args.seconds <= 0 or args.repeats < 1:
        parser.error("--rate-mbit and --seconds > 0, --repeats >= 1")
    if (code := bench_exit_code()) is not None:
        return code
    default = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    lines = [SECTION, "",
             f"`python bench/congestion.py{' ' + ' '.join(argv or sys.argv[1:]) if (argv or sys.argv[1:]) else ''}` "
             f"(`make bench-congestion`), {time.strftime('%Y-%m-%d %H:%M')}, on this 2-core machine, whose default "
             f"congestion control is {default} (the lab's namespaces run it too). One TCP flow for {args.seconds:g} s "
             f"from a host behind a {args.rate_mbit:g} Mbit/s tbf link with the lab's delay line (RTT/2 and the loss "
             "on each direction of that link) to an unshaped host; the sender's socket set to each congestion "
             f"control in turn, {args.repeats} flows each, alternating; the median of the receiver's bytes over the "
             "time from its first byte to its last. The averaging side channel asks its sockets for BBR "
             "(p2p/datapath.py, `prefer_congestion`); a host that may not choose it keeps its own default.", "",
             "| path | cubic Mbit/s | bbr Mbit/s | bbr / cubic | bbr / link |", "|---|---|---|---|---|"]  # fmt: skip
    print("\n".join(lines[2:]), flush=True)
    with Lab() as lab:
        a, b = lab.public_host("a"), lab.public_host("b")
        port = 7400
        for rtt_ms, loss in PATHS:
            lab.limit(a, args.rate_mbit, delay_ms=rtt_ms / 2, loss=loss, seed=7)
            got: dict[str, list[float]] = {name: [] for name in ALGORITHMS}
            for _ in range(args.repeats):
                for name in ALGORITHMS:
                    port += 1
                    got[name].append(flow(a, b, name, args.seconds, port))
            cubic, bbr = (statistics.median(got[name]) for name in ALGORITHMS)
            lines.append(f"| {rtt_ms:g} ms RTT, {loss:.1%} loss each way | {cubic:.2f} | {bbr:.2f} | "
                         f"{bbr / cubic:.1f} | {bbr / args.rate_mbit:.2f} |")
            print(lines[-1], flush=True)
    lines.append("")
    publish("\n".join(lines), DOCS, SECTION, write=args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
