"""`starling doctor`: each broken setup yields a finding that names the problem and its fix.

Local checks run against real files, sockets and (for the healthy case) a real daemon process; the
status-based checks are pure functions, fed synthetic status dicts shaped like the daemon's.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from node.config.home import Home
from node.config.load import load_config
from node.ops.doctor import NO_DAEMON, doctor_main, run_checks
from node.ops.doctor_bootstrap import check_bootstrap, effective_bootstrap
from node.ops.doctor_findings import ERROR, MAX_LISTED, OK, SKIP, WARN, Finding, short
from node.ops.doctor_status import (
    check_clock_skew,
    check_manifest,
    check_pairing,
    check_reachability,
    check_training,
    check_versions,
)
from node.ops.lock import HomeLock
from p2p.identity import create_identity, peer_id_of
from starling_testing.daemon import DaemonGroup, free_port, starling

LOOPBACK_CONFIG = '[node]\nlisten = ["/ip4/127.0.0.1/tcp/0"]\n'


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The doctor reads STARLING_* variables; the developer's own must not leak into these tests."""
    for name in list(os.environ):
        if name.startswith("STARLING_"):
            monkeypatch.delenv(name)


def make_home(tmp_path: Path, config: str = LOOPBACK_CONFIG) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    create_identity(Home(home).identity)
    (home / "config.toml").write_text(config)
    return home


def other_peer_id() -> str:
    return str(peer_id_of(create_new_key_pair()))


def of(findings: list[Finding], check: str) -> list[Finding]:
    return [f for f in findings if f.check == check]


def levels(findings: list[Finding]) -> set[str]:
    return {f.level for f in findings}


# ---------------------------------------------------------------------------------------------------------
# identity and config
# ---------------------------------------------------------------------------------------------------------


def test_broken_config_value_is_an_error_naming_the_option_and_exit_is_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = make_home(tmp_path, LOOPBACK_CONFIG + "target_peers = 99\n")
    assert doctor_main(str(home)) == 1
    out = capsys.readouterr().out
    assert "ERROR" in out and "node.target_peers: must be between 1 and 32" in out
    [config] = of(run_checks(home, environ={}), "config")
    assert config.level == ERROR
    assert "target_peers" in config.fix and str(home / "config.toml") in config.fix
    assert "default 8" in config.fix  # the fix says what a valid value looks like


def test_misspelled_config_option_suggests_the_real_one(tmp_path: Path) -> None:
    home = make_home(tmp_path, LOOPBACK_CONFIG + 'bootstarp = ["x"]\n')
    [config] = of(run_checks(home, environ={}), "config")
    assert config.level == ERROR and "node.bootstarp" in config.message
    assert "did you mean node.bootstrap?" in config.fix


def test_bad_value_from_the_environment_points_at_the_variable(tmp_path: Path) -> None:
    home = make_home(tmp_path)
    [config, *_] = of(run_checks(home, environ={"STARLING_NODE_MAX_PEERS": "many"}), "config")
    assert config.level == ERROR and "node.max_peers" in config.message
    assert "STARLING_NODE_MAX_PEERS" in config.fix


def test_misspelled_environment_variable_is_flagged_because_it_is_silently_ignored(tmp_path: Path) -> None:
    home = make_home(tmp_path)
    findings = of(
        run_checks(home, environ={"STARLING_NODE_BOOTSTARP": "x", "STARLING_HOME": str(home)}), "config"
    )
    [warning] = [f for f in findings if f.level == WARN]
    assert "STARLING_NODE_BOOTSTARP" in warning.message
    assert "STARLING_NODE_BOOTSTRAP" in warning.fix
    assert ERROR not in levels(findings)


def test_missing_identity_says_to_run_init(tmp_path: Path) -> None:
    home = make_home(tmp_path)
    (Home(home).identity).unlink()
    [identity] = of(run_checks(home, environ={}), "identity")
    assert identity.level == ERROR and "starling init" in identity.fix


def test_corrupt_identity_is_an_error_and_the_file_is_left_untouched(tmp_path: Path) -> None:
    home = make_home(tmp_path)
    key = Home(home).identity
    key.write_bytes(b"not a key")
    key.chmod(0o644)
    findings = of(run_checks(home, environ={}), "identity")
    assert any(f.level == ERROR and "corrupt" in f.message and "backup" in f.fix for f in findings)
    assert key.read_bytes() == b"not a key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o644  # reported, not "fixed" behind the operator's back


def test_identity_readable_by_others_warns_with_chmod_and_shows_the_peer_id(tmp_path: Path) -> None:
    home = make_home(tmp_path)
    (Home(home).identity).chmod(0o644)
    findings = of(run_checks(home, environ={}), "identity")
    assert any(f.level == WARN and "chmod 600" in f.fix for f in findings)
    assert any(f.level == OK and "12D3KooW" in f.message for f in findings)


def test_home_that_is_a_file_is_bad_usage_with_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    assert doctor_main(str(path)) == 2


# ---------------------------------------------------------------------------------------------------------
# ports and bootstrap (no daemon running)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    yield s
    s.close()


def test_listen_port_in_use_is_an_error_naming_the_port_and_exit_is_1(
    tmp_path: Path, listener: socket.socket
) -> None:
    port = listener.getsockname()[1]
    home = make_home(tmp_path, f'[node]\nlisten = ["/ip4/127.0.0.1/tcp/{port}"]\n')
    [ports] = of(run_checks(home, environ={}), "ports")
    assert ports.level == ERROR and f"port {port} is already in use" in ports.message
    assert "node.listen" in ports.fix and f":{port}" in ports.fix
    assert doctor_main(str(home)) == 1


def test_free_listen_port_is_ok(tmp_path: Path) -> None:
    port = free_port()
    home = make_home(tmp_path, f'[node]\nlisten = ["/ip4/127.0.0.1/tcp/{port}"]\n')
    [ports] = of(run_checks(home, environ={}), "ports")
    assert ports.level == OK and f"port {port} is free" in ports.message


def test_listen_address_of_another_machine_is_an_error(tmp_path: Path) -> None:
    home = make_home(tmp_path, '[node]\nlisten = ["/ip4/192.0.2.7/tcp/4001"]\n')
    [ports] = of(run_checks(home, environ={}), "ports")
    assert ports.level == ERROR and "not an address of this machine" in ports.message
    assert "announce" in ports.fix


def test_unreachable_only_bootstrap_is_an_error_with_a_fix(tmp_path: Path) -> None:
    addr = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{other_peer_id()}"
    home = make_home(tmp_path, LOOPBACK_CONFIG + f'bootstrap = ["{addr}"]\n')
    [boot] = of(run_checks(home, environ={}), "bootstrap")
    assert boot.level == ERROR and addr in boot.message and "connection refused" in boot.message
    assert "firewall" in boot.fix


@contextlib.contextmanager
def libp2p_peer(psk: str | None = None) -> Iterator[str]:
    """A libp2p host (Noise, yamux, as a daemon builds it) listening on 127.0.0.1 in a thread of its own:
    its multiaddr, ending in /p2p/<PeerID>."""
    import multiaddr
    import trio

    from p2p.auth import AccessControl
    from p2p.host import build_host

    ready: queue.Queue[str] = queue.Queue()
    stop = threading.Event()

    async def serve() -> None:
        host = build_host(create_new_key_pair(), psk=psk)
        AccessControl(keyed=psk is not None).install(host)
        async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            ready.put(str(host.get_addrs()[0]))
            while not stop.is_set():
                await trio.sleep(0.05)

    thread = threading.Thread(target=trio.run, args=(serve,), daemon=True)
    thread.start()
    try:
        yield ready.get(timeout=30)
    finally:
        stop.set()
        thread.join(30)


def test_bootstrap_that_drops_packets_times_out_and_the_reachable_one_makes_it_a_warning(
    tmp_path: Path
) -> None:
    # A listener whose accept queue is full drops new SYNs: a stand-in for a firewall.
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(0)
    fillers = []
    for _ in range(3):
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(blackhole.getsockname())
        fillers.append(c)
    silent = f"/ip4/127.0.0.1/tcp/{blackhole.getsockname()[1]}/p2p/{other_peer_id()}"
    try:
        with libp2p_peer() as alive:
            cfg = load_config(None, overrides={"node.bootstrap": [silent, alive]}, environ={})
            findings = check_bootstrap(cfg, None, None, timeout=0.5)
    finally:
        for c in [*fillers, blackhole]:
            c.close()
    by_addr = {f.message.split(" ")[0].rstrip(":"): f for f in findings}
    assert by_addr[alive].level == OK and "libp2p handshake completed" in by_addr[alive].message
    assert by_addr[silent].level == WARN and "no answer within 0.5 s" in by_addr[silent].message


def test_an_open_port_is_not_a_bootstrap_peer_the_handshake_decides(listener: socket.socket) -> None:
    """Issue #27: `ok bootstrap ...: TCP port open` (exit 0) for a port where no Starling node of this swarm
    listens, or another node than the address names, or one with another swarm key."""
    mute = f"/ip4/127.0.0.1/tcp/{listener.getsockname()[1]}/p2p/{other_peer_id()}"
    cfg = load_config(None, overrides={"node.bootstrap": [mute]}, environ={})
    [boot] = check_bootstrap(cfg, None, None, handshake_timeout=1.0)
    assert boot.level == ERROR and "the handshake" in boot.message, boot
    with libp2p_peer() as real:
        wrong = real.rsplit("/p2p/", 1)[0] + f"/p2p/{(claimed := other_peer_id())}"
        cfg = load_config(None, overrides={"node.bootstrap": [wrong]}, environ={})
        [boot] = check_bootstrap(cfg, None, None)
        assert boot.level == ERROR and f"is {real.rsplit('/', 1)[1]}, not {claimed}" in boot.message, boot
        assert "/p2p/" in boot.fix
        cfg = load_config(None, overrides={"node.bootstrap": [real]}, environ={})
        [boot] = check_bootstrap(cfg, None, None, psk="33" * 32, handshake_timeout=2.0)  # a key; it has none
        assert boot.level == ERROR and "swarm key" in boot.message and "swarm.key" in boot.fix, boot
    with libp2p_peer(psk="44" * 32) as keyed:
        cfg = load_config(None, overrides={"node.bootstrap": [keyed]}, environ={})
        [boot] = check_bootstrap(cfg, None, None, handshake_timeout=2.0)  # no key; it has one
        assert boot.level == ERROR and "swarm key" in boot.message and "no swarm key" in boot.fix, boot
        [boot] = check_bootstrap(cfg, None, None, psk="44" * 32)
        assert boot.level == OK, boot


def test_a_daemon_connected_to_nobody_although_it_has_bootstrap_peers_is_an_error() -> None:
    addr = f"/ip4/127.0.0.1/tcp/1/p2p/{other_peer_id()}"
    why = "peer at 127.0.0.1:1 refused the handshake: a different swarm key (or none) is the likely cause"
    status: dict[str, Any] = {"connected_peers": [], "uptime_s": 120.0, "bootstrap": {
        "addrs": [addr], "files": [], "peers": [{"peer_id": addr.rsplit("/", 1)[1], "addrs": [], "connected": False,
                                                  "failures": 3, "last_error": why}]}}
    cfg = load_config(None, overrides={"node.bootstrap": [addr]}, environ={})
    isolated = of(check_bootstrap(cfg, status, None, timeout=0.5), "connections")  # type: ignore[arg-type]
    assert [f.level for f in isolated] == [ERROR] and why in isolated[0].message
    status["connected_peers"] = ["someone"]
    assert not of(check_bootstrap(cfg, status, None, timeout=0.5), "connections")  # type: ignore[arg-type]


def test_bootstrap_file_problems_are_reported_with_file_and_line(tmp_path: Path) -> None:
    good = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{other_peer_id()}"
    listed = tmp_path / "peers.txt"
    listed.write_text(f"# bootstrap peers\n{good}\n/ip4/1.2.3.4/tcp/1\n")
    missing = tmp_path / "later.txt"
    cfg = load_config(None, overrides={"node.bootstrap_files": [str(listed), str(missing)]}, environ={})
    findings = check_bootstrap(cfg, None, None, timeout=1.0)
    messages = [f.message for f in findings]
    assert any(f"{listed}:3" in m and "/p2p/" in m for m in messages)
    assert any(str(missing) in m and "does not exist" in m for m in messages)
    assert any(good in f.message and f.level == ERROR for f in findings)  # the only usable one is down


def test_no_bootstrap_and_no_peers_warns_of_a_lone_node(tmp_path: Path) -> None:
    [boot] = check_bootstrap(load_config(None, environ={}), None, None)
    assert boot.level == WARN and "lone node" in boot.fix


def test_doctor_checks_bootstrap_peers_given_on_its_command_line(tmp_path: Path) -> None:
    """Issue #14: `--bootstrap` as `run` takes it; the address is checked (and named as from --bootstrap)."""
    home = make_home(tmp_path)
    addr = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{other_peer_id()}"
    r = starling("doctor", "--home", str(home), "--bootstrap", addr)
    assert r.returncode == 1, r.stderr
    [line] = [ln for ln in r.stdout.splitlines() if addr in ln]
    assert "ERROR" in line and "(from --bootstrap)" in line and "connection refused" in line
    assert "none configured" not in r.stdout and "no bootstrap peers configured" not in r.stdout


def test_a_bad_bootstrap_address_given_to_doctor_is_a_one_line_usage_error(tmp_path: Path) -> None:
    r = starling("doctor", "--home", str(make_home(tmp_path)), "--bootstrap", "/ip4/127.0.0.1/tcp/1")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().count("\n") == 0 and "--bootstrap" in r.stderr and "/p2p/<peer id>" in r.stderr


def test_the_running_daemons_own_bootstrap_list_replaces_the_configs(tmp_path: Path) -> None:
    cfg = load_config(None, environ={})
    addr = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{other_peer_id()}"
    status = {"bootstrap": {"addrs": [addr], "files": []}, "connected_peers": []}
    used, label = effective_bootstrap(cfg, status, given=False)
    assert used.node.bootstrap == [addr] and label == "the running daemon's --bootstrap"
    assert effective_bootstrap(cfg, status, given=True) == (cfg, "--bootstrap")  # doctor's own flags win
    garbage = {"bootstrap": {"addrs": ["not an address"], "files": []}}
    assert effective_bootstrap(cfg, garbage, given=False) == (cfg, "node.bootstrap")
    assert effective_bootstrap(cfg, {}, given=False) == (cfg, "node.bootstrap")  # an older daemon


def test_without_a_daemon_the_status_checks_are_skipped_not_errors(tmp_path: Path) -> None:
    home = make_home(tmp_path)
    findings = run_checks(home, environ={})
    for check in ("reachability", "clock", "versions", "manifest", "training", "pairing"):
        assert of(findings, check) == [Finding(check, SKIP, NO_DAEMON)]
    assert ERROR not in levels(findings)


def test_daemon_holding_the_lock_without_answering_is_reported(tmp_path: Path) -> None:
    home = make_home(tmp_path)
    with HomeLock(home):
        [daemon] = of(run_checks(home, environ={}), "daemon")
    assert daemon.level == ERROR and f"pid {os.getpid()}" in daemon.message


def test_json_report_lists_every_finding(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = make_home(tmp_path)
    assert doctor_main(str(home), as_json=True) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["errors"] == 0 and report["home"] == str(home)
    assert {f["check"] for f in report["findings"]} >= {"daemon", "identity", "config", "ports", "bootstrap"}
    assert all(set(f) == {"check", "level", "message", "fix"} for f in report["findings"])


# ---------------------------------------------------------------------------------------------------------
# a real daemon
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_healthy_running_daemon_passes_with_exit_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    group = DaemonGroup(tmp_path)
    try:
        first = group.start("first", "--no-train", "--listen", "/ip4/127.0.0.1/tcp/0")
        addr = first.addr()
        # The second node gets its bootstrap peer from config.toml, where the doctor reads it too.
        second_home = tmp_path / "second"
        second_home.mkdir()
        (second_home / "config.toml").write_text(LOOPBACK_CONFIG + f'bootstrap = ["{addr}"]\n')
        second = group.start("second", "--no-train")
        second.wait_status(lambda s: len(s["connected_peers"]) == 1)
        second.wait_status(lambda s: sum(m["state"] == "alive" for m in s["members"]) == 2)
        assert doctor_main(str(second_home)) == 0
        out = capsys.readouterr().out
        assert "0 errors" in out
        findings = run_checks(second_home, environ={})
        assert of(findings, "bootstrap") == [Finding("bootstrap", OK, f"{addr}: connected")]
        assert "the daemon is running and listening on" in of(findings, "ports")[0].message
        assert of(findings, "versions")[0].level == OK
        assert of(findings, "clock")[0].level == OK
    finally:
        group.close()


@pytest.mark.slow
def test_doctor_checks_the_bootstrap_peer_a_running_daemon_got_on_its_command_line(group: DaemonGroup) -> None:
    """Issue #14: a node started with `run --bootstrap` was reported as having "none configured"."""
    first = group.start("first", "--no-train", "--listen", "/ip4/127.0.0.1/tcp/0")
    addr = first.addr()
    second = group.start("second", "--no-train", "--listen", "/ip4/127.0.0.1/tcp/0", "--bootstrap", addr)
    second.wait_status(lambda s: len(s["connected_peers"]) == 1)
    boot = of(run_checks(second.home, environ={}), "bootstrap")
    assert boot == [Finding("bootstrap", OK, f"{addr}: connected")]


# ---------------------------------------------------------------------------------------------------------
# status-based checks on synthetic status dicts
# ---------------------------------------------------------------------------------------------------------

ME = "12D3KooWMeMeMeMeMeMeMeMeMeMeMeMeMeMeMeMeMeMeMeMeMeMe"


def member(peer: str, **fields: Any) -> dict[str, Any]:
    base = {
        "peer_id": peer,
        "self": peer == ME,
        "state": "alive",
        "version": "0.1.0",
        "manifest_hash": "aa" * 32,
        "last_seen": 1_700_000_000.0,
        "last_seen_s": 1.0,
    }
    return {**base, **fields}


def status_with(*members: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {
        "peer_id": ME,
        "version": "0.1.0",
        "role": "trainer",
        "connected_peers": [],
        "members": [member(ME), *members],
        "swarm_totals": {"rejected": {}},
        **fields,
    }


def test_clock_skew_estimates_from_heartbeat_age_warn_and_error_levels() -> None:
    fine, slow, far = other_peer_id(), other_peer_id(), other_peer_id()
    st = status_with(
        member(fine, last_seen_s=3.5),  # within two heartbeats of 2 s: no evidence of skew
        member(slow, last_seen_s=9.0),  # 5 s beyond two heartbeats: about 5 s behind
        member(far, state="gone", last_seen_s=130.0),  # connected but looks gone: its clock is far behind
        connected_peers=[far],
    )
    findings = check_clock_skew(st, heartbeat_s=2.0)
    assert {f.level for f in findings if fine[-6:] in f.message} == set()
    [warn] = [f for f in findings if slow[-6:] in f.message]
    assert warn.level == WARN and "5.0 s behind" in warn.message and "NTP" in warn.fix
    [error] = [f for f in findings if far[-6:] in f.message]
    assert error.level == ERROR and "looks gone" in error.message


def test_clock_skew_uses_heartbeat_and_receipt_times_when_the_status_has_them() -> None:
    ahead = other_peer_id()
    st = status_with(member(ahead, heartbeat=1_700_000_030.0, received_at=1_700_000_000.0))
    [f] = check_clock_skew(st, heartbeat_s=2.0)
    assert f.level == WARN and "30.0 s ahead of ours" in f.message


def test_a_record_relayed_up_to_a_heartbeat_late_is_not_blamed_on_the_clock() -> None:
    late, behind = other_peer_id(), other_peer_id()
    st = status_with(
        member(late, heartbeat=1_700_000_000.0, received_at=1_700_000_002.5),  # one interval plus a moment
        member(behind, heartbeat=1_700_000_000.0, received_at=1_700_000_010.0),
    )
    [f] = check_clock_skew(st, heartbeat_s=2.0)
    assert f.level == WARN and f"{short(behind)}: its clock is about 7.0 s behind ours" in f.message


def test_in_swim_mode_a_record_signed_long_before_it_arrived_is_not_a_skewed_clock() -> None:
    """node.membership = swim (the status has a ``swim`` section): a record is re-signed only when it changes,
    so a node that joined later holds records signed minutes before they reached it; nothing of that is
    the authors' clocks. A record dated ahead of its arrival still is."""
    old, quiet, ahead = other_peer_id(), other_peer_id(), other_peer_id()
    swim = {"probes": 10, "acks": 10}
    st = status_with(
        member(old, heartbeat=1_700_000_000.0, received_at=1_700_000_600.0),  # signed 10 min before it came
        member(quiet, last_seen_s=900.0),  # no record times: nothing to say
        swim=swim,
    )
    [f] = check_clock_skew(st, heartbeat_s=2.0)
    assert f.level == OK and "swim mode" in f.message
    st = status_with(member(ahead, heartbeat=1_700_000_030.0, received_at=1_700_000_000.0), swim=swim)
    [f] = check_clock_skew(st, heartbeat_s=2.0)
    assert f.level == WARN and "30.0 s ahead of ours" in f.message


def test_records_rejected_for_clock_skew_are_an_error() -> None:
    st = status_with(swarm_totals={"rejected": {"clock_skew": 4}})
    findings = check_clock_skew(st)
    assert [f.level for f in findings] == [ERROR] and "4 records" in findings[0].message


def test_hundreds_of_skewed_clocks_are_the_worst_few_by_name_and_one_line_for_the_rest() -> None:
    """At 300 members a clock off on this machine makes every peer look skewed: not 300 findings."""
    peers = [f"12D3KooWSkew{i:06d}" for i in range(300)]
    st = status_with(*(member(p, last_seen_s=9.0 + i % 40) for i, p in enumerate(peers)))
    findings = check_clock_skew(st, heartbeat_s=2.0)
    assert len(findings) == MAX_LISTED + 1
    worst = findings[0]
    assert "about 44.0 s behind ours" in worst.message  # 9 + 39 s old, less two heartbeats: the worst first (7 of them; the 8th listed is 43 s behind)
    rest = findings[-1]
    assert rest.message.startswith(f"{300 - MAX_LISTED} more peers' clocks differ from ours by 5.0 to 43.0 s, "
                                   "300 of 300 live peers in all (most of the swarm: is this machine's clock")
    assert rest.level == WARN and "NTP" in rest.fix and f"and {300 - MAX_LISTED - MAX_LISTED} more" in rest.message


def test_silent_members_not_connected_are_not_blamed_on_clocks() -> None:
    st = status_with(member(other_peer_id(), state="gone", last_seen_s=500.0))
    assert levels(check_clock_skew(st)) == {OK}


def test_peers_on_another_version_are_listed() -> None:
    old = other_peer_id()
    st = status_with(
        member(old, version="0.0.9"),
        member(other_peer_id()),
        member(other_peer_id(), state="gone", version="0.0.1"),
    )
    [f] = check_versions(st, installed="0.1.0")
    assert f.level == WARN and f.message.startswith("1 peers") and f"{old[-6:]} runs 0.0.9" in f.message


def test_daemon_older_than_the_installed_package_says_restart() -> None:
    [f] = check_versions(status_with(), installed="0.2.0")
    assert f.level == WARN and "restart" in f.fix


def test_same_versions_everywhere_is_ok() -> None:
    assert levels(check_versions(status_with(member(other_peer_id())), installed="0.1.0")) == {OK}


def test_manifest_mismatch_is_an_error_with_both_hashes_and_the_fix() -> None:
    error = (
        "run manifest mismatch: this node's manifest is "
        + "aa" * 32
        + " but the swarm's is "
        + "bb" * 32
        + ". Join with the same task, model config, optimizer config and protocol version as the swarm."
    )
    st = status_with(swarm_totals={"manifest_error": error, "manifest_hash": "bb" * 32})
    [f] = check_manifest(st)
    assert f.level == ERROR and "aa" * 32 in f.message and "bb" * 32 in f.message
    assert "train." in f.fix and "node.swarm" in f.fix


def test_incompatible_peers_are_named_with_their_manifest() -> None:
    odd = other_peer_id()
    st = status_with(
        member(odd, manifest_hash="cc" * 32, incompatible=True),
        swarm_totals={"incompatible_peers": [odd], "manifest_hash": "aa" * 32},
    )
    [f] = check_manifest(st)
    assert f.level == WARN and odd[-6:] in f.message and "cc" * 6 in f.message and "aa" * 6 in f.message


def test_matching_manifest_is_ok() -> None:
    st = status_with(member(other_peer_id()), swarm_totals={"manifest_hash": "aa" * 32})
    assert levels(check_manifest(st)) == {OK}


def test_failed_training_is_an_error_with_the_message() -> None:
    st = status_with(training={"state": "failed", "error": "CUDA out of memory", "restarts": 0})
    [f] = check_training(st)
    assert f.level == ERROR and "CUDA out of memory" in f.message


def test_a_flapping_worker_warns_with_its_last_exit() -> None:
    st = status_with(training={"state": "running", "error": "worker killed by signal 9", "restarts": 5})
    [f] = check_training(st)
    assert f.level == WARN and "5 times" in f.message and "signal 9" in f.message


def test_running_training_is_ok_and_network_only_is_skipped() -> None:
    st = status_with(training={"state": "running", "step": 120, "outer_step": 3, "loss": 2.5, "restarts": 0})
    [f] = check_training(st)
    assert f.level == OK and "step 120" in f.message
    assert levels(check_training(status_with(role="network-only"))) == {SKIP}


def test_private_reachability_explains_port_forwarding_and_announce() -> None:
    st = status_with(reachability="private", addrs=[f"/ip4/10.0.0.5/tcp/4123/p2p/{ME}"])
    [f] = check_reachability(st)
    assert f.level == WARN and "relay" in f.message
    assert "4123" in f.fix and "node.announce" in f.fix


def test_reachability_public_unknown_and_absent() -> None:
    assert levels(check_reachability(status_with(reachability="public"))) == {OK}
    [unknown] = check_reachability(status_with(reachability="unknown"))
    assert unknown.level == OK and "not yet determined" in unknown.message
    assert levels(check_reachability(status_with())) == {SKIP}


# ---------------------------------------------------------------------------------------------------------
# pairing: islands in the swarm's pairing graph, and a node that mostly steps solo
# ---------------------------------------------------------------------------------------------------------


def trainers_status(partners: dict[str, list[str]], **fields: Any) -> dict[str, Any]:
    """A status whose alive trainers (ME among them when named) name the given recent partners."""
    others = [member(p, role="trainer", partners=named, outer_step=40) for p, named in partners.items() if p != ME]
    st = status_with(*others, **fields)
    st["members"][0].update(role="trainer", partners=partners.get(ME, []), outer_step=40)
    return st


def mixing(outer_steps: int, solo: int) -> dict[str, Any]:
    return {"sync": {"mixing": {"window": 20, "outer_steps": outer_steps, "averaged": outer_steps - solo,
                                "solo": solo, "solo_share": round(solo / outer_steps, 3) if outer_steps else None,
                                "scheduled": 0, "partners": {}, "distinct_partners": 0}}}  # fmt: skip


def test_two_islands_warn_naming_the_members_of_both_and_the_fix() -> None:
    a, b, c = other_peer_id(), other_peer_id(), other_peer_id()
    st = trainers_status({ME: [a], a: [ME], b: [c], c: [b]})
    for m in st["members"]:
        if m["peer_id"] in (b, c):
            m["outer_step"] = 90 if m["peer_id"] == b else 92
    [finding] = check_pairing(st)
    assert finding.level == WARN and "2 islands" in finding.message
    first, second = [short(p) for p in sorted([ME, a])], [short(p) for p in sorted([b, c])]
    assert "{" + ", ".join(first) + "} (outer step 40)" in finding.message
    assert "{" + ", ".join(second) + "} (outer steps 90-92)" in finding.message
    assert "sync.pace = swarm" in finding.fix and "sync.max_step_gap" in finding.fix and "path" in finding.fix


def test_a_swarm_shattered_into_hundreds_of_islands_names_a_few_and_counts_the_rest() -> None:
    peers = [f"12D3KooWIsle{i:06d}" for i in range(200)]
    partners = {p: [peers[i ^ 1]] for i, p in enumerate(peers)}  # 100 pairs that never meet another pair
    [finding] = check_pairing(trainers_status(partners))
    assert "split into 100 islands" in finding.message
    assert finding.message.count("{") == MAX_LISTED and f"and {100 - MAX_LISTED} more islands" in finding.message


def test_islands_do_not_make_the_doctor_exit_1() -> None:
    a, b, c = other_peer_id(), other_peer_id(), other_peer_id()
    findings = check_pairing(trainers_status({ME: [a], a: [ME], b: [c], c: [b]}))
    assert ERROR not in levels(findings)


def test_one_connected_swarm_is_ok_with_its_size() -> None:
    a, b = other_peer_id(), other_peer_id()
    st = trainers_status({ME: [a], a: [b], b: []}, **mixing(20, 2))
    assert check_pairing(st) == [Finding("pairing", OK, "pairing graph: one island of 3 trainers")]


def test_a_fresh_swarm_where_nobody_paired_yet_is_ok_not_split() -> None:
    a, b = other_peer_id(), other_peer_id()
    [finding] = check_pairing(trainers_status({ME: [], a: [], b: []}, **mixing(3, 3)))
    assert finding.level == OK and finding.message == "pairing graph: no pairs in the recent outer steps of the 3 alive trainers"


def test_a_lone_alive_trainer_is_ok_and_said_so_plainly() -> None:
    """Issue #27: after its partner left, "no pairs yet, 1 unpaired" read as a failure to pair."""
    [finding] = check_pairing(trainers_status({ME: []}, **mixing(3, 3)))
    assert finding.level == OK and finding.message == "pairing graph: one alive trainer, nobody to pair with"


def test_unpaired_trainers_beside_one_island_are_named_in_the_ok_line() -> None:
    a, b = other_peer_id(), other_peer_id()
    [finding] = check_pairing(trainers_status({ME: [a], a: [ME], b: []}))
    assert finding.level == OK and finding.message.endswith(f"1 with no recent partner: {short(b)}")


def test_mostly_solo_over_ten_recent_steps_with_other_trainers_warns() -> None:
    a = other_peer_id()
    [finding] = check_pairing(trainers_status({ME: [], a: []}, **mixing(12, 8)))
    assert finding.level == WARN and "solo in 67% of its last 12 outer steps" in finding.message
    assert "1 other trainer is alive" in finding.message and "sync.max_step_gap" in finding.fix


def test_solo_steps_are_fine_alone_or_over_too_few_steps_or_at_half() -> None:
    a = other_peer_id()
    alone = trainers_status({ME: []}, **mixing(20, 20))
    early = trainers_status({ME: [], a: []}, **mixing(9, 9))
    half = trainers_status({ME: [a], a: [ME]}, **mixing(20, 10))
    for st in (alone, early, half):
        assert levels(check_pairing(st)) == {OK}


def test_pairing_without_members_is_skipped() -> None:
    assert check_pairing({"peer_id": ME})[0].level == SKIP
