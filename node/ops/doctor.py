"""`starling doctor`: find what stops this node from working, and say how to fix each problem.

The doctor runs a fixed list of checks, each producing `Finding`s (check, level, message, fix):

* local checks, which need no daemon: identity file, whether HOME is writable and has room for
  checkpoints, config (file and STARLING_* environment), swarm key, whether the listen ports can be
  bound, whether the bootstrap peers
  answer on TCP and then complete a libp2p handshake with this node's identity and swarm key (an open
  port proves nothing about the PeerID or the key: a wrong one is named, as the daemon names it);
* status checks, which read the running daemon's `status` (the same dict `starling status --json`
  prints): own reachability, clock skew against peers, versions, run manifest, training (failing
  checkpoints included), and connections (none although bootstrap peers are configured). They are pure
  functions of that dict so that each verdict can be tested on a synthetic status. Without a daemon they
  are reported as skipped, not as errors: "no daemon" is a state, not a fault.

Levels: ok, skip, warn, error. The exit code is 1 when any finding is an error, else 0; `doctor_main`
returns 2 for a HOME that cannot be a node directory at all (bad usage).

The doctor only reads: it never rewrites the identity file, the config or the state, so running it on a
live node is always safe. (Its handshake with a bootstrap peer not connected to the daemon is made with
the node's own identity, as the daemon's would be, and closed at once.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import errno
import fcntl
import json
import os
import re
import socket
import stat
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import trio

from node.config.home import Home
from node.config.load import ENV_PREFIX, Config, ConfigError, load_config, resolve_home
from node.ops.islands import PairingGraph, pairing_graph
from node.status_schema import MemberStatus, NodeStatus

Level = Literal["ok", "skip", "warn", "error"]
OK: Level = "ok"
SKIP: Level = "skip"
WARN: Level = "warn"
ERROR: Level = "error"

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2

NO_DAEMON = "skipped: no daemon running (start it with starling run)"
CONNECT_TIMEOUT_S = 3.0  # per bootstrap address, DNS included
HANDSHAKE_TIMEOUT_S = 5.0  # per bootstrap peer whose TCP port answered: Noise (and the swarm key) on top
STATUS_TIMEOUT_S = 5.0  # a daemon that does not answer within this is reported as wedged
SKEW_WARN_S = 2.0
SKEW_ERROR_S = 60.0
HLC_MAX_DRIFT_S = 600.0  # protocols/hlc.py rejects records stamped further ahead than this
DELIVERY_ALLOWANCE_S = 1.0  # gossip delay assumed when a heartbeat's receipt time is known
MANY_RESTARTS = 3
SOLO_SHARE_WARN = 0.5  # own recent outer steps without a partner, above which mixing is too weak
SOLO_MIN_STEPS = 10  # recent outer steps needed before the solo share means anything
MAX_LISTED = 8  # peers named in one finding; the rest are counted
MAX_BOOTSTRAP_CHECKED = 32  # bounded work for a huge bootstrap file

NTP_FIX = (
    "keep every node's clock synchronised with NTP (`timedatectl set-ntp true`; check with "
    "`timedatectl` or `chronyc tracking`), on this machine and on the peers named"
)


@dataclass(frozen=True)
class Finding:
    """One verdict: which check, how bad, what was seen, and what to do about it ('' when nothing)."""

    check: str
    level: Level
    message: str
    fix: str = ""


def short(peer_id: str) -> str:
    return peer_id[:6] + ".." + peer_id[-6:] if len(peer_id) > 14 else peer_id


def _listed(items: list[str]) -> str:
    """At most MAX_LISTED items, comma-separated, with a count of the rest."""
    shown = ", ".join(items[:MAX_LISTED])
    return shown + (f" and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else "")


# ==========================================================================================================
# Local checks: the node directory, the config, the ports, the bootstrap peers
# ==========================================================================================================


def check_identity(home: Path, status: NodeStatus | None = None) -> tuple[list[Finding], str | None]:
    """The identity file exists, is readable, is private (0600) and holds a key. Returns its PeerID too.

    The key is loaded with libp2p's reader directly rather than `load_existing_identity`, which tightens a
    loose file mode as a side effect: the doctor reports, it does not modify.
    """
    from libp2p.identity_utils import load_identity

    from p2p.identity import peer_id_of

    path = Home(home).identity
    init = f"run `starling init --home {home}`"
    if not home.exists():
        return [
            Finding(
                "identity",
                ERROR,
                f"the node directory {home} does not exist",
                f"{init}, or point --home / STARLING_HOME at the node's directory",
            )
        ], None
    if not path.exists():
        return [
            Finding(
                "identity",
                ERROR,
                f"no identity file at {path}",
                f"{init} to create one (`starling run` also creates one on its first start)",
            )
        ], None
    findings: list[Finding] = []
    try:
        st = path.stat()
        with open(path, "rb"):
            pass
    except PermissionError:
        return [
            Finding(
                "identity",
                ERROR,
                f"{path} is not readable by this user",
                "run `starling doctor` as the user the daemon runs as",
            )
        ], None
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        findings.append(
            Finding(
                "identity",
                WARN,
                f"{path} is readable by other users (mode {mode:04o})",
                f"`chmod 600 {path}` (anyone who reads it can impersonate this node)",
            )
        )
    try:
        peer_id = str(peer_id_of(load_identity(path)))
    except (ValueError, OSError) as e:
        findings.append(
            Finding(
                "identity",
                ERROR,
                f"{path} is unreadable or corrupt ({type(e).__name__})",
                "restore it from a backup; or move it away and run `starling init` to start this node under a "
                "new PeerID (the swarm will see a new member)",
            )
        )
        return findings, None
    running = status.get("peer_id") if status is not None else None
    if running and running != peer_id:
        findings.append(
            Finding(
                "identity",
                WARN,
                f"the daemon runs as {running} but {path} holds {peer_id}",
                "the file was replaced after the daemon started; restart the daemon to use it (or restore the old one)",
            )
        )
    else:
        findings.append(Finding("identity", OK, f"PeerID {peer_id} ({path}, mode {mode:04o})"))
    return findings, peer_id


def check_disk(home: Path) -> list[Finding]:
    """HOME's file system has room for the next checkpoints (a full one fails every checkpoint, and a restart
    then resumes from far back)."""
    from p2p.fsutil import free_space_problem

    if not home.is_dir():
        return []
    problem = free_space_problem(home, Home(home).checkpoints)
    if problem is None:
        return []
    return [Finding("disk", ERROR, problem, f"free space there (`df -h {home}`), or move HOME to a larger file system")]


def check_home(home: Path) -> list[Finding]:
    """HOME is writable by this user: the daemon creates its lock, control socket, state, history and
    checkpoints there, and refuses to start otherwise. Asked with access(2), nothing is written. A missing
    HOME is the identity check's finding (`run` creates it)."""
    from p2p.fsutil import unwritable_reason

    if not home.is_dir():
        return []
    problem = unwritable_reason(home)
    if problem is None:
        return [Finding("home", OK, f"{home} is writable")]
    return [
        Finding(
            "home",
            ERROR,
            f"{home} cannot hold a running node: {problem}",
            f"run the daemon as the user that owns {home} (or `chown` it to that user); on a read-only mount, "
            "point --home / STARLING_HOME at a writable directory (under systemd: StateDirectory=)",
        )
    ]


def _option_types() -> dict[str, dict[str, Any]]:
    """{section: {option: dataclass field}} from the built-in defaults (the public way to list options)."""
    defaults = load_config(None, environ={})
    # The free-form [task] section has no fixed options: any STARLING_TASK_<NAME> is one of the task's.
    return {name: {f.name: f for f in dataclasses.fields(sec)} for name, sec in defaults.sections.items()
            if not getattr(sec, "free_form", False)}


def _config_fix(message: str, path: Path, environ: Mapping[str, str]) -> str:
    """A fix for a ConfigError: name the option, where its bad value came from, and what it expects."""
    options = _option_types()
    if "not valid TOML" in message:
        return (
            f'correct the syntax of {path} at the line shown (strings need quotes, lists are ["a", "b"]); '
            "`starling init --home <empty dir>` writes a commented example"
        )
    m = re.search(r"unknown section \[([^\]]*)\]", message)
    if m:
        close = difflib.get_close_matches(m.group(1), list(options), n=1)
        hint = f" (did you mean [{close[0]}]?)" if close else ""
        return f"remove or rename the section [{m.group(1)}] in {path}{hint}"
    # The option comes after the source the message may start with ("/x/config.toml: node.max_peers: ...").
    m = next((m for m in re.finditer(r"\b([a-z_]+)\.([a-z_]+)\b", message) if m.group(1) in options), None)
    if not m:
        return (
            f"correct {path} (`starling init --home <empty dir>` writes a commented example of every option)"
        )
    section, option = m.groups()
    if "unknown option" in message:
        close = difflib.get_close_matches(option, list(options.get(section, {})), n=1)
        hint = f" (did you mean {section}.{close[0]}?)" if close else ""
        return f"remove or rename `{option}` in the [{section}] section of {path}{hint}"
    env = f"{ENV_PREFIX}{section.upper()}_{option.upper()}"
    where = (
        f"the environment variable {env} (it overrides {path})"
        if env in environ
        else f"`{option}` in the [{section}] section of {path}"
    )
    f = options.get(section, {}).get(option)
    about = ""
    if f is not None:
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        about = f" ({section}.{option}: {f.metadata.get('help', '')}; default {default!r})"
    return f"correct {where}{about}"


def check_config(
    home: Path, environ: Mapping[str, str], overrides: Mapping[str, Any] | None = None
) -> tuple[list[Finding], Config | None]:
    """config.toml and STARLING_* variables load; typos in variable names are flagged (they are ignored).

    `overrides` are doctor's own command-line options (`--bootstrap`, ...), applied as `run` applies them."""
    path = Home(home).config
    findings = _check_environment(environ)
    try:
        cfg = load_config(home if home.is_dir() else None, environ=dict(environ), overrides=dict(overrides or {}))
    except ConfigError as e:
        return [Finding("config", ERROR, str(e), _config_fix(str(e), path, environ)), *findings], None
    source = f"{path} loads" if path.exists() else "no config.toml; using the built-in defaults"
    options = _option_types()
    names = {f"{ENV_PREFIX}{sec.upper()}_{opt.upper()}" for sec, fields in options.items() for opt in fields}
    from_env = sorted(k for k in environ if k in names)
    note = f"; overridden by {', '.join(from_env)}" if from_env else ""
    findings.insert(0, Finding("config", OK, f"{source}: swarm {cfg.node.swarm!r}{note}"))
    return findings, cfg


def _check_environment(environ: Mapping[str, str]) -> list[Finding]:
    """STARLING_<SECTION>_<OPTION> variables that name no option: load_config ignores them silently."""
    options = _option_types()
    findings = []
    for name in sorted(environ):
        for section, fields in options.items():
            prefix = f"{ENV_PREFIX}{section.upper()}_"
            if not name.startswith(prefix):
                continue
            option = name[len(prefix) :].lower()
            if option in fields:
                break
            close = difflib.get_close_matches(option, list(fields), n=1)
            hint = f"; did you mean {prefix}{close[0].upper()}?" if close else ""
            findings.append(
                Finding(
                    "config",
                    WARN,
                    f"environment variable {name} is not an option and is ignored",
                    f"rename or unset it{hint}",
                )
            )
            break
    return findings


def check_swarm_key(home: Path, cfg: Config) -> list[Finding]:
    """A configured (or present) swarm key file must be readable and well-formed, or the daemon refuses to start."""
    try:
        from p2p.auth import SwarmKeyError, read_swarm_key
    except ImportError:  # a build without private swarms
        return []
    configured = str(getattr(cfg.node, "swarm_key_file", "") or "")
    path = Home(home).swarm_key_file(configured)
    if not configured and not path.exists():
        return [Finding("swarm-key", OK, "open swarm (no swarm key)")]
    try:
        read_swarm_key(path)
    except SwarmKeyError as e:
        return [
            Finding(
                "swarm-key",
                ERROR,
                str(e),
                "copy the swarm's key file here (every member needs the same key), or correct node.swarm_key_file",
            )
        ]
    return [Finding("swarm-key", OK, f"private swarm, key {path}")]


@dataclass
class DaemonProbe:
    """What the control socket said: the status when a daemon answered, and the finding to print."""

    finding: Finding
    status: NodeStatus | None


def probe_daemon(home: Path, *, timeout: float = STATUS_TIMEOUT_S) -> DaemonProbe:
    """Ask the daemon for its status; tell "not running" apart from "running but not answering"."""
    from node.ops.control import ControlError, request_sync

    try:
        answer = request_sync(Home(home).control_socket, {"cmd": "status"}, timeout=timeout)
    except ControlError as e:
        holder = _lock_holder(home)
        if holder is not None:
            return DaemonProbe(
                Finding(
                    "daemon",
                    ERROR,
                    f"a daemon (pid {holder}) holds {home}, but its control socket does not answer: {e}",
                    "if it has just started, wait a few seconds; otherwise read its log (`journalctl -u starling`) "
                    "and restart it",
                ),
                None,
            )
        if str(e).startswith("no daemon is running"):
            return DaemonProbe(
                Finding("daemon", OK, f"no daemon running on {home}; the checks that need one are skipped"),
                None,
            )
        return DaemonProbe(
            Finding("daemon", ERROR, str(e), "run `starling doctor` as the daemon's user"), None
        )
    status = answer.get("status")
    if not answer.get("ok") or not isinstance(status, dict):
        return DaemonProbe(
            Finding(
                "daemon",
                ERROR,
                f"the daemon answered with an error: {answer.get('error')}",
                "read the daemon's log; restart it if the error persists",
            ),
            None,
        )
    up = status.get("uptime_s")
    up_text = f", up {up:.0f} s" if isinstance(up, (int, float)) else ""
    return DaemonProbe(
        Finding(
            "daemon",
            OK,
            f"running as {status.get('peer_id', '?')} in swarm "
            f"{status.get('swarm', '?')!r}, role {status.get('role', '?')}{up_text}",
        ),
        # This version's schema, or what an older daemon has of it: the checks read every key as optional.
        cast("NodeStatus", status),
    )


def _lock_holder(home: Path) -> str | None:
    """The pid written in HOME/daemon.lock when a live process holds the lock, else None."""
    try:
        fd = os.open(Home(home).lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.read(fd, 32).decode(errors="replace").strip() or "?"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _host_port(text: str) -> tuple[str, str, int] | None:
    """(protocol, host, port) of a /ip4|ip6|dns*/H/tcp/P multiaddr prefix, else None."""
    from p2p.addrs import AddrError, parse_multiaddr

    try:
        addr = parse_multiaddr(text)
        protos = [p.name for p in addr.protocols()]
        if len(protos) < 2 or protos[0] not in ("ip4", "ip6", "dns", "dns4", "dns6") or protos[1] != "tcp":
            return None
        return protos[0], str(addr.value_for_protocol(protos[0])), int(addr.value_for_protocol("tcp"))
    except (AddrError, ValueError):
        return None


def _family(proto: str) -> int:
    return {
        "ip4": socket.AF_INET,
        "dns4": socket.AF_INET,
        "ip6": socket.AF_INET6,
        "dns6": socket.AF_INET6,
    }.get(proto, socket.AF_UNSPEC)


def _bind_problem(host: str, port: int, family: int) -> tuple[str, str] | None:
    """Try to listen on host:port like the daemon would: None when that works, else (what went wrong,
    kind) with kind one of in-use, not-local, privileged, other (which picks the fix)."""
    try:
        infos = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot resolve {host} ({e.strerror or e})", "other"
    fam, kind, proto, _, sockaddr = infos[0]
    with socket.socket(fam, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as trio does: TIME_WAIT is not "in use"
        try:
            s.bind(sockaddr)
            s.listen(1)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {port} is already in use on {host}", "in-use"
            if e.errno == errno.EADDRNOTAVAIL:
                return f"{host} is not an address of this machine", "not-local"
            if e.errno == errno.EACCES:
                return f"port {port} needs privileges", "privileged"
            return f"cannot listen on {host}:{port} ({e.strerror or e})", "other"
    return None


def _bind_finding(option: str, label: str, host: str, port: int, family: int) -> Finding:
    if port == 0:
        return Finding("ports", OK, f"{label}: any free port is taken at start")
    problem = _bind_problem(host, port, family)
    if problem is None:
        return Finding("ports", OK, f"{label}: port {port} is free")
    what, kind = problem
    fixes = {
        "in-use": f"stop the program using it (`ss -ltnp 'sport = :{port}'` names it) or choose another port in {option}",
        "not-local": f"listen on 0.0.0.0 (or an address `ip addr` lists) in {option}; advertise a public address "
        "with node.announce instead",
        "privileged": f"use a port of 1024 or more in {option}, or grant the daemon CAP_NET_BIND_SERVICE",
    }
    return Finding("ports", ERROR, f"{label}: {what}", fixes.get(kind, f"check {option}"))


def check_ports(cfg: Config | None, status: NodeStatus | None) -> list[Finding]:
    """With a daemon: where it listens. Without one: every port it would need can be bound now."""
    if status is not None:
        addrs = [str(a) for a in status.get("addrs") or []]
        if not addrs:
            return [
                Finding(
                    "ports",
                    ERROR,
                    "the daemon runs but reports no listen address",
                    "read its log; restart it with a valid node.listen",
                )
            ]
        return [Finding("ports", OK, f"the daemon is running and listening on {_listed(addrs)}")]
    if cfg is None:
        return [Finding("ports", SKIP, "skipped: the config does not load")]
    findings = []
    hosts = []
    for text in cfg.node.listen:
        parsed = _host_port(text)
        if parsed is None:
            continue  # load_config has validated it; nothing here is unparsable
        proto, host, port = parsed
        hosts.append(host)
        findings.append(_bind_finding("node.listen (or --listen)", text, host, port, _family(proto)))
    if cfg.node.metrics_port:
        findings.append(
            _bind_finding(
                "node.metrics_port",
                f"metrics {cfg.node.metrics_host}:{cfg.node.metrics_port}",
                cfg.node.metrics_host,
                cfg.node.metrics_port,
                socket.AF_UNSPEC,
            )
        )
    sync = cfg.sections.get("sync")
    if sync is not None and getattr(sync, "datapath", False) and getattr(sync, "datapath_port", 0):
        # The daemon binds the side channel on loopback when it only listens on loopback, else everywhere.
        host = "127.0.0.1" if hosts and all(h.startswith("127.") for h in hosts) else "0.0.0.0"
        findings.append(
            _bind_finding(
                "sync.datapath_port",
                f"data path {host}:{sync.datapath_port}",
                host,
                sync.datapath_port,
                socket.AF_INET,
            )
        )
    return findings


def bootstrap_addresses(cfg: Config, label: str = "node.bootstrap") -> tuple[list[tuple[str, str]], list[Finding]]:
    """[(address, where it came from)] from node.bootstrap (named `label`) and the bootstrap files, plus file
    problems."""
    from p2p.addrs import AddrError, parse_bootstrap

    out = [(a, label) for a in cfg.node.bootstrap]
    findings = []
    for name in cfg.node.bootstrap_files:
        path = Path(name)
        try:
            lines = path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            findings.append(
                Finding(
                    "bootstrap",
                    WARN,
                    f"bootstrap file {path} does not exist (yet)",
                    "check the path; the node that writes it (its node.addr_file) must be running. "
                    "The daemon waits for the file and re-reads it",
                )
            )
            continue
        except OSError as e:
            findings.append(
                Finding(
                    "bootstrap",
                    ERROR,
                    f"cannot read bootstrap file {path}: {e.strerror or e}",
                    "make it readable by the daemon's user",
                )
            )
            continue
        for n, line in enumerate(lines, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            try:
                parse_bootstrap(text)
            except AddrError as e:
                findings.append(
                    Finding(
                        "bootstrap",
                        WARN,
                        f"{path}:{n}: skipped: {e}",
                        "write one /ip4/<address>/tcp/<port>/p2p/<peer id> per line",
                    )
                )
                continue
            out.append((text, str(path)))
    return out, findings


async def _tcp_connect(host: str, port: int, family: int) -> str | None:
    """None when a TCP connection to host:port opens, else why not (no deadline here: the caller sets it)."""
    try:
        infos = await trio.socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"cannot resolve {host} ({e.strerror or e})"
    why = "no address"
    for fam, kind, proto, _, sockaddr in infos:
        with trio.socket.socket(fam, kind, proto) as sock:
            try:
                await sock.connect(sockaddr)
                return None
            except OSError as e:
                why = (
                    "connection refused: nothing listens there"
                    if e.errno == errno.ECONNREFUSED
                    else (e.strerror or str(e))
                )
    return why


async def _probe_all(targets: list[tuple[str, int, int]], timeout: float) -> list[str | None]:
    """Connect to every (host, port, family) concurrently, each within `timeout` seconds."""
    results: list[str | None] = [None] * len(targets)

    async def one(i: int, host: str, port: int, family: int) -> None:
        results[i] = f"no answer within {timeout:g} s (a firewall drops the packets, or the host is down)"
        with trio.move_on_after(timeout):
            results[i] = await _tcp_connect(host, port, family)

    async with trio.open_nursery() as nursery:
        for i, (host, port, family) in enumerate(targets):
            nursery.start_soon(one, i, host, port, family)
    return results


async def _handshake_all(
    targets: list[tuple[str, str]], key_pair: Any, psk: str | None, timeout: float
) -> list[tuple[str | None, str]]:
    """Dial every (multiaddr, PeerID) as the daemon would (this identity, this swarm key), each within
    `timeout`: [(None when the libp2p handshake completed, else why not; the kind of failure)], kind one of
    wrong_peer, key, closed, timeout, other. Connections made are closed again."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    from p2p.addrs import parse_bootstrap
    from p2p.auth import AccessControl
    from p2p.host import build_host

    host = build_host(key_pair or create_new_key_pair(), psk=psk, dial_timeout=timeout)
    access = AccessControl(keyed=psk is not None)
    access.install(host)
    results: list[tuple[str | None, str]] = [(None, "")] * len(targets)

    async def one(i: int, text: str) -> None:
        info = parse_bootstrap(text)
        error = f"TCP port open, but no libp2p handshake within {timeout:g} s (is a Starling node listening there?)"
        with trio.move_on_after(timeout):
            try:
                await host.connect(info)
                results[i] = (None, "")
                with contextlib.suppress(Exception):
                    await host.disconnect(info.peer_id)
                return
            except Exception as e:  # py-libp2p raises many types; the handshake's verdict is below
                error = f"{type(e).__name__}: {e}"[:200]
        failure = access.dial_failures.get(str(info.peer_id))
        if failure is not None:  # the handshake's own verdict (p2p/auth.py)
            kind = {"wrong_peer": "wrong_peer", "closed": "closed"}.get(failure.kind, "key")
        else:
            kind = "timeout" if error.startswith("TCP port open") else "other"
        results[i] = (access.explain_dial(str(info.peer_id)) or error, kind)

    async with host.run(listen_addrs=[]), trio.open_nursery() as nursery:
        for i, (text, _) in enumerate(targets):
            nursery.start_soon(one, i, text)
    return results


def _handshake_fix(kind: str, psk: str | None) -> str:
    if kind == "wrong_peer":
        return ("another node answers at that address: put its PeerID after /p2p/ (the one named above, if that is the "
                "node meant; `starling status` on the bootstrap node prints its own)")
    if kind == "key":
        have = "this node has a swarm key" if psk else "this node has no swarm key"
        return (f"{have}: give every node of the swarm the same HOME/swarm.key (`starling init --swarm-key FILE`, or "
                "node.swarm_key_file), or none on any, and restart the daemons")
    if kind == "closed":
        return "add this node's PeerID to node.allow_peers on the bootstrap node (or empty its list)"
    return ("check that a Starling node of this version listens at that address (`starling status` there prints its "
            "addresses)")


def effective_bootstrap(cfg: Config, status: NodeStatus | None, *, given: bool) -> tuple[Config, str]:
    """The bootstrap sources to check and a label for them.

    `given`: doctor's own `--bootstrap`/`--bootstrap-file` are in `cfg` already; they win. Otherwise a
    running daemon's own list (its `--bootstrap` flags included, which no config file shows) replaces the
    config's: doctor used to report "none configured" for a node started with `run --bootstrap`.
    """
    if given:
        return cfg, "--bootstrap"
    running = status.get("bootstrap") if status is not None else None
    if not isinstance(running, dict):
        return cfg, "node.bootstrap"  # no daemon, or one too old to say
    addrs, files = running.get("addrs"), running.get("files")
    if not (isinstance(addrs, list) and isinstance(files, list) and all(isinstance(a, str) for a in addrs + files)):
        return cfg, "node.bootstrap"
    if addrs == cfg.node.bootstrap and files == cfg.node.bootstrap_files:
        return cfg, "node.bootstrap"
    node = dataclasses.replace(cfg.node, bootstrap=addrs, bootstrap_files=files)
    try:
        node.validate()
    except ValueError:
        return cfg, "node.bootstrap"
    return dataclasses.replace(cfg, sections={**cfg.sections, "node": node}), "the running daemon's --bootstrap"


def check_bootstrap(
    cfg: Config | None,
    status: NodeStatus | None,
    own_peer_id: str | None,
    *,
    timeout: float = CONNECT_TIMEOUT_S,
    label: str = "node.bootstrap",
    key_pair: Any = None,
    psk: str | None = None,
    handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
) -> list[Finding]:
    """Each bootstrap peer is connected, or answers on TCP and completes a libp2p handshake; a node with
    none is told so, and a running daemon connected to nobody although it has bootstrap peers is an error.

    A TCP answer proves the host and port are reachable, not that the right node listens there: the
    handshake is made as the daemon makes it, with `key_pair` (this node's identity; a throwaway one if
    None) and `psk` (its swarm key), so a wrong PeerID, a swarm key mismatch or an allowlist that leaves
    this node out is named. `label` names where `cfg.node.bootstrap` came from (see `effective_bootstrap`).
    """
    from p2p.addrs import parse_bootstrap

    if cfg is None:
        return [Finding("bootstrap", SKIP, "skipped: the config does not load")]
    addrs, findings = bootstrap_addresses(cfg, label)
    connected = set(status.get("connected_peers") or []) if status is not None else set()
    if not addrs:
        if cfg.node.bootstrap_files and not findings:  # the files exist but list nothing (yet)
            files = _listed(cfg.node.bootstrap_files)
            findings.append(
                Finding(
                    "bootstrap",
                    WARN,
                    f"the bootstrap files list no address: {files}",
                    "check that the node writing them (its node.addr_file) is running",
                )
            )
        if cfg.node.bootstrap_files:
            return findings
        if connected:
            findings.append(Finding("bootstrap", OK, f"none configured; {len(connected)} peers connected"))
        else:
            findings.append(
                Finding(
                    "bootstrap",
                    WARN,
                    "no bootstrap peers configured and no peers connected",
                    "a lone node: give --bootstrap (or node.bootstrap / node.bootstrap_files) "
                    "unless this is the first node of the swarm",
                )
            )
        return findings
    checked = addrs[:MAX_BOOTSTRAP_CHECKED]
    reached = 0  # addresses connected or answering on TCP
    to_probe: list[tuple[str, str, tuple[str, str, int]]] = []
    verdicts: list[Finding] = []
    for text, source in checked:
        peer = parse_bootstrap(text).peer_id.to_base58()
        hp = _host_port(text)
        if peer == own_peer_id:
            verdicts.append(Finding("bootstrap", OK, f"{text}: this node itself (ignored)"))
        elif peer in connected:
            reached += 1
            verdicts.append(Finding("bootstrap", OK, f"{text}: connected"))
        elif hp is None:
            verdicts.append(Finding("bootstrap", SKIP, f"{text}: not a TCP address; not checked"))
        else:
            to_probe.append((text, source, hp))
    results = trio.run(_probe_all, [(h, p, _family(proto)) for _, _, (proto, h, p) in to_probe], timeout)
    failed: list[tuple[str, str, str, str]] = []  # (address, source, why, fix)
    tcp_fix = ("check the address, the firewall on both sides, and that the bootstrap node runs "
               "(`starling status` there prints its addresses)")
    open_ports: list[tuple[str, str]] = []
    for (text, source, _), why in zip(to_probe, results, strict=True):
        if why is None:
            open_ports.append((text, source))
        else:
            failed.append((text, source, why, tcp_fix))
    if open_ports:
        shaken = trio.run(_handshake_all, open_ports, key_pair, psk, handshake_timeout)
        for (text, source), (why, kind) in zip(open_ports, shaken, strict=True):
            if why is None:
                reached += 1
                verdicts.append(Finding("bootstrap", OK, f"{text}: libp2p handshake completed (its PeerID and the "
                                                         "swarm key match)"))
            else:
                failed.append((text, source, why, _handshake_fix(kind, psk)))
    # An unreachable bootstrap peer is fatal only when it leaves the node with no way into the swarm.
    stranded = not reached and not connected
    for text, source, why, fix in failed:
        verdicts.append(Finding("bootstrap", ERROR if stranded else WARN, f"{text} (from {source}): {why}", fix))
    if len(addrs) > len(checked):
        verdicts.append(
            Finding("bootstrap", SKIP, f"{len(addrs) - len(checked)} more bootstrap addresses not checked")
        )
    return findings + verdicts + _isolated_daemon(status, addrs, own_peer_id)


def _isolated_daemon(status: NodeStatus | None, addrs: list[tuple[str, str]], own_peer_id: str | None) -> list[Finding]:
    """An error when the running daemon has bootstrap peers (other than itself) and is connected to nobody,
    with what its own last dial of each said (`status`: bootstrap.peers)."""
    from p2p.addrs import parse_bootstrap

    if status is None or status.get("connected_peers"):
        return []
    others = [text for text, _ in addrs if parse_bootstrap(text).peer_id.to_base58() != own_peer_id]
    if not others:
        return []
    boot = status.get("bootstrap")
    peers = boot.get("peers") if isinstance(boot, dict) else None
    causes = [f"{short(str(p.get('peer_id', '?')))}: {p['last_error']}" for p in peers or []
              if isinstance(p, dict) and p.get("last_error")]
    up = _num(status.get("uptime_s"))
    if not causes and up is not None and up < 15:
        return [Finding("connections", WARN, f"the daemon (up {up:.0f} s) is not connected to any peer yet",
                        "run `starling doctor` again in a few seconds")]
    said = f"; its last dials: {'; '.join(causes[:MAX_LISTED])}" if causes else ""
    return [
        Finding(
            "connections",
            ERROR,
            f"the daemon is connected to no peer although it has {len(others)} bootstrap peer"
            f"{'s' * (len(others) != 1)}{said}",
            "fix the bootstrap findings above; `starling status` shows each bootstrap peer's last dial error",
        )
    ]


# ==========================================================================================================
# Status checks: pure functions of the daemon's status dict (keys may be absent; never raise on them)
# ==========================================================================================================


def _members(status: NodeStatus) -> list[MemberStatus]:
    return [m for m in status.get("members") or [] if isinstance(m, dict)]


def _peers(status: NodeStatus, states: tuple[str, ...] = ("alive", "suspect")) -> list[MemberStatus]:
    """Other members in one of `states`."""
    return [m for m in _members(status) if not m.get("self") and m.get("state") in states]


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def check_reachability(status: NodeStatus) -> list[Finding]:
    """Whether peers can dial this node, as the daemon's NAT detection found."""
    reach = status.get("reachability")
    paths = [p.get("path") for p in status.get("peers") or [] if isinstance(p, dict)]
    relayed = sum(1 for p in paths if isinstance(p, str) and "relay" in p)
    via = f" ({relayed} of {len(paths)} connections go through a relay)" if relayed else ""
    if reach is None:
        return [Finding("reachability", SKIP, "skipped: this daemon does not report its reachability")]
    if reach == "public":
        return [Finding("reachability", OK, f"public: peers can dial this node directly{via}")]
    if reach == "unknown":
        return [
            Finding("reachability", OK, "not yet determined (the node needs connected peers to dial it back)")
        ]
    port = next((hp[2] for a in status.get("addrs") or [] if (hp := _host_port(str(a)))), None)
    port_text = str(port) if port else "<port>"
    return [
        Finding(
            "reachability",
            WARN,
            f"{reach}: peers outside this network cannot dial this node; it is reached only through its own "
            f"outbound connections and relays, which makes averaging slower{via}",
            f"to accept direct connections, forward TCP port {port_text} on the router/firewall to this machine and "
            f'set node.announce = ["/ip4/<public IP>/tcp/{port_text}"] (or --announce). Otherwise nothing is '
            "required: relays carry the traffic",
        )
    ]


def _skew_estimate(member: MemberStatus, heartbeat_s: float) -> tuple[float, str] | None:
    """(estimated seconds the member's clock is ahead of ours, negative = behind; how it was estimated).

    Best case the status gives the author's heartbeat time and our receipt time: skew ~ heartbeat -
    received_at (ahead is a lower bound, since delivery takes time; behind allows a heartbeat interval plus
    DELIVERY_ALLOWANCE_S).
    Otherwise it gives `last_seen_s`, the age of min(heartbeat, receipt): an alive member heartbeats
    every `heartbeat_s`, so an age beyond two intervals (one may be lost) means its heartbeat times
    lag our clock, i.e. its clock is at least that much behind. A clock that runs ahead is invisible in
    that view (the receipt time caps last_seen) until records are rejected as too far ahead.
    """
    hb, received = _num(member.get("heartbeat")), _num(member.get("received_at"))
    if hb is not None and received is not None:
        raw = hb - received
        # A record may reach us up to a heartbeat late by anti-entropy (from a third node) and a moment
        # later still on a busy machine: only a lag beyond that is blamed on the member's clock.
        allowance = DELIVERY_ALLOWANCE_S + heartbeat_s
        return (raw if raw >= 0 else min(0.0, raw + allowance)), "heartbeat vs receipt time"
    age = _num(member.get("last_seen_s"))
    if age is None:
        return None
    return -max(0.0, age - 2 * heartbeat_s), f"its latest heartbeat looks {age:.1f} s old"


def check_clock_skew(status: NodeStatus, *, heartbeat_s: float = 2.0) -> list[Finding]:
    """Peers whose clock differs from ours: > SKEW_WARN_S warns, > SKEW_ERROR_S is an error.

    Skew matters because liveness and the CRDT's hybrid logical clock use wall time: a peer far behind
    looks dead, one more than HLC_MAX_DRIFT_S ahead has its records rejected. Candidates are alive
    members and members connected right now although they look silent (a clock far behind makes a
    live peer look suspect or gone).
    """
    findings = []
    rejected = (status.get("swarm_totals") or {}).get("rejected") or {}
    n_rejected = rejected.get("clock_skew", 0) if isinstance(rejected, dict) else 0
    if n_rejected:
        findings.append(
            Finding(
                "clock",
                ERROR,
                f"{n_rejected} records were rejected because their timestamps were more than {HLC_MAX_DRIFT_S:.0f} s "
                "ahead of this node's clock (a peer's clock runs ahead, or this one is behind)",
                NTP_FIX,
            )
        )
    connected = set(status.get("connected_peers") or [])
    candidates = [
        m
        for m in _members(status)
        if not m.get("self")
        and (
            m.get("state") == "alive"
            or (m.get("state") in ("suspect", "gone") and m.get("peer_id") in connected)
        )
    ]
    exact = False
    skewed: list[tuple[float, MemberStatus, str]] = []
    for m in candidates:
        estimate = _skew_estimate(m, heartbeat_s)
        if estimate is None:
            continue
        skew, how = estimate
        exact = exact or how.startswith("heartbeat vs")
        if abs(skew) > SKEW_WARN_S:
            skewed.append((skew, m, how))
    # One line per skewed peer, the worst first; past MAX_LISTED the rest share one line, or a clock off on
    # this machine (every peer looks skewed) would print hundreds of lines at hundreds of members.
    skewed.sort(key=lambda item: -abs(item[0]))
    for skew, m, how in skewed[:MAX_LISTED]:
        side = "ahead of" if skew > 0 else "behind"
        findings.append(
            Finding(
                "clock",
                ERROR if abs(skew) > SKEW_ERROR_S else WARN,
                f"{short(str(m.get('peer_id', '?')))}: its clock is about {abs(skew):.1f} s {side} ours ({how}"
                f"{'' if m.get('state') == 'alive' else ', so it looks ' + str(m.get('state'))})",
                NTP_FIX + " (or its heartbeats are delayed: check its log and network)",
            )
        )
    rest = skewed[MAX_LISTED:]
    if rest:
        low, high = abs(rest[-1][0]), abs(rest[0][0])
        ours = " (most of the swarm: is this machine's clock the one that is off?)" if len(skewed) > len(
            candidates) // 2 else ""
        findings.append(
            Finding(
                "clock",
                ERROR if high > SKEW_ERROR_S else WARN,
                f"{len(rest)} more peers' clocks differ from ours by {low:.1f} to {high:.1f} s, "
                f"{len(skewed)} of {len(candidates)} live peers in all{ours}: "
                f"{_listed([short(str(m.get('peer_id', '?'))) for _, m, _ in rest])}",
                NTP_FIX,
            )
        )
    if not findings:
        note = (
            "" if exact or not candidates else "; a clock running ahead shows only once records are rejected"
        )
        seen = (
            f"among {len(candidates)} live peers{note}" if candidates else "(no live peers to compare with)"
        )
        findings.append(Finding("clock", OK, f"no skew above {SKEW_WARN_S:g} s seen {seen}"))
    return findings


def check_versions(status: NodeStatus, *, installed: str | None = None) -> list[Finding]:
    """This daemon's version against the installed one and against the peers'."""
    ours = status.get("version")
    findings = []
    if installed and ours and installed != ours:
        findings.append(
            Finding(
                "versions",
                WARN,
                f"the daemon runs {ours} but {installed} is installed",
                "restart the daemon to run the installed version",
            )
        )
    others = [
        f"{short(str(m.get('peer_id', '?')))} runs {m.get('version')}"
        for m in _peers(status)
        if m.get("version") and m.get("version") != ours
    ]
    if others:
        findings.append(
            Finding(
                "versions",
                WARN,
                f"{len(others)} peers run another version than ours ({ours}): {_listed(others)}",
                "run the same Starling version on every node (upgrade the older ones)",
            )
        )
    if not findings:
        n = len(_peers(status))
        findings.append(
            Finding("versions", OK, f"{ours}, same as all {n} live peers" if n else f"{ours} (no live peers)")
        )
    return findings


def check_manifest(status: NodeStatus) -> list[Finding]:
    """This node trains the swarm's run (task, model, optimizer, protocol); peers that do not are named."""
    totals = status.get("swarm_totals") or {}
    me: MemberStatus | dict[str, Any] = next((m for m in _members(status) if m.get("self")), {})
    ours = str(me.get("manifest_hash") or "")
    findings = []
    if totals.get("manifest_error"):
        findings.append(
            Finding(
                "manifest",
                ERROR,
                str(totals["manifest_error"]),
                "start this node with the swarm's train.* options (task, model, optimizer: compare "
                "`starling status --json` swarm_totals.manifest_hash on a working member), or give it its own "
                "node.swarm name",
            )
        )
    incompatible = set(totals.get("incompatible_peers") or [])
    odd = [m for m in _peers(status) if ours and m.get("manifest_hash") and m.get("manifest_hash") != ours]
    named = {str(m.get("peer_id")): str(m.get("manifest_hash") or "?") for m in odd}
    for m in _members(status):
        if m.get("peer_id") in incompatible:
            named.setdefault(str(m.get("peer_id")), str(m.get("manifest_hash") or "?"))
    for peer in incompatible - set(named):
        named[str(peer)] = "?"
    # What differs, as the state protocol's refusal said (a newer daemon reports it): the swarm or the manifest.
    differs: dict[str, Mapping[str, Any]] = {
        str(d.get("peer_id")): d for d in totals.get("incompatible") or [] if isinstance(d, dict)
    }

    def what(peer: str, manifest: str) -> str:
        said = differs.get(peer) or {}
        if said.get("field") == "swarm":
            return f"{short(peer)} (swarm {said.get('theirs')!r})"
        return f"{short(peer)} (manifest {str(said.get('theirs') or manifest)[:12]})"

    if named:
        listed = [what(p, h) for p, h in sorted(named.items())]
        findings.append(
            Finding(
                "manifest",
                WARN,
                f"{len(named)} peers are incompatible with this node (manifest {ours[:12] or 'none'}), "
                f"so they are never averaged with: {_listed(listed)}",
                "those nodes must run the same task, model and optimizer config as this swarm, or use their own "
                "node.swarm name",
            )
        )
    if not findings:
        swarm = totals.get("manifest_hash")
        if ours:
            findings.append(
                Finding(
                    "manifest",
                    OK,
                    f"this node's manifest {ours[:12]} matches the swarm's"
                    if not swarm or swarm == ours
                    else f"this node's manifest is {ours[:12]}",
                )
            )
        else:
            findings.append(
                Finding(
                    "manifest",
                    OK,
                    "no run manifest (network-only node, or the trainer is starting)"
                    + (f"; the swarm's is {str(swarm)[:12]}" if swarm else ""),
                )
            )
    return findings


def check_training(status: NodeStatus) -> list[Finding]:
    """The trainer runs; a failed or flapping worker is reported with its last error."""
    tr = status.get("training")
    if not isinstance(tr, dict) or not tr:
        why = "a network-only node" if status.get("role") == "network-only" else "no trainer reported"
        return [Finding("training", SKIP, f"skipped: {why}")]
    state, error = tr.get("state", "?"), tr.get("error")
    restarts = int(_num(tr.get("restarts")) or 0)
    log_fix = "read the daemon's log (`journalctl -u starling`) for the worker's traceback"
    disk: list[Finding] = []
    if tr.get("checkpoint_error"):
        disk.append(Finding(
            "training",
            ERROR,
            f"checkpoints fail ({tr.get('checkpoint_failures') or 1} in a row), latest {tr['checkpoint_error']}; "
            f"training goes on, but a restart resumes from step {tr.get('checkpoint_step') or 'of the last one written'}",
            "free space on the file system of HOME (`df -h HOME`; old exports, logs), or move HOME to a larger one",
        ))
    if state == "failed":
        return [
            Finding(
                "training",
                ERROR,
                f"training stopped: {error}",
                f"fix the cause above ({log_fix}), then restart the daemon",
            )
        ]
    if disk:
        return disk
    if restarts >= MANY_RESTARTS:
        return [
            Finding(
                "training",
                WARN,
                f"the training worker restarted {restarts} times; last exit: {error}",
                f"{log_fix}; common causes are running out of memory (smaller train.batch_size) or "
                "a wrong train.device",
            )
        ]
    if state == "restarting":
        return [Finding("training", WARN, f"the training worker is restarting after: {error}", log_fix)]
    loss = _num(tr.get("loss"))
    progress = f"step {tr.get('step', '?')}, outer step {tr.get('outer_step', '?')}" + (
        f", loss {loss:.4f}" if loss is not None else ""
    )
    again = f"; restarted {restarts} times, last: {error}" if restarts else ""
    return [Finding("training", OK, f"{state}: {progress}{again}")]


def _island_text(island: list[str], steps: Mapping[str, Any]) -> str:
    """One island as `{a, b, c} (outer steps 40-44)`: the step range hints at speed classes drifting apart."""
    numbers = [int(n) for p in island if (n := _num(steps.get(p))) is not None]
    span = ""
    if numbers:
        low, high = min(numbers), max(numbers)
        span = f" (outer step {low})" if low == high else f" (outer steps {low}-{high})"
    return "{" + _listed([short(p) for p in island]) + "}" + span


ISLANDS_FIX = (
    "trainers of different speeds in different outer-step ranges? check that every node runs the same "
    "Starling version with sync.pace = swarm, and that sync.max_step_gap covers the spread of outer steps; "
    "check that the islands can reach each other directly (`starling status`: the path column of peers, "
    "and `nat:`; pairs reachable only through a relay never average unless sync.allow_relay_bulk)"
)


def check_pairing(status: NodeStatus) -> list[Finding]:
    """The alive trainers average across one connected group, and this node does not mostly step solo.

    Islands are groups of trainers that only pair among themselves: each trains its own model, which no
    single node's loss shows (see node/ops/islands.py). Unpaired trainers (no partner yet, as in a fresh
    swarm) are named but not blamed.
    """
    members = _members(status)
    if not members:
        return [Finding("pairing", SKIP, "skipped: this daemon reports no swarm members")]
    graph = pairing_graph(members)
    findings = _island_findings(graph, {str(m.get("peer_id")): m.get("outer_step") for m in members})
    findings += _solo_findings(status, graph.paired + len(graph.unpaired))
    if not findings:
        findings.append(Finding("pairing", OK, _pairing_ok_text(graph)))
    return findings


def _island_findings(graph: PairingGraph, steps: Mapping[str, Any]) -> list[Finding]:
    """A warning naming every island when the paired trainers form more than one group."""
    if not graph.split:
        return []
    listed = " and ".join(_island_text(island, steps) for island in graph.islands[:MAX_LISTED])
    if len(graph.islands) > MAX_LISTED:  # a swarm of hundreds shattered into pairs: one line, not a page
        listed += f" and {len(graph.islands) - MAX_LISTED} more islands"
    return [
        Finding(
            "pairing",
            WARN,
            f"the swarm's pairing graph has split into {len(graph.islands)} islands of trainers that never "
            f"averaged with each other over their recent outer steps: {listed}; each island trains its own model",
            ISLANDS_FIX,
        )
    ]


def _solo_findings(status: NodeStatus, trainers: int) -> list[Finding]:
    """A warning when this node took most of its recent outer steps solo although others could pair."""
    sync = status.get("sync")
    mixing = sync.get("mixing") if isinstance(sync, dict) else None
    if not isinstance(mixing, dict):
        return []
    share, steps = _num(mixing.get("solo_share")), _num(mixing.get("outer_steps"))
    me: MemberStatus | dict[str, Any] = next((m for m in _members(status) if m.get("self")), {})
    others = trainers - (1 if me.get("state") == "alive" and me.get("role") == "trainer" else 0)
    if share is None or steps is None or steps < SOLO_MIN_STEPS or share <= SOLO_SHARE_WARN or others < 1:
        return []
    return [
        Finding(
            "pairing",
            WARN,
            f"this node stepped solo in {share:.0%} of its last {steps:.0f} outer steps although {others} other "
            f"trainer{' is' if others == 1 else 's are'} alive: it barely mixes with the swarm",
            "find why partners are not eligible: outer steps more than sync.max_step_gap apart (`starling status`: "
            "the members' outer column), no direct path (`starling status`: path, `nat:`), another version or "
            "manifest (see the checks above), or bans (`starling status --json`: sync.banned)",
        )
    ]


def _pairing_ok_text(graph: PairingGraph) -> str:
    """The healthy verdict, with the unpaired trainers counted (a fresh swarm has only those)."""
    unpaired = f"; {len(graph.unpaired)} with no recent partner: {_listed([short(p) for p in graph.unpaired])}"
    if not graph.islands:
        alive = len(graph.unpaired)
        if not alive:
            return "pairing graph: no alive trainers"
        if alive == 1:
            return "pairing graph: one alive trainer, nobody to pair with"  # as `starling status` says
        return f"pairing graph: no pairs in the recent outer steps of the {alive} alive trainer{'s' * (alive != 1)}"
    return f"pairing graph: one island of {graph.paired} trainers" + (unpaired if graph.unpaired else "")


# ==========================================================================================================
# Running all checks, printing them
# ==========================================================================================================


def _installed_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("starling")
    except PackageNotFoundError:
        return None


def _dialling_identity(home: Path, cfg: Config | None) -> tuple[Any, str | None]:
    """This node's key pair and swarm key, as the daemon would dial with them; (None, None) for what cannot be
    read (a throwaway identity is used then; the identity and swarm-key checks report why)."""
    from libp2p.identity_utils import load_identity

    from p2p.auth import SwarmKeyError, read_swarm_key

    identity = Home(home).identity
    try:
        key_pair = load_identity(identity) if identity.is_file() else None
    except (ValueError, OSError):
        key_pair = None
    configured = str(getattr(cfg.node, "swarm_key_file", "") or "") if cfg is not None else ""
    path = Home(home).swarm_key_file(configured)
    try:
        psk = read_swarm_key(path) if configured or path.exists() else None
    except SwarmKeyError:
        psk = None
    return key_pair, psk


def run_checks(
    home: Path,
    *,
    environ: Mapping[str, str] | None = None,
    connect_timeout: float = CONNECT_TIMEOUT_S,
    overrides: Mapping[str, Any] | None = None,
) -> list[Finding]:
    """Every check, in report order. `overrides`: doctor's command-line options, as "section.option"."""
    environ = os.environ if environ is None else environ
    overrides = overrides or {}
    probe = probe_daemon(home)
    status = probe.status
    identity, own_peer_id = check_identity(home, status)
    config, cfg = check_config(home, environ, overrides)
    findings = [probe.finding, *identity, *check_home(home), *check_disk(home), *config]
    if cfg is not None:
        findings += check_swarm_key(home, cfg)
    findings += check_ports(cfg, status)
    given = "node.bootstrap" in overrides or "node.bootstrap_files" in overrides
    cfg_boot, label = effective_bootstrap(cfg, status, given=given) if cfg is not None else (None, "node.bootstrap")
    key_pair, psk = _dialling_identity(home, cfg)
    findings += check_bootstrap(
        cfg_boot, status, own_peer_id or (status.get("peer_id") if status is not None else None),
        timeout=connect_timeout, label=label, key_pair=key_pair, psk=psk,
    )
    heartbeat_s = cfg.node.heartbeat_s if cfg is not None else 2.0
    status_checks: list[tuple[str, Callable[[NodeStatus], list[Finding]]]] = [
        ("reachability", check_reachability),
        ("clock", lambda st: check_clock_skew(st, heartbeat_s=heartbeat_s)),
        ("versions", lambda st: check_versions(st, installed=_installed_version())),
        ("manifest", check_manifest),
        ("training", check_training),
        ("pairing", check_pairing),
    ]
    for name, check in status_checks:
        findings += check(status) if status is not None else [Finding(name, SKIP, NO_DAEMON)]
    return findings


_LABELS = {OK: "ok", SKIP: "skip", WARN: "WARN", ERROR: "ERROR"}


def render_report(home: Path, findings: list[Finding]) -> str:
    """One line per finding; a problem gets an indented `fix:` line under it."""
    width = max((len(f.check) for f in findings), default=8)
    lines = [f"starling doctor: {home}"]
    for f in findings:
        lines.append(f"  {_LABELS[f.level]:<5}  {f.check:<{width}}  {f.message}")
        if f.fix and f.level in (WARN, ERROR):
            lines.append(f"  {'':<5}  {'':<{width}}    fix: {f.fix}")
    errors = sum(f.level == ERROR for f in findings)
    warnings = sum(f.level == WARN for f in findings)
    lines.append("")
    lines.append(f"{errors} error{'s' * (errors != 1)}, {warnings} warning{'s' * (warnings != 1)}")
    return "\n".join(lines)


def report_json(home: Path, findings: list[Finding]) -> dict[str, Any]:
    return {
        "home": str(home),
        "errors": sum(f.level == ERROR for f in findings),
        "warnings": sum(f.level == WARN for f in findings),
        "findings": [dataclasses.asdict(f) for f in findings],
    }


def doctor_main(args_home: str | None, as_json: bool = False, overrides: Mapping[str, Any] | None = None) -> int:
    """`starling doctor [--home DIR] [--json] [--bootstrap ADDR] [--bootstrap-file PATH]`: 0 when nothing is
    wrong, 1 when a finding is an error, 2 when HOME is not usable as a node directory at all.
    `overrides` ("section.option" -> value) are applied to the config as `run` applies its flags."""
    home = resolve_home(args_home)
    if home.exists() and not home.is_dir():
        print(
            f"starling: error: {home} is not a directory (--home must name the node's directory)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    findings = run_checks(home, overrides=overrides)
    if as_json:
        print(json.dumps(report_json(home, findings), sort_keys=True))
    else:
        print(render_report(home, findings))
    return EXIT_PROBLEMS if any(f.level == ERROR for f in findings) else EXIT_OK
