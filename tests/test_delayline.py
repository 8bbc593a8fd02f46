"""The network lab's delay line: latency, jitter and loss on a link (starling_testing/delayline.py).

The scheduling logic is tested without root; the lab tests send real packets through real lines. The lab
tests assert what the line must do (a round trip never faster than its delay, no packet reordered, the
share lost near the setting), with bounds loose enough for a loaded 2-core CI machine; the precise figures
(RTT within 2 ms from 10 to 300 ms, throughput against tbf's, the line's CPU) are `bench/delayline.py`'s.
"""

from __future__ import annotations

import random
import statistics

import pytest

from starling_testing import netlab
from starling_testing.delayline import UDP_ECHO, Direction, LineSpec
from starling_testing.netlab import Host, Lab, LabError

# ---------------------------------------------------------------------------------------------
# The schedule, without a kernel


def direction(delay_ms: float = 0.0, jitter_ms: float = 0.0, loss: float = 0.0, seed: int = 1) -> Direction:
    return Direction(LineSpec(delay_ms, jitter_ms, loss), random.Random(seed))


def test_a_packet_is_held_for_its_delay_and_no_longer() -> None:
    d = direction(delay_ms=50)
    assert d.admit("p", now=10.0)
    assert d.release(10.049) == []
    assert d.next_due() == pytest.approx(10.05)
    assert d.release(10.05) == ["p"]
    assert d.stats()["passed"] == 1


def test_jitter_varies_the_delay_within_its_bounds_but_never_reorders() -> None:
    d = direction(delay_ms=40, jitter_ms=20, seed=7)
    dues = []
    for i in range(2000):
        assert d.admit(i, now=i * 0.001)  # a packet every millisecond: jitter would reorder them freely
        dues.append(d.held[-1][0] - i * 0.001)
    assert [p for p in d.release(float("inf"))] == list(range(2000))  # order kept
    assert min(dues) >= 0.020 - 1e-9 and max(dues) <= 0.060 + 1e-9
    assert max(dues) - min(dues) > 0.020  # the jitter does act (order keeping lifts the low ones)


def test_spaced_packets_see_jitter_centred_on_the_delay() -> None:
    d = direction(delay_ms=100, jitter_ms=30, seed=3)
    delays = []
    for i in range(4000):  # far apart: order keeping never stretches one
        d.admit(i, now=float(i))
        delays.append(d.held[-1][0] - i)
    assert statistics.mean(delays) == pytest.approx(0.100, abs=0.002)
    assert statistics.pstdev(delays) == pytest.approx(0.030 / 3**0.5, rel=0.1)  # uniform on +-30 ms


def test_loss_drops_about_its_share_and_the_rest_pass() -> None:
    d = direction(delay_ms=1, loss=0.1, seed=11)
    admitted = sum(d.admit(i, now=0.0) for i in range(20_000))
    assert d.stats()["dropped"] == 20_000 - admitted
    assert 0.09 < d.stats()["dropped"] / 20_000 < 0.11
    assert len(d.release(1.0)) == admitted


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"delay_ms": -1}, "delay_ms"),
        ({"delay_ms": 20_000}, "delay_ms"),
        ({"delay_ms": 10, "jitter_ms": 11}, "jitter_ms"),
        ({"delay_ms": 10, "loss": 1.0}, "loss"),
        ({"loss": -0.1}, "loss"),
    ],
)
def test_impossible_lines_are_refused_with_the_setting_named(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LineSpec(**kwargs)


def test_the_command_line_form_round_trips() -> None:
    spec = LineSpec(25.5, 5, 0.005)
    assert LineSpec.from_arg(spec.to_arg(1)) == (1, spec)
    with pytest.raises(ValueError, match="QUEUE:DELAY_MS"):
        LineSpec.from_arg("1:25")


# ---------------------------------------------------------------------------------------------
# Real packets through real lines


# Sends numbered datagrams `gap` seconds apart and times each echo; prints the round trips in ms (sorted),
# the count lost, and whether the echoes came back in the order sent.
UDP_PINGS = r"""
import socket, sys, time, threading
host, port, n, gap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((host, port))
s.settimeout(3)
sent, got, order = {}, {}, []
def receive():
    try:
        while len(got) < n:
            i = int(s.recv(64))
            got[i] = time.monotonic()
            order.append(i)
    except socket.timeout:
        pass
t = threading.Thread(target=receive)
t.start()
for i in range(n):
    sent[i] = time.monotonic()
    s.send(b"%d" % i)
    time.sleep(gap)
t.join()
rtts = sorted((got[i] - sent[i]) * 1000 for i in got)
print("rtts", " ".join(f"{r:.2f}" for r in rtts))
print("lost", n - len(got), "ordered", order == sorted(order))
"""


def pings(src: Host, dst: Host, n: int, gap: float) -> tuple[list[float], int, bool]:
    out = src.python(UDP_PINGS, str(dst.ip), "7100", str(n), str(gap), timeout=n * gap + 30).stdout.splitlines()
    assert len(out) == 2, out
    rtts = [float(x) for x in out[0].split()[1:]]
    words = out[1].split()
    return rtts, int(words[1]), words[3] == "True"


@pytest.fixture
def pair(lab: Lab) -> tuple[Host, Host]:
    a, b = lab.public_host("a"), lab.public_host("b")
    b.spawn_python(UDP_ECHO, "7100").wait_for("listening", timeout=10)
    return a, b


@pytest.mark.lab
@pytest.mark.parametrize("delay_ms", [5.0, 75.0])
def test_a_delayed_link_adds_its_delay_each_way_to_the_round_trip(
    lab: Lab, pair: tuple[Host, Host], delay_ms: float
) -> None:
    a, b = pair
    lab.limit(a, None, delay_ms=delay_ms)
    rtts, lost, _ = pings(a, b, 20, 0.02)
    assert lost == 0
    assert min(rtts) >= 2 * delay_ms  # never faster than the line: both directions are held
    assert statistics.median(rtts) < 2 * delay_ms + 10  # and not held much longer (bench: within 2 ms)


@pytest.mark.lab
def test_two_delayed_links_add_up_between_their_hosts(lab: Lab, pair: tuple[Host, Host]) -> None:
    a, b = pair
    lab.limit(a, None, delay_ms=10)
    lab.limit(b, None, delay_ms=15)
    rtts, lost, _ = pings(a, b, 10, 0.02)
    assert lost == 0 and min(rtts) >= 50  # 2 x 10 + 2 x 15


@pytest.mark.lab
def test_jitter_spreads_the_round_trips_but_keeps_packets_in_order(lab: Lab, pair: tuple[Host, Host]) -> None:
    a, b = pair
    lab.limit(a, None, delay_ms=30, jitter_ms=15, seed=5)
    rtts, lost, ordered = pings(a, b, 300, 0.002)  # 2 ms apart, well inside the jitter: free to reorder
    assert lost == 0 and ordered
    assert min(rtts) >= 30  # 2 x (30 - 15)
    assert max(rtts) - min(rtts) > 10


@pytest.mark.lab
def test_a_lossy_link_loses_about_its_share_each_way(lab: Lab, pair: tuple[Host, Host]) -> None:
    a, b = pair
    lab.limit(a, None, delay_ms=1, loss=0.1)
    _, lost, _ = pings(a, b, 2000, 0.001)
    # Each echo crosses the line twice: 1 - 0.9^2 = 19% of round trips lost (380 of 2000; sd ~18).
    assert 0.8 * 380 < lost < 1.2 * 380, lost


@pytest.mark.lab
def test_an_asymmetric_link_has_a_rate_per_direction(lab: Lab) -> None:
    a = lab.public_host("a")
    inet = lab.internet()
    lab.limit(a, 20, up_mbit=5, delay_ms=10)
    up = a.run(["tc", "qdisc", "show", "dev", "eth0"], check=True).stdout
    down = inet.run(["tc", "qdisc", "show", "dev", str(a.peer_dev)], check=True).stdout
    assert "rate 5Mbit" in up and "rate 20Mbit" in down, (up, down)
    with pytest.raises(ValueError, match="up_mbit"):
        lab.limit(a, None, up_mbit=5)


@pytest.mark.lab
def test_unlimit_takes_the_line_out_of_the_path(lab: Lab, pair: tuple[Host, Host]) -> None:
    a, b = pair
    lab.limit(a, None, delay_ms=50)
    lab.unlimit(a)
    rtts, lost, _ = pings(a, b, 10, 0.02)
    assert lost == 0 and max(rtts) < 50
    assert "NFQUEUE" not in a.run(["iptables", "-t", "mangle", "-S"], check=True).stdout
    with pytest.raises(LabError, match="no running delay line"):
        lab.delay_line_cpu_s(a)


@pytest.mark.lab
def test_a_dead_line_darkens_its_link_rather_than_dropping_its_delay(lab: Lab, pair: tuple[Host, Host]) -> None:
    a, b = pair
    lab.limit(a, None, delay_ms=20)
    assert lab.delay_line_cpu_s(a) >= 0.0
    for line in lab._delay_lines["a"]:  # both directions' lines die
        line.proc.popen.kill()
        line.proc.popen.wait(5)
    _, lost, _ = pings(a, b, 5, 0.02)
    assert lost == 5


@pytest.mark.lab
def test_a_line_that_cannot_start_fails_the_limit_call(lab: Lab, monkeypatch: pytest.MonkeyPatch) -> None:
    a = lab.public_host("a")
    monkeypatch.setattr(netlab.sys, "executable", "/bin/false")  # a line that dies before it is ready
    with pytest.raises(LabError, match="exited"):
        lab.limit(a, None, delay_ms=5)
    assert "NFQUEUE" not in a.run(["iptables", "-t", "mangle", "-S"], check=True).stdout  # the link still works


@pytest.mark.lab
def test_a_host_behind_a_nat_gets_its_delay_both_ways(lab: Lab) -> None:
    b = lab.public_host("b")
    b.spawn_python(UDP_ECHO, "7100").wait_for("listening", timeout=10)
    a = lab.private_host("a", lab.nat("nat1"))
    lab.limit(a, None, delay_ms=20)  # its upload is held in the NAT's namespace, its download in its own
    rtts, lost, _ = pings(a, b, 10, 0.02)
    assert lost == 0 and min(rtts) >= 40 and statistics.median(rtts) < 50


# One TCP flow for `seconds`; the receiver prints its rate in Mbit/s.
TCP_SINK = r"""
import socket, sys, time
srv = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
conn, _ = srv.accept()
n, start = 0, time.monotonic()
while (b := conn.recv(1 << 16)):
    n += len(b)
print("mbit", n * 8 / (time.monotonic() - start) / 1e6, flush=True)
"""
TCP_SOURCE = r"""
import socket, sys, time
s = socket.create_connection((sys.argv[1], 7300))
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    s.sendall(bytes(1 << 16))
s.close()
"""


@pytest.mark.lab
def test_a_tcp_upload_through_a_delayed_link_still_fills_it(lab: Lab) -> None:
    """Held in the sender's own namespace, the flow's packets would count against its socket (TCP Small
    Queues) and an 8 Mbit/s link with 50 ms of RTT carried ~10% of its rate; held past the bridge, it is
    filled. A third of the rate is the bound: a check that the collapse is gone, not a speed test."""
    a, b = lab.public_host("a"), lab.public_host("b")
    lab.limit(a, 8, delay_ms=25)
    sink = b.spawn_python(TCP_SINK, "7300")
    sink.wait_for("listening", timeout=10)
    a.python(TCP_SOURCE, str(b.ip), "4", timeout=60)
    assert float(sink.wait_for(r"mbit ([\d.]+)", timeout=30)[1]) > 8 / 3
