"""`starling doctor`: find what stops this node from working, and say how to fix each problem.

The doctor runs a fixed list of checks, each producing `Finding`s (check, level, message, fix;
node/ops/doctor_findings.py):

* local checks, which need no daemon: identity file, whether HOME is writable and has room for
  checkpoints, config (file and STARLING_* environment), swarm key, whether the listen ports can be bound
  (node/ops/doctor_local.py); whether the bootstrap peers answer on TCP and then complete a libp2p
  handshake with this node's identity and swarm key (an open port proves nothing about the PeerID or the
  key: a wrong one is named, as the daemon names it; node/ops/doctor_bootstrap.py);
* status checks (node/ops/doctor_status.py), which read the running daemon's `status` (the same dict
  `starling status --json` prints): own reachability, clock skew against peers, versions, run manifest,
  training (failing checkpoints included), and connections (none although bootstrap peers are
  configured). They are pure functions of that dict so that each verdict can be tested on a synthetic
  status. Without a daemon they are reported as skipped, not as errors: "no daemon" is a state, not a
  fault.

This module is the command: it runs the checks in report order, renders them (text or JSON) and picks
the exit code. Why the checks live apart, one module per kind: each kind needs different things (files
and sockets; the network; only a status dict) and is tested on its own.

Levels: ok, skip, warn, error. The exit code is 1 when any finding is an error, else 0; `doctor_main`
returns 2 for a HOME that cannot be a node directory at all (bad usage).

The doctor only reads: it never rewrites the identity file, the config or the state, so running it on a
live node is always safe. (Its handshake with a bootstrap peer not connected to the daemon is made with
the node's own identity, as the daemon's would be, and closed at once.)
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from node.config.home import Home
from node.config.load import Config, resolve_home
from node.ops.doctor_bootstrap import CONNECT_TIMEOUT_S, check_bootstrap, effective_bootstrap
from node.ops.doctor_findings import ERROR, OK, SKIP, WARN, Finding
from node.ops.doctor_local import (
    check_config,
    check_disk,
    check_home,
    check_identity,
    check_ports,
    check_swarm_key,
    probe_daemon,
)
from node.ops.doctor_status import (
    check_clock_skew,
    check_manifest,
    check_pairing,
    check_reachability,
    check_training,
    check_versions,
)
from node.status_schema import NodeStatus

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2
NO_DAEMON = "skipped: no daemon running (start it with starling run)"


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
