"""`starling doctor`'s local checks, which need no daemon: the identity file, HOME (writable, room for
checkpoints), the config (file and STARLING_* environment), the swarm key, whether a daemon answers on the
control socket, and whether the listen ports can be bound.

They read files and bind sockets, and never modify anything: the identity file's mode is reported, not
tightened (node/ops/doctor.py says why the doctor only reads). The bootstrap peers, which need the network,
are node/ops/doctor_bootstrap.py's.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import fcntl
import os
import re
import socket
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from node.config.home import Home
from node.config.load import ENV_PREFIX, Config, ConfigError, load_config
from node.ops.doctor_findings import (
    ERROR,
    OK,
    SKIP,
    WARN,
    Finding,
    address_family,
    host_port,
    list_some,
)
from node.status_schema import NodeStatus

STATUS_TIMEOUT_S = 5.0  # a daemon that does not answer within this is reported as wedged


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
    findings = check_environment(environ)
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


def check_environment(environ: Mapping[str, str]) -> list[Finding]:
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
        return [Finding("ports", OK, f"the daemon is running and listening on {list_some(addrs)}")]
    if cfg is None:
        return [Finding("ports", SKIP, "skipped: the config does not load")]
    findings = []
    hosts = []
    for text in cfg.node.listen:
        parsed = host_port(text)
        if parsed is None:
            continue  # load_config has validated it; nothing here is unparsable
        proto, host, port = parsed
        hosts.append(host)
        findings.append(_bind_finding("node.listen (or --listen)", text, host, port, address_family(proto)))
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
