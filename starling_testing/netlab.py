"""A network lab made of Linux network namespaces, for tests and benchmarks that need real NATs.

Topology, built on demand::

    "internet" namespace: bridge br0 (no address), one port per public host / NAT
        |-- public host  (eth0 10.200.0.x/16)
        |-- NAT router   (wan 10.200.0.x/16; nftables masquerade)
                |-- bridge "lan" 192.168.1xx.1/24 inside the NAT's namespace
                        |-- private host (eth0 192.168.1xx.y/24, default route via the NAT)

Two NAT styles, because they decide whether hole punching can work:

* ``home``: unsolicited inbound packets are silently dropped, and the mapping keeps the source port
  (Linux masquerade's default), i.e. endpoint-independent: the port a rendezvous server observes is
  the port a peer can punch to.
* ``hostile``: unsolicited inbound is answered (TCP RST / ICMP port unreachable) and every new flow
  gets a random public port (``masquerade fully-random``), i.e. a symmetric NAT: the observed port is
  useless to a peer, so punching fails and only a relay works.

Safety: nothing is ever configured in the root namespace. Every veth pair is created with both ends
directly inside lab namespaces, the bridge lives in the "internet" namespace, and no namespace has a
link to the machine's real network, so lab traffic cannot leave the lab whatever the routes say.

Clean-up: ``Lab`` is a context manager; on exit (normal, exception, Ctrl-C, or SIGTERM, which it turns
into KeyboardInterrupt while it is active) it kills the processes it started, then anything else left
inside its namespaces, and deletes the namespaces (which deletes their veths and bridges). Namespace
names carry the owning process id (``stl-<pid>-<n>-<host>``), so a new lab also sweeps namespaces
left by a crashed run whose process is gone, and never touches those of a live concurrent run.

Run ``python -m starling_testing.netlab --sweep`` to remove stale namespaces by hand.
"""

from __future__ import annotations

import atexit
import functools
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from starling_testing import delayline
from starling_testing.delayline import READY_LINE as DELAY_READY_LINE
from starling_testing.delayline import LineSpec

NatStyle = Literal["home", "hostile"]
Role = Literal["internet", "public", "nat", "private"]

DEFAULT_PREFIX = "stl-"
PUBLIC_NET = ipaddress.IPv4Network("10.200.0.0/16")
FIRST_PUBLIC_HOST = 10  # 10.200.0.10 is the first public address handed out
FIRST_LAN = 101  # the first NAT's LAN is 192.168.101.0/24
FIRST_PRIVATE_HOST = 10  # private hosts start at .10; the NAT is .1
COMMAND_TIMEOUT_S = 10.0  # bound on every setup/teardown command
STOP_GRACE_S = 3.0  # SIGTERM -> SIGKILL grace for spawned processes
MTU_FRAME_BYTES = 1514  # a full-sized Ethernet frame on a lab link (MTU 1500 + header), as tbf counts it
VETH_GSO_BYTES = 65536  # the kernel's default gso_max_size on veth
SHALLOW_GSO_BYTES = MTU_FRAME_BYTES  # GSO cap of a `queue_ms` link: no packet larger than its queue
SHALLOW_BURST_BYTES = 2 * MTU_FRAME_BYTES  # the smallest bucket of a `queue_ms` link (tbf rounds it down)


def shallow_queue_bytes(rate_mbit: float, queue_ms: float) -> int:
    """tbf's `limit` for a queue of `queue_ms` at `rate_mbit`: never less than one full-sized frame."""
    return max(MTU_FRAME_BYTES, int(rate_mbit * 1e6 / 8 * queue_ms / 1000))

DELAY_INGRESS_QUEUE = 1  # NFQUEUE numbers are per namespace: a host's download line is alone in its own
DELAY_UPLOAD_QUEUE_BASE = 100  # upload lines share the far end's namespace: one queue per host there

_HOST_NAME = re.compile(r"^[a-z][a-z0-9-]{0,11}$")  # short: it also names veth ends (15-char limit)
_RESERVED_NAMES = {"inet", "lo", "lan", "wan", "br0", "eth0", "probe"}
_lab_counter = itertools.count()


class LabError(RuntimeError):
    """The lab could not be built, a command in it failed, or something could not be cleaned up."""


class LabTimeout(LabError):
    """A bounded wait inside the lab ran out of time."""


# ----------------------------------------------------------------------------------------------
# Small helpers around `ip`, `nft` and `tc`


def _run_cmd(
    argv: Sequence[str], *, input: str | None = None, timeout: float = COMMAND_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run a setup command; raise LabError quoting its stderr when it fails or hangs."""
    try:
        proc = subprocess.run(
            list(argv), input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError:
        raise LabError(f"{argv[0]!r} not found: {_install_hint(argv[0])}") from None
    except subprocess.TimeoutExpired:
        raise LabTimeout(f"`{' '.join(argv)}` did not finish within {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def _install_hint(tool: str) -> str:
    package = {"nft": "nftables", "tc": "iproute2", "ip": "iproute2"}.get(tool, tool)
    return f"install the Debian package {package} (`make sysdeps` does it as root)"


def _require_tool(tool: str) -> None:
    if shutil.which(tool) is None:
        raise LabError(f"{tool!r} not found: {_install_hint(tool)}")


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``), ours or not."""
    out = _run_cmd(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pids_in(netns: str) -> list[int]:
    try:
        out = _run_cmd(["ip", "netns", "pids", netns]).stdout
    except LabError:
        return []  # already gone
    return [int(tok) for tok in out.split() if tok.isdigit()]


def _kill_namespace(netns: str) -> None:
    """SIGKILL whatever still runs inside `netns`, then delete it (which removes its links)."""
    for pid in _pids_in(netns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _run_cmd(["ip", "netns", "delete", netns])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete namespaces named ``<prefix><pid>-...`` whose owning process no longer exists.

    A live owner's namespaces are left alone, so concurrent labs (two pytest runs, a benchmark next
    to a test run) do not destroy each other. Returns the names deleted.
    """
    owned = re.compile(rf"^{re.escape(prefix)}(\d+)-")
    swept = []
    for netns in list_namespaces():
        match = owned.match(netns)
        if match is None or _pid_alive(int(match[1])):
            continue
        try:
            _kill_namespace(netns)
        except LabError:
            if netns in list_namespaces():
                raise
            continue  # a concurrent sweep deleted it first
        swept.append(netns)
    return swept


@functools.cache
def unavailable_reason(prefix: str = DEFAULT_PREFIX) -> str | None:
    """Why this machine cannot build a lab (so tests should skip), or None if it can.

    Only a kernel/privilege limit is a reason: missing nft/tc is an installation error that the lab
    reports when they are first needed.
    """
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "the network lab needs root to create network namespaces"
    if shutil.which("ip") is None:
        return f"`ip` not found ({_install_hint('ip')})"
    probe = f"{prefix}{os.getpid()}-probe"
    try:
        _run_cmd(["ip", "netns", "add", probe])
    except LabError as e:
        return f"the kernel refused to create a network namespace: {e}"
    try:
        _run_cmd(["ip", "netns", "delete", probe])
    except LabError as e:
        return f"could not delete the probe namespace {probe}: {e}"
    return None


def bench_exit_code() -> int | None:
    """For a benchmark's `main`: 2, after saying why on stderr, where this machine cannot build a lab; else None."""
    reason = unavailable_reason()
    if reason is None:
        return None
    print(f"error: the network lab is unavailable: {reason}", file=sys.stderr)
    return 2


# ----------------------------------------------------------------------------------------------
# Processes and hosts


@dataclass(eq=False)
class Proc:
    """A process started inside a lab namespace, its stdout and stderr going to `log_path`."""

    host: Host
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float = COMMAND_TIMEOUT_S) -> int:
        """Wait for exit and return the exit status; LabTimeout (process left running) if it is late."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise LabTimeout(
                f"{self.host.name}: {self.argv[0]} still running after {timeout:.1f} s\n{self.tail()}"
            ) from None

    def stop(self, grace: float = STOP_GRACE_S) -> int:
        """SIGTERM the process group, SIGKILL it after `grace` seconds; return the exit status.

        The group is signalled only while its leader is unreaped, i.e. while the group id cannot have
        been reused by someone else's process. Children that outlive their leader are killed when the
        lab closes (everything left inside its namespaces is).
        """
        if self.popen.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                return self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
        return self.popen.wait(timeout=COMMAND_TIMEOUT_S)

    def _signal_group(self, sig: int) -> None:
        # Started in its own session, the process leads a group whose id is its pid: signalling the
        # group also reaches the children it started (a daemon's torch worker, a shell's pipeline).
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def output(self, max_bytes: int = 1 << 20) -> str:
        """The last `max_bytes` of the log (bounded, so a chatty daemon cannot blow up a test)."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(max(0, self.log_path.stat().st_size - max_bytes))
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, lines: int = 20) -> str:
        text = "\n".join(self.output(64 * 1024).splitlines()[-lines:])
        return f"--- last lines of {self.log_path} ---\n{text}"

    def wait_for(self, pattern: str | re.Pattern[str], timeout: float = COMMAND_TIMEOUT_S) -> re.Match[str]:
        """Wait until a log line matches `pattern` (re.search) and return the match.

        Raises LabTimeout after `timeout`, or LabError as soon as the process exits without printing
        it, so a crashed daemon fails a test at once instead of after the whole timeout.
        """
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        offset, partial = 0, ""
        while True:
            exited = self.popen.poll() is not None  # checked before reading: no lost last lines
            with self.log_path.open("rb") as f:
                f.seek(offset)
                chunk = f.read(1 << 20)
            offset += len(chunk)
            lines = (partial + chunk.decode(errors="replace")).split("\n")
            partial = lines.pop()[-65536:]  # an unfinished line; bounded
            for line in [*lines, partial] if exited else lines:
                if (match := regex.search(line)) is not None:
                    return match
            if exited and not chunk:
                raise LabError(
                    f"{self.host.name}: {self.argv[0]} exited ({self.popen.returncode}) "
                    f"without printing {regex.pattern!r}\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise LabTimeout(
                    f"{self.host.name}: no line matching {regex.pattern!r} within {timeout:.1f} s\n{self.tail()}"
                )
            if not chunk:
                time.sleep(0.02)


@dataclass(eq=False)
class Host:
    """One namespace of the lab: the internet bridge, a public host, a NAT router or a private host.

    `ip` is the address other hosts use: the public address for public hosts and NATs (a NAT's is
    what its private hosts appear as), the LAN address for private hosts, None for the internet.
    """

    lab: Lab = field(repr=False)
    name: str
    netns: str
    role: Role
    ip: str | None = None
    nat: Host | None = None  # private hosts: the router they sit behind
    nat_style: NatStyle | None = None  # NAT routers
    lan_ip: str | None = None  # NAT routers: their LAN-side address (the private hosts' gateway)
    lan_net: ipaddress.IPv4Network | None = None  # NAT routers: their LAN
    uplink: str | None = None  # interface toward the internet (or the LAN for private hosts)
    peer_netns: str | None = None  # where the other end of the uplink veth lives
    peer_dev: str | None = None
    _lan_hosts: itertools.count = field(
        default_factory=lambda: itertools.count(FIRST_PRIVATE_HOST), repr=False
    )

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """`cmd` wrapped to run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *cmd]

    def run(
        self,
        cmd: Sequence[str],
        *,
        timeout: float = COMMAND_TIMEOUT_S,
        check: bool = False,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run `cmd` inside the namespace to completion, capturing text output.

        Raises subprocess.TimeoutExpired after `timeout` (the command is killed), and
        CalledProcessError for a non-zero exit when `check` is set, like subprocess.run.
        """
        return subprocess.run(
            self.argv(cmd),
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
            env=self.lab._env(env),
            stdin=None if input is not None else subprocess.DEVNULL,
        )

    def spawn(
        self,
        cmd: Sequence[str],
        *,
        log: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> Proc:
        """Start `cmd` in the namespace in the background; the lab stops it on exit.

        stdout and stderr go to ``lab.log_dir / log`` (default ``<host>.<n>.log``); stdin is /dev/null.
        The process gets its own session, so stopping it also stops the children it starts.
        """
        return self.lab._spawn(self, list(cmd), log=log, env=env, cwd=cwd)

    def python(
        self, code: str, *args: str, timeout: float = COMMAND_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        """Run a Python snippet (with this interpreter, so the venv's packages) to completion."""
        return self.run([sys.executable, "-c", code, *args], timeout=timeout)

    def spawn_python(self, code: str, *args: str, log: str | None = None) -> Proc:
        """Start a Python snippet in the background (output unbuffered, so `wait_for` sees it)."""
        return self.spawn([sys.executable, "-c", code, *args], log=log)


@dataclass(eq=False)
class _DelayLine:
    """One direction's delay line: its process, the namespace it runs in, and the iptables rule feeding it."""

    proc: Proc
    where: Host
    rule: list[str]


# ----------------------------------------------------------------------------------------------
# The lab


class Lab:
    """Builds namespaces on demand and guarantees they are gone on exit. Use as a context manager.

    Sketch::

        with Lab() as lab:
            boot = lab.public_host("boot")              # 10.200.0.10 on the "internet" bridge
            nat = lab.nat("nat1", style="home")         # 10.200.0.11, LAN 192.168.101.0/24
            a = lab.private_host("a", nat)              # 192.168.101.10, default route via nat1
            lab.limit(a, rate_mbit=100)                 # both directions of a's link
            d = boot.spawn(["starling", "run", ...], log="boot.log")
            d.wait_for(r"listening on", timeout=10)
            a.run([...], timeout=10)                    # CompletedProcess
    """

    def __init__(
        self,
        prefix: str = DEFAULT_PREFIX,
        *,
        log_dir: str | Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,15}-", prefix):
            raise ValueError(f"prefix {prefix!r}: lowercase letters, digits and '-', ending with '-'")
        self.prefix = prefix
        self.tag = f"{prefix}{os.getpid()}-{next(_lab_counter)}-"  # every namespace name starts so
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="netlab-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.hosts: dict[str, Host] = {}
        self.procs: list[Proc] = []
        self._extra_env = dict(env or {})
        self._public_ips = itertools.count(FIRST_PUBLIC_HOST)
        self._lans = itertools.count(FIRST_LAN)
        self._log_names = itertools.count()
        self._inet: Host | None = None
        self._closed = False
        self._entered = False
        self._old_sigterm: object = None
        self._delay_lines: dict[str, list[_DelayLine]] = {}  # host name -> its running delay lines

    # -- lifetime ------------------------------------------------------------------------------

    def __enter__(self) -> Lab:
        if self._entered:
            raise LabError("a Lab can be entered only once")
        self._entered = True
        reason = unavailable_reason(self.prefix)
        if reason is not None:
            raise LabError(f"cannot build a network lab: {reason}")
        sweep_stale(self.prefix)
        atexit.register(self.close)  # backstop for a process that exits without leaving the block
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                # Default SIGTERM would kill us without clean-up; make it unwind like Ctrl-C.
                self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
        return self

    def __exit__(self, *exc_info: object) -> None:
        body_failed = exc_info[0] is not None
        try:
            self.close()
        except LabError:
            if not body_failed:  # don't hide the test's own error behind a clean-up error
                raise

    def close(self) -> None:
        """Stop every process and delete every namespace of this lab. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        with _signals_deferred():
            errors = []
            for proc in self.procs:
                try:
                    proc.stop()
                except Exception as e:  # keep going: the namespaces must go regardless
                    errors.append(f"stopping {proc.argv[0]} in {proc.host.name}: {e}")
            for netns in self.namespaces():
                try:
                    _kill_namespace(netns)
                except LabError as e:
                    errors.append(str(e))
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)  # type: ignore[arg-type]
            left = self.namespaces()
        if left or errors:
            raise LabError(f"lab clean-up incomplete; namespaces left: {left}; errors: {errors}")

    def namespaces(self) -> list[str]:
        """The namespaces of this lab that currently exist."""
        return [ns for ns in list_namespaces() if ns.startswith(self.tag)]

    # -- building ------------------------------------------------------------------------------

    def internet(self) -> Host:
        """The namespace holding the public bridge (created on first use; no address of its own)."""
        if self._inet is None:
            self._check_open()
            inet = self._add_namespace("inet", "internet")
            self._ip(inet, "link", "add", "br0", "type", "bridge", "forward_delay", "0", "stp_state", "0")
            self._ip(inet, "link", "set", "br0", "up")
            self._inet = inet
        return self._inet

    def public_host(self, name: str) -> Host:
        """A host with a public address on the bridge (bootstrap, relay, public trainer)."""
        inet = self.internet()
        host = self._add_namespace(name, "public")
        host.ip = self._next_public_ip()
        self._connect(host, "eth0", inet, bridge="br0", address=f"{host.ip}/{PUBLIC_NET.prefixlen}")
        return host

    def nat(self, name: str, style: NatStyle = "home") -> Host:
        """A NAT router with a public address on the bridge and an empty LAN 192.168.1xx.0/24."""
        if style not in ("home", "hostile"):
            raise ValueError(f"NAT style {style!r}: expected 'home' or 'hostile'")
        _require_tool("nft")
        inet = self.internet()
        lan_index = next(self._lans)
        if lan_index > 254:
            raise LabError("out of LAN subnets (at most 154 NATs per lab)")
        host = self._add_namespace(name, "nat")
        host.ip = self._next_public_ip()
        host.nat_style = style
        host.lan_net = ipaddress.IPv4Network(f"192.168.{lan_index}.0/24")
        host.lan_ip = str(host.lan_net[1])
        self._connect(host, "wan", inet, bridge="br0", address=f"{host.ip}/{PUBLIC_NET.prefixlen}")
        self._ip(host, "link", "add", "lan", "type", "bridge", "forward_delay", "0", "stp_state", "0")
        self._ip(host, "addr", "add", f"{host.lan_ip}/{host.lan_net.prefixlen}", "dev", "lan")
        self._ip(host, "link", "set", "lan", "up")
        self._sysctl(host, {"net/ipv4/ip_forward": "1"})
        _run_cmd(["ip", "netns", "exec", host.netns, "nft", "-f", "-"], input=_nat_ruleset(style))
        return host

    def private_host(self, name: str, nat: Host) -> Host:
        """A host on `nat`'s LAN whose default route goes through it."""
        if nat.role != "nat" or nat.lab is not self or nat.lan_net is None:
            raise ValueError(f"{nat.name!r} is not a NAT router of this lab")
        offset = next(nat._lan_hosts)
        if offset > 254:
            raise LabError(f"NAT {nat.name!r}: its LAN is full")
        host = self._add_namespace(name, "private")
        host.nat = nat
        host.ip = str(nat.lan_net[offset])
        self._connect(host, "eth0", nat, bridge="lan", address=f"{host.ip}/{nat.lan_net.prefixlen}")
        self._ip(host, "route", "add", "default", "via", str(nat.lan_ip))
        return host

    def limit(
        self,
        host: Host,
        rate_mbit: float | None,
        *,
        up_mbit: float | None = None,
        delay_ms: float = 0.0,
        jitter_ms: float = 0.0,
        loss: float = 0.0,
        egress: bool = True,
        ingress: bool = True,
        burst_bytes: int | None = None,
        queue_ms: float | None = None,
        seed: int | None = None,
    ) -> None:
        """Cap `host`'s uplink with a token bucket (tc tbf); call again to change, `unlimit` to remove.

        Egress is shaped on the host's own veth end, ingress on the other end (whose egress it is),
        so both directions are real queues rather than policers that drop. `rate_mbit` is the rate of
        both directions, or of the download alone where `up_mbit` gives the upload its own (a home
        line: 20 down, 5 up); None leaves the rate unshaped (latency or loss alone).

        `delay_ms`, `jitter_ms` and `loss` put a userspace delay line (starling_testing/delayline.py,
        on NFQUEUE: this kernel has no netem) on each shaped direction of the link: every packet is held
        `delay_ms` +- a uniform `jitter_ms`, order kept, and dropped with probability `loss`. They are per
        direction of this link, so a ping from `host` to an unshaped host takes 2 x `delay_ms`, and
        between two hosts both limited so, 4 x `delay_ms`. `seed` fixes the line's draws.

        By default the bucket holds a 64 KiB GSO packet, and the queue behind it as much again: on a
        slow link that is seconds of queue (6.6 s at 0.08 Mbit/s), the bufferbloat of a cheap uplink.
        `queue_ms` models a shallow queue instead (a router that keeps its queue short): GSO on both
        veth ends is capped to one MTU-sized frame, so the bucket can be two frames, and the queue
        holds `queue_ms` of traffic at the link rate (never less than one full-sized frame). Larger
        packets forwarded from a host whose GSO is not capped are segmented by tbf.
        """
        for name, rate in (("rate_mbit", rate_mbit), ("up_mbit", up_mbit)):
            if rate is not None and rate <= 0:
                raise ValueError(f"{name} must be positive, got {rate}")
        if up_mbit is not None and rate_mbit is None:
            raise ValueError("up_mbit needs rate_mbit (the download's rate)")
        if queue_ms is not None and queue_ms <= 0:
            raise ValueError(f"queue_ms must be positive, got {queue_ms}")
        line = LineSpec(delay_ms, jitter_ms, loss)  # validates before anything changes
        self._check_link(host)
        self.unlimit(host)  # a fresh start: no old bucket or line survives a change of settings
        if rate_mbit is not None:
            _require_tool("tc")
            gso = SHALLOW_GSO_BYTES if queue_ms is not None else VETH_GSO_BYTES
            up = up_mbit if up_mbit is not None else rate_mbit
            for (netns, dev, wanted), rate in zip(self._link_ends(host, egress, ingress), (up, rate_mbit), strict=True):
                # Both ends, whichever direction is shaped: a packet's size is fixed where it is built.
                _run_cmd(["ip", "-n", netns, "link", "set", "dev", dev, "gso_max_size", str(gso)])
                if wanted:
                    tbf = _tbf_args(rate, burst_bytes, queue_ms)
                    _run_cmd(["ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", dev, "root", *tbf])
        if not line.is_noop:
            self._start_delay_line(host, line, egress=egress, ingress=ingress, seed=seed)

    def _start_delay_line(self, host: Host, line: LineSpec, *, egress: bool, ingress: bool, seed: int | None) -> None:
        """Run a delay line for each direction of `host`'s link and steer its packets through it.

        Each direction is held where its packets have already left the namespace that sent them: the
        upload in the far end's namespace (the bridge's: br_netfilter shows bridged packets to iptables,
        matched by the bridge port they came in on), the download in the host's own, as it arrives. Held
        in the sender's own namespace, a TCP flow's packets still count against its socket (TCP Small
        Queues), and a 20 Mbit/s flow behind 50 ms of line fell to 1.8 Mbit/s (measured).

        The rules go in only once the line has bound its queue, and without `--queue-bypass`: packets
        of a queue nobody reads are dropped, so a dead line shows as a dead link, never as a fast one.
        """
        _require_tool("iptables")
        lines: list[tuple[Host, list[str]]] = []
        if egress:
            far = self._host_of_netns(str(host.peer_netns))
            # NFQUEUE numbers are per namespace; the far end serves many links, so its queue is per host.
            queue = DELAY_UPLOAD_QUEUE_BASE + list(self.hosts).index(host.name)
            self._sysctl(far, {"net/bridge/bridge-nf-call-iptables": "1"})
            lines.append((far, ["PREROUTING", "-m", "physdev", "--physdev-in", str(host.peer_dev),
                                "-j", "NFQUEUE", "--queue-num", str(queue)]))  # fmt: skip
        if ingress:
            lines.append((host, ["PREROUTING", "-i", str(host.uplink),
                                 "-j", "NFQUEUE", "--queue-num", str(DELAY_INGRESS_QUEUE)]))  # fmt: skip
        started = self._delay_lines.setdefault(host.name, [])
        for i, (where, rule) in enumerate(lines):
            # By path, not `-m`: the script needs only the standard library and netfilterqueue, and running
            # a module of an already-imported package as __main__ would import it twice.
            argv = [sys.executable, str(Path(delayline.__file__)), "--queue", line.to_arg(int(rule[-1]))]
            if seed is not None:
                argv += ["--seed", str(seed + i)]
            proc = where.spawn(argv, log=f"delayline-{host.name}.{next(self._log_names)}.log")
            started.append(_DelayLine(proc, where, rule))
            proc.wait_for(re.escape(DELAY_READY_LINE), timeout=COMMAND_TIMEOUT_S)
            _run_cmd(["ip", "netns", "exec", where.netns, "iptables", "-w", "5", "-t", "mangle", "-A", *rule])

    def _host_of_netns(self, netns: str) -> Host:
        for candidate in (self._inet, *self.hosts.values()):
            if candidate is not None and candidate.netns == netns:
                return candidate
        raise LabError(f"no host of this lab lives in namespace {netns!r}")

    def delay_line_cpu_s(self, host: Host) -> float:
        """CPU seconds (user + system) that `host`'s delay lines have used so far: what the lab costs."""
        lines = self._delay_lines.get(host.name)
        if not lines or any(line.proc.poll() is not None for line in lines):
            raise LabError(f"{host.name!r} has no running delay line")
        total = 0.0
        for line in lines:
            fields = Path(f"/proc/{line.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total

    def unlimit(self, host: Host) -> None:
        """Remove the bandwidth caps and the delay lines set by `limit`."""
        self._check_link(host)
        for line in self._delay_lines.pop(host.name, []):
            subprocess.run(
                ["ip", "netns", "exec", line.where.netns, "iptables", "-w", "5", "-t", "mangle", "-D", *line.rule],
                capture_output=True,
                timeout=COMMAND_TIMEOUT_S,
                check=False,  # never added if the line did not get ready
            )
            line.proc.stop()
        for netns, dev, _ in self._link_ends(host, True, True):
            subprocess.run(
                ["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", dev, "root"],
                capture_output=True,
                timeout=COMMAND_TIMEOUT_S,
                check=False,  # "no such qdisc" when that side was never limited
            )
            _run_cmd(["ip", "-n", netns, "link", "set", "dev", dev, "gso_max_size", str(VETH_GSO_BYTES)])

    def set_link(self, host: Host, up: bool) -> None:
        """Take `host`'s uplink down (a partition: its packets vanish) or bring it back up."""
        self._check_link(host)
        # The far end is the one toggled: the host's own interface keeps its address and routes.
        _run_cmd(
            ["ip", "-n", str(host.peer_netns), "link", "set", str(host.peer_dev), "up" if up else "down"]
        )

    def logs(self, max_bytes: int = 64 * 1024) -> dict[str, str]:
        """The tail of every process log, by file name: for failure messages and benchmark reports."""
        return {proc.log_path.name: proc.output(max_bytes) for proc in self.procs}

    # -- internals -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise LabError("this lab is closed")
        if not self._entered:
            raise LabError("use the lab as a context manager: `with Lab() as lab:`")

    def _check_link(self, host: Host) -> None:
        if host.lab is not self or host.peer_netns is None or host.peer_dev is None or host.uplink is None:
            raise ValueError(f"{host.name!r} has no uplink in this lab")

    def _link_ends(self, host: Host, egress: bool, ingress: bool) -> list[tuple[str, str, bool]]:
        return [(host.netns, str(host.uplink), egress), (str(host.peer_netns), str(host.peer_dev), ingress)]

    def _next_public_ip(self) -> str:
        index = next(self._public_ips)
        if index >= PUBLIC_NET.num_addresses - 1:
            raise LabError("out of public addresses")
        return str(PUBLIC_NET[index])

    def _add_namespace(self, name: str, role: Role) -> Host:
        self._check_open()
        if role != "internet":
            if not _HOST_NAME.match(name) or name in _RESERVED_NAMES:
                raise ValueError(
                    f"host name {name!r}: 1-12 chars of a-z, 0-9, '-', starting with a letter, "
                    f"not one of {sorted(_RESERVED_NAMES)}"
                )
            if name in self.hosts:
                raise ValueError(f"host name {name!r} is already used in this lab")
        host = Host(lab=self, name=name, netns=f"{self.tag}{name}", role=role)
        _run_cmd(["ip", "netns", "add", host.netns])
        if role != "internet":
            self.hosts[name] = host
        self._ip(host, "link", "set", "lo", "up")
        # IPv6 off: only the IPv4 plan above exists in the lab, and link-local v6 would let hosts on
        # a segment talk around it (and make libp2p announce fe80:: addresses).
        self._sysctl(
            host,
            {"net/ipv6/conf/all/disable_ipv6": "1", "net/ipv6/conf/default/disable_ipv6": "1"},
            optional=True,
        )
        return host

    def _connect(self, host: Host, dev: str, upstream: Host, *, bridge: str, address: str) -> None:
        """A veth pair created directly between two lab namespaces: `dev` in host, a port of `bridge`."""
        peer = f"p-{host.name}"
        _run_cmd(
            ["ip", "link", "add", dev, "netns", host.netns, "type", "veth",
             "peer", "name", peer, "netns", upstream.netns]
        )  # fmt: skip
        host.uplink, host.peer_netns, host.peer_dev = dev, upstream.netns, peer
        self._ip(upstream, "link", "set", peer, "master", bridge)
        self._ip(upstream, "link", "set", peer, "up")
        self._ip(host, "addr", "add", address, "dev", dev)
        self._ip(host, "link", "set", dev, "up")

    @staticmethod
    def _ip(host: Host, *args: str) -> None:
        _run_cmd(["ip", "-n", host.netns, *args])

    @staticmethod
    def _sysctl(host: Host, values: dict[str, str], *, optional: bool = False) -> None:
        """Write /proc/sys entries as seen from inside the namespace (no dependency on procps).

        `optional` skips entries this kernel lacks (e.g. IPv6 compiled out).
        """
        lines = ["set -e"]
        for key, value in values.items():
            path = f"/proc/sys/{key}"
            write = f"echo {value} > {path}"
            lines.append(f"if [ -e {path} ]; then {write}; fi" if optional else write)
        _run_cmd(["ip", "netns", "exec", host.netns, "sh", "-c", "\n".join(lines)])

    def _env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        return {**os.environ, "PYTHONUNBUFFERED": "1", **self._extra_env, **(env or {})}

    def _spawn(
        self,
        host: Host,
        cmd: list[str],
        *,
        log: str | None,
        env: Mapping[str, str] | None,
        cwd: str | Path | None,
    ) -> Proc:
        self._check_open()
        if not cmd:
            raise ValueError("empty command")
        name = log if log is not None else f"{host.name}.{next(self._log_names)}.log"
        log_path = self.log_dir / name
        if log_path.parent != self.log_dir:
            raise ValueError(f"log {log!r}: a plain file name, written under {self.log_dir}")
        with log_path.open("wb") as log_file:  # the child keeps its own descriptor
            popen = subprocess.Popen(
                host.argv(cmd),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self._env(env),
                cwd=cwd,
                start_new_session=True,
            )
        proc = Proc(host=host, argv=cmd, log_path=log_path, popen=popen)
        self.procs.append(proc)
        return proc


def _tbf_args(rate_mbit: float, burst_bytes: int | None, queue_ms: float | None) -> list[str]:
    """tc's words for a token bucket at `rate_mbit` (see `Lab.limit` for the two queue shapes)."""
    rate_bytes = rate_mbit * 1e6 / 8
    if queue_ms is None:
        # The bucket must hold at least a GSO packet (64 KiB on veth) and ~10 ms of traffic.
        burst = burst_bytes if burst_bytes is not None else max(64 * 1024, int(rate_bytes / 100))
        return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms"]
    burst = burst_bytes if burst_bytes is not None else max(SHALLOW_BURST_BYTES, int(rate_bytes / 100))
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst),
            "limit", str(shallow_queue_bytes(rate_mbit, queue_ms))]  # fmt: skip


def _nat_ruleset(style: NatStyle) -> str:
    """nftables rules for a NAT router namespace (interfaces `wan` and `lan`)."""
    if style == "home":
        mapping = "masquerade"  # keeps the source port when free: endpoint-independent mapping
        unsolicited = ['iifname "wan" drop']
    else:
        mapping = "masquerade fully-random"  # a fresh random port per flow: symmetric NAT
        unsolicited = ['iifname "wan" meta l4proto tcp reject with tcp reset', 'iifname "wan" reject']
    refuse = "".join(f"\n        {rule}" for rule in unsolicited)
    return f"""
table ip starling_nat {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "wan" {mapping}
    }}
}}
table inet starling_filter {{
    chain input {{
        type filter hook input priority filter; policy accept;
        iifname "wan" ct state established,related accept{refuse}
    }}
    chain forward {{
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "lan" oifname "wan" accept{refuse}
    }}
}}
"""


def _sigterm_as_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM until the block ends, so a second Ctrl-C cannot cut clean-up short.

    Every wait inside clean-up is bounded, so deferring cannot hang; the signal is delivered (and
    raises) right after.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    blocked = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m starling_testing.netlab --sweep [--prefix stl-]`: remove namespaces left by crashed runs."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--sweep", action="store_true", help="delete stale lab namespaces")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX)
    args = parser.parse_args(argv)
    if not args.sweep:
        parser.print_help()
        return 2
    try:
        swept = sweep_stale(args.prefix)
    except LabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("\n".join(swept) if swept else "no stale namespaces")
    return 0


if __name__ == "__main__":
    sys.exit(main())
