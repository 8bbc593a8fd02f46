"""`starling doctor`'s bootstrap check: whether the bootstrap peers answer on TCP and then complete a libp2p
handshake with this node's identity and swarm key.

Why a handshake and not just a port probe: an open port proves nothing about the PeerID or the swarm key,
and a wrong one is named as the daemon names it. The peers are the ones the daemon would dial: doctor's
own `--bootstrap` flags, else the running daemon's, else the config's (`effective_bootstrap`). Every
probe is bounded (CONNECT_TIMEOUT_S, HANDSHAKE_TIMEOUT_S, at most MAX_BOOTSTRAP_CHECKED peers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import socket
from pathlib import Path
from typing import Any

import trio

from node.config.load import Config
from node.ops.doctor_findings import (
    ERROR,
    MAX_LISTED,
    OK,
    SKIP,
    WARN,
    Finding,
    address_family,
    as_number,
    host_port,
    list_some,
    short,
)
from node.status_schema import NodeStatus

CONNECT_TIMEOUT_S = 3.0  # per bootstrap address, DNS included
HANDSHAKE_TIMEOUT_S = 5.0  # per bootstrap peer whose TCP port answered: Noise (and the swarm key) on top
MAX_BOOTSTRAP_CHECKED = 32  # bounded work for a huge bootstrap file


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
            files = list_some(cfg.node.bootstrap_files)
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
        hp = host_port(text)
        if peer == own_peer_id:
            verdicts.append(Finding("bootstrap", OK, f"{text}: this node itself (ignored)"))
        elif peer in connected:
            reached += 1
            verdicts.append(Finding("bootstrap", OK, f"{text}: connected"))
        elif hp is None:
            verdicts.append(Finding("bootstrap", SKIP, f"{text}: not a TCP address; not checked"))
        else:
            to_probe.append((text, source, hp))
    results = trio.run(_probe_all, [(h, p, address_family(proto)) for _, _, (proto, h, p) in to_probe], timeout)
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
    up = as_number(status.get("uptime_s"))
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
