"""Tests of the network lab itself: addressing, NAT behaviour, hole punching, shaping, clean-up.

Traffic comes from small Python socket scripts run inside the namespaces (no extra tools needed).
Each script prints one result word, so a test asserts on behaviour, never on timing.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from starling_testing import netlab
from starling_testing.netlab import Host, Lab, LabError

pytestmark = pytest.mark.lab

PORT = 7000

# Serves TCP and UDP on one port; answers each with the address it sees the client coming from.
ECHO = r"""
import socket, sys, threading
port = int(sys.argv[1])
tcp = socket.create_server(("0.0.0.0", port))
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.bind(("0.0.0.0", port))
def serve_udp():
    while True:
        _, (ip, p) = udp.recvfrom(2048)
        udp.sendto(f"{ip} {p}".encode(), (ip, p))
threading.Thread(target=serve_udp, daemon=True).start()
print("listening", flush=True)
while True:
    conn, (ip, p) = tcp.accept()
    with conn:
        conn.sendall(f"{ip} {p}\n".encode())
"""

# Tries one TCP connection or UDP exchange; prints the outcome word and, on success, the reply.
PROBE = r"""
import errno, socket, sys
proto, host, port, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
try:
    if proto == "tcp":
        with socket.create_connection((host, port), timeout=timeout) as s:
            print("reply", s.recv(100).decode().strip())
    else:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(timeout)
            s.connect((host, port))
            s.send(b"hello")
            print("reply", s.recv(100).decode().strip())
except ConnectionRefusedError:
    print("refused")
except (ConnectionResetError, BrokenPipeError):
    print("reset")
except socket.timeout:
    print("timeout")
except OSError as e:
    print("unreachable" if e.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH) else f"error {e!r}")
"""

# UDP rendezvous: once two named peers have registered, tells each the address the other came from.
RENDEZVOUS_UDP = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
seen = {}
while True:
    name, addr = s.recvfrom(64)
    seen[name] = addr
    if len(seen) == 2:
        for n, a in seen.items():
            peer = next(b for m, b in seen.items() if m != n)
            s.sendto(f"{peer[0]} {peer[1]}".encode(), a)
"""

# UDP hole punch: learn the peer's mapped address from the rendezvous, then both send to each other.
# Success means a punch from the peer arrived and the peer acknowledged ours (both directions work).
PUNCH_UDP = r"""
import socket, sys, time
rv = (sys.argv[1], int(sys.argv[2])); name = sys.argv[3].encode()
local_port, seconds = int(sys.argv[4]), float(sys.argv[5])
deadline = time.monotonic() + seconds
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", local_port))
s.settimeout(0.1)
peer = None
while peer is None and time.monotonic() < deadline:
    s.sendto(name, rv)
    try:
        data, addr = s.recvfrom(64)
    except OSError:
        continue
    if addr == rv:
        ip, port = data.decode().split()
        peer = (ip, int(port))
print("peer", peer, flush=True)
got_punch = got_ack = False
while peer is not None and time.monotonic() < deadline and not (got_punch and got_ack):
    s.sendto(b"ack" if got_punch else b"punch", peer)
    try:
        data, addr = s.recvfrom(64)
    except OSError:  # timeout, or an ICMP error reported on the socket
        continue
    if addr == peer:
        got_punch = True
        got_ack = got_ack or data == b"ack"
if got_punch and got_ack:
    for _ in range(5):  # the peer may still be waiting for our ack
        s.sendto(b"ack", peer)
        time.sleep(0.02)
    print("punched", flush=True)
else:
    print("no-punch", flush=True)
"""

# TCP rendezvous: the same over TCP, so a client's mapped TCP port is what the peer learns.
RENDEZVOUS_TCP = r"""
import socket, sys
srv = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
conns = [srv.accept() for _ in range(2)]
for (conn, _), (_, peer) in zip(conns, reversed(conns)):
    conn.sendall(f"{peer[0]} {peer[1]}\n".encode())
for conn, _ in conns:
    conn.recv(1)
"""

# TCP hole punch by simultaneous open: both sides connect() from the port the rendezvous saw, retrying
# until the deadline; a SYN that crosses the peer's outgoing SYN in its NAT completes the handshake.
PUNCH_TCP = r"""
import socket, sys, time
rv = (sys.argv[1], int(sys.argv[2])); local_port, seconds = int(sys.argv[3]), float(sys.argv[4])
deadline = time.monotonic() + seconds
def bound():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", local_port))
    return s
control = bound()
control.settimeout(seconds)
control.connect(rv)
ip, port = control.makefile().readline().split()
peer = (ip, int(port))
print("peer", peer, flush=True)
result = "no-punch"
while time.monotonic() < deadline:
    s = bound()
    s.settimeout(max(0.1, min(1.5, deadline - time.monotonic())))
    try:
        s.connect(peer)
        s.sendall(b"hi")
        if s.recv(2) == b"hi":
            result = "punched"
            break
    except OSError:
        time.sleep(0.05)
    finally:
        s.close()
print(result, flush=True)
"""

# Moves nbytes over one TCP connection; the receiving side prints bytes and rate (first to last byte).
BLAST = r"""
import socket, sys, time
role, host, port, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if role.endswith("server"):
    srv = socket.create_server((host, port))
    print("listening", flush=True)
    srv.settimeout(10)
    conn, _ = srv.accept()
else:
    conn = socket.create_connection((host, port), timeout=10)
conn.settimeout(10)
if role.startswith("send"):
    conn.sendall(bytes(nbytes))
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)
else:
    got, first, last = 0, None, None
    while data := conn.recv(1 << 16):
        last = time.monotonic()
        first = first or last
        got += len(data)
    print(f"received {got} bytes at {got / max(last - first, 1e-6):.0f} B/s", flush=True)
"""


def probe(src: Host, proto: str, ip: str, port: int = PORT, timeout: float = 5.0) -> str:
    """The outcome word of one connection attempt (and the reply, if any) from `src`.

    Where "timeout" is the expected outcome, callers pass a short `timeout` to keep the test quick.
    """
    out = src.python(PROBE, proto, ip, str(port), str(timeout), timeout=timeout + 10).stdout.strip()
    assert out, "the probe printed nothing"
    return out


def start(host: Host, script: str, *args: str) -> netlab.Proc:
    proc = host.spawn_python(script, *args)
    proc.wait_for("listening", timeout=10)
    return proc


def result_word(proc: netlab.Proc, timeout: float = 15.0) -> str:
    proc.wait(timeout)
    return proc.output().strip().splitlines()[-1]


def punch_seconds(expected: str) -> str:
    """A success ends the punch early, so it gets room for a slow machine; a failure waits it out."""
    return "8" if expected == "punched" else "2"


def test_public_hosts_reach_each_other_and_see_real_addresses(lab: Lab) -> None:
    boot, relay = lab.public_host("boot"), lab.public_host("relay")
    start(boot, ECHO, str(PORT))
    assert probe(relay, "tcp", boot.ip).split()[:2] == ["reply", relay.ip]
    assert probe(relay, "udp", boot.ip).split()[:2] == ["reply", relay.ip]


@pytest.mark.parametrize("style", ["home", "hostile"])
def test_private_host_reaches_public_host_as_its_nat_address(lab: Lab, style: netlab.NatStyle) -> None:
    boot = lab.public_host("boot")
    nat = lab.nat("nat1", style=style)
    a = lab.private_host("a", nat)
    start(boot, ECHO, str(PORT))
    assert a.ip.startswith("192.168.") and nat.ip.startswith("10.200.")
    assert probe(a, "tcp", boot.ip).split()[:2] == ["reply", nat.ip]
    assert probe(a, "udp", boot.ip).split()[:2] == ["reply", nat.ip]


def test_home_nat_silently_drops_unsolicited_inbound(lab: Lab) -> None:
    boot = lab.public_host("boot")
    nat = lab.nat("nat1", style="home")
    a = lab.private_host("a", nat)
    start(a, ECHO, str(PORT))
    assert probe(a, "tcp", "127.0.0.1").startswith("reply")  # the server is up
    assert probe(boot, "tcp", nat.ip, timeout=1.0) == "timeout"
    assert probe(boot, "udp", nat.ip, timeout=1.0) == "timeout"
    assert probe(boot, "tcp", a.ip) == "unreachable"  # private addresses are not routed publicly


def test_hostile_nat_refuses_unsolicited_inbound(lab: Lab) -> None:
    boot = lab.public_host("boot")
    nat = lab.nat("nat1", style="hostile")
    a = lab.private_host("a", nat)
    start(a, ECHO, str(PORT))
    assert probe(a, "tcp", "127.0.0.1").startswith("reply")
    assert probe(boot, "tcp", nat.ip) == "refused"  # an RST, long before the timeout
    assert probe(boot, "udp", nat.ip) == "refused"  # ICMP port unreachable
    assert probe(boot, "tcp", a.ip) == "unreachable"


@pytest.mark.parametrize(("style", "expected"), [("home", "punched"), ("hostile", "no-punch")])
def test_udp_hole_punch_works_only_through_home_nats(lab: Lab, style: netlab.NatStyle, expected: str) -> None:
    boot = lab.public_host("boot")
    a = lab.private_host("a", lab.nat("nat1", style=style))
    nat2 = lab.nat("nat2", style=style)
    b = lab.private_host("b", nat2)
    start(boot, RENDEZVOUS_UDP, "3478")
    pa = a.spawn_python(PUNCH_UDP, boot.ip, "3478", "a", "40000", punch_seconds(expected))
    pb = b.spawn_python(PUNCH_UDP, boot.ip, "3478", "b", "40000", punch_seconds(expected))
    assert (result_word(pa), result_word(pb)) == (expected, expected)
    for proc in (pa, pb):  # the rendezvous worked: each learned the other's public (NAT) address
        assert "peer ('10.200." in proc.output()
    if style == "home":  # endpoint-independent and port-preserving: the peer punches to our own port
        assert f"peer ('{nat2.ip}', 40000)" in pa.output()


@pytest.mark.parametrize(("style", "expected"), [("home", "punched"), ("hostile", "no-punch")])
def test_tcp_simultaneous_open_works_only_through_home_nats(
    lab: Lab, style: netlab.NatStyle, expected: str
) -> None:
    boot = lab.public_host("boot")
    a = lab.private_host("a", lab.nat("nat1", style=style))
    b = lab.private_host("b", lab.nat("nat2", style=style))
    start(boot, RENDEZVOUS_TCP, "4001")
    pa = a.spawn_python(PUNCH_TCP, boot.ip, "4001", "40001", punch_seconds(expected))
    pb = b.spawn_python(PUNCH_TCP, boot.ip, "4001", "40001", punch_seconds(expected))
    assert (result_word(pa), result_word(pb)) == (expected, expected)
    for proc in (pa, pb):
        assert "peer ('10.200." in proc.output()


def received_rate(proc: netlab.Proc) -> tuple[int, float]:
    words = result_word(proc).split()  # "received N bytes at R B/s"
    return int(words[1]), float(words[4])


def test_limit_caps_throughput_in_both_directions(lab: Lab) -> None:
    boot = lab.public_host("boot")
    a = lab.private_host("a", lab.nat("nat1"))
    rate_mbit, nbytes = 8, 600_000  # 1 MB/s: each transfer takes ~0.6 s when shaped
    lab.limit(a, rate_mbit=rate_mbit)
    upload_sink = start(boot, BLAST, "recv-server", "0.0.0.0", "5001", str(nbytes))
    download_source = start(boot, BLAST, "send-server", "0.0.0.0", "5002", str(nbytes))
    a.spawn_python(BLAST, "send-client", boot.ip, "5001", str(nbytes))
    download_sink = a.spawn_python(BLAST, "recv-client", boot.ip, "5002", str(nbytes))
    ceiling = 2 * rate_mbit * 1e6 / 8  # a limit check with slack for the bucket's burst, not a speed test
    for sink in (upload_sink, download_sink):
        got, rate = received_rate(sink)
        assert got == nbytes
        assert 0 < rate < ceiling, f"{rate:.0f} B/s through an {rate_mbit} Mbit/s limit"
    download_source.wait(10)


# Answers every UDP datagram that starts with b"ping" (and swallows the rest: the flood's sink).
UDP_SINK = r"""
import socket, sys
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.bind(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
while True:
    data, addr = u.recvfrom(4096)
    if data.startswith(b"ping"):
        u.sendto(data, addr)
"""

# Floods the link with UDP faster than its rate (so its queue stays full), then times small pings that wait
# in that queue behind the flood; prints the slowest round trip ("timeout" if one never came back).
FLOOD_AND_PING = r"""
import socket, sys, threading, time
host, port, seconds, rate = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
flood = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flood.connect((host, port))
ping = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
ping.connect((host, port))
ping.settimeout(20)
stop = time.monotonic() + seconds
def send_flood():
    while time.monotonic() < stop:
        flood.send(bytes(1400))
        time.sleep(1400 / rate)
threading.Thread(target=send_flood, daemon=True).start()
time.sleep(seconds / 2)
worst = 0.0
for i in range(3):
    start = time.monotonic()
    ping.send(b"ping%d" % i)
    try:
        while ping.recv(100) != b"ping%d" % i:
            pass
    except socket.timeout:
        print("timeout", flush=True)
        sys.exit()
    worst = max(worst, time.monotonic() - start)
print(f"rtt {worst:.3f}", flush=True)
"""


def test_limit_with_queue_ms_keeps_the_queue_shallow(lab: Lab) -> None:
    """A shallow queue is a property of the lab: a ping behind a full queue waits about `queue_ms`, where the
    default bucket (64 KiB for a GSO packet) holds ~6.6 s at this rate. The bound is generous: 4x the queue
    plus two frames' time on the wire, far below the default queue's delay."""
    boot, a = lab.public_host("boot"), lab.public_host("a")
    inet = lab.internet()
    rate_mbit, queue_ms = 0.08, 300.0
    lab.limit(a, rate_mbit=rate_mbit, queue_ms=queue_ms)
    limit = netlab.shallow_queue_bytes(rate_mbit, queue_ms)
    for host, dev in ((a, "eth0"), (inet, str(a.peer_dev))):
        qdisc = host.run(["tc", "qdisc", "show", "dev", dev], check=True).stdout
        assert f"burst {netlab.SHALLOW_BURST_BYTES}b" in qdisc and f"limit {limit}b" in qdisc, qdisc
        link = host.run(["ip", "-d", "link", "show", dev], check=True).stdout
        assert f"gso_max_size {netlab.SHALLOW_GSO_BYTES} " in link
    start(boot, UDP_SINK, "6000")
    out = a.python(FLOOD_AND_PING, boot.ip, "6000", "6", str(5 * rate_mbit * 1e6 / 8), timeout=60).stdout.split()
    assert out[:1] == ["rtt"], out
    frame_s = netlab.MTU_FRAME_BYTES / (rate_mbit * 1e6 / 8)
    assert float(out[1]) < 4 * queue_ms / 1000 + 2 * frame_s, f"ping behind a {queue_ms:g} ms queue took {out[1]} s"
    # TCP from a host whose GSO is not capped still gets through (tbf segments its large packets), intact.
    nbytes = 20_000
    source = start(boot, BLAST, "send-server", "0.0.0.0", "5002", str(nbytes))
    got, _ = received_rate(a.spawn_python(BLAST, "recv-client", boot.ip, "5002", str(nbytes)))
    assert got == nbytes
    source.wait(10)
    lab.unlimit(a)
    assert f"gso_max_size {netlab.VETH_GSO_BYTES} " in a.run(["ip", "-d", "link", "show", "eth0"], check=True).stdout


def test_unlimit_removes_the_shaping_on_both_ends(lab: Lab) -> None:
    c = lab.public_host("c")
    inet = lab.internet()
    lab.limit(c, rate_mbit=1)
    ends = [(c, "eth0"), (inet, str(c.peer_dev))]
    for host, dev in ends:
        assert "tbf" in host.run(["tc", "qdisc", "show", "dev", dev], check=True).stdout
    lab.unlimit(c)
    for host, dev in ends:
        assert "tbf" not in host.run(["tc", "qdisc", "show", "dev", dev], check=True).stdout


def test_set_link_down_partitions_a_host_until_it_is_up_again(lab: Lab) -> None:
    boot, c = lab.public_host("boot"), lab.public_host("c")
    start(boot, ECHO, str(PORT))
    lab.set_link(c, up=False)
    assert probe(c, "tcp", boot.ip, timeout=1.0) == "timeout"
    lab.set_link(c, up=True)
    assert probe(c, "tcp", boot.ip).startswith("reply")


def test_bad_input_is_rejected_with_clear_errors(lab: Lab) -> None:
    nat = lab.nat("nat1")
    with pytest.raises(ValueError, match="NAT style"):
        lab.nat("nat2", style="open")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host name"):
        lab.public_host("Bad_Name")
    with pytest.raises(ValueError, match="already used"):
        lab.public_host("nat1")
    with pytest.raises(ValueError, match="not a NAT"):
        lab.private_host("x", lab.public_host("boot"))
    with pytest.raises(ValueError, match="rate_mbit"):
        lab.limit(nat, rate_mbit=0)


def test_root_namespace_gets_no_links_addresses_or_rules(lab: Lab) -> None:
    before = root_network_state()
    boot = lab.public_host("boot")
    a = lab.private_host("a", lab.nat("nat1"))
    lab.limit(a, rate_mbit=50)
    start(boot, ECHO, str(PORT))
    assert probe(a, "tcp", boot.ip).startswith("reply")
    assert root_network_state() == before


def root_network_state() -> tuple[str, str, str, str]:
    """Links, addresses, routes and nft rules of the namespace this test runs in."""

    def show(*argv: str) -> str:
        return subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False).stdout

    return (
        show("ip", "-o", "link", "show"),
        show("ip", "-o", "addr", "show"),
        show("ip", "route", "show", "table", "all"),
        show("nft", "list", "ruleset"),
    )


def gone(pid: int) -> bool:
    """The process no longer exists (or is a zombie waiting for a parent that isn't us)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def need_lab() -> None:
    reason = netlab.unavailable_reason()
    if reason is not None:
        pytest.skip(f"network lab unavailable: {reason}")


def test_clean_up_after_a_failing_body_removes_everything(tmp_path: Path) -> None:
    need_lab()
    before = root_network_state()
    with pytest.raises(RuntimeError, match="test body failed"), Lab(log_dir=tmp_path) as lab:
        boot = lab.public_host("boot")
        a = lab.private_host("a", lab.nat("nat1", style="hostile"))
        lab.limit(a, rate_mbit=10)
        sleeper = boot.spawn(["sleep", "60"])
        # A process that left the spawned process group: only the per-namespace sweep finds it.
        escaper = a.spawn(["sh", "-c", "setsid sleep 60 & echo $!; wait"])
        escaped_pid = int(escaper.wait_for(r"^\d+$").group())
        raise RuntimeError("test body failed")
    assert lab.namespaces() == []
    assert [ns for ns in netlab.list_namespaces() if ns.startswith(lab.tag)] == []
    assert sleeper.poll() is not None and escaper.poll() is not None
    assert gone(escaped_pid)
    assert root_network_state() == before


def test_sweep_removes_namespaces_of_dead_runs_only(tmp_path: Path) -> None:
    need_lab()
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(finished.stdout)
    assert not netlab._pid_alive(dead_pid)
    stale = f"stl-{dead_pid}-0-x"
    live = f"stl-{os.getpid()}-999-y"
    for ns in (stale, live):
        subprocess.run(["ip", "netns", "add", ns], check=True, timeout=10)
    try:
        swept = netlab.sweep_stale("stl-")
        assert stale in swept and live not in swept
        names = netlab.list_namespaces()
        assert stale not in names and live in names
        with Lab(log_dir=tmp_path):  # entering a lab sweeps too, and still spares live runs
            assert live in netlab.list_namespaces()
    finally:
        for ns in (stale, live):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=10)


def test_using_a_closed_lab_is_an_error(tmp_path: Path) -> None:
    need_lab()
    with Lab(log_dir=tmp_path) as lab:
        pass
    with pytest.raises(LabError, match="closed"):
        lab.public_host("late")
    with pytest.raises(LabError, match="context manager"):
        Lab(log_dir=tmp_path).public_host("early")


# A lab in a separate process that is then signalled: prints its tag and a spawned pid, then idles.
LAB_IN_A_PROCESS = r"""
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if started in background
from starling_testing.netlab import Lab
with Lab(sys.argv[2], log_dir=sys.argv[1]) as lab:
    lab.private_host("a", lab.nat("nat1"))
    sleeper = lab.public_host("boot").spawn(["sleep", "60"])
    print(lab.tag, sleeper.pid, flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_signalled_lab_cleans_up_or_is_swept_after_a_crash(tmp_path: Path, sig: signal.Signals) -> None:
    need_lab()
    prefix = f"stlt{os.getpid()}-"  # a prefix of our own: no concurrent test run sweeps these
    owner = subprocess.Popen(
        [sys.executable, "-c", LAB_IN_A_PROCESS, str(tmp_path), prefix],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        ready, _, _ = select.select([owner.stdout], [], [], 15)
        assert ready, "the lab process did not start"
        tag, sleeper_pid = owner.stdout.readline().split()  # type: ignore[union-attr]
        assert any(ns.startswith(tag) for ns in netlab.list_namespaces())
        owner.send_signal(sig)
        owner.wait(timeout=15)
        if sig == signal.SIGKILL:  # no chance to clean up: the next lab's sweep must do it
            assert not gone(int(sleeper_pid))
            assert any(ns.startswith(tag) for ns in netlab.sweep_stale(prefix))
        assert not any(ns.startswith(tag) for ns in netlab.list_namespaces())
        assert gone(int(sleeper_pid))
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=10)
        netlab.sweep_stale(prefix)
