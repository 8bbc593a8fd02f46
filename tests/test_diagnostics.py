"""When a node cannot join or train, say why (issue #27): each row of the issue's table, driven through the
real `starling` command where the row is about the command.

Every failure is one line that names the cause and the fix, never a traceback; `status` and `doctor` say
what is wrong between nodes."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from node.cli import build_parser
from node.cli import main as cli_main
from starling_testing.daemon import ROOT, starling

#: A daemon that must never get far: loopback, no worker. Today's code would start it; a test then fails
#: on its timeout instead of leaving a trainer on 0.0.0.0:4001.
HARMLESS = ["--listen", "/ip4/127.0.0.1/tcp/0", "--no-train"]
REAL_PEER = "12D3KooWPoxc3GetHDNMfRYL4h9TgTs2Dkrxk53DHHVDEVfqWV33"


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


# --- abbreviated options ------------------------------------------------------------------------------------


def test_an_abbreviated_option_is_refused_and_the_full_one_suggested(tmp_path: Path) -> None:
    """`run --hom /srv/x` was read as `--home /srv/x` and started a trainer."""
    home = tmp_path / "x"
    r = starling("run", "--hom", str(home), *HARMLESS, timeout=30)
    assert r.returncode == 2, r.stderr
    assert "unrecognized arguments: --hom" in r.stderr and "did you mean --home?" in r.stderr
    assert not home.exists()


def test_no_parser_of_the_command_accepts_abbreviations(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert not parser.allow_abbrev
    assert all(not p.allow_abbrev for p in sub.choices.values()), [n for n, p in sub.choices.items() if p.allow_abbrev]
    with pytest.raises(SystemExit) as e:
        cli_main(["status", "--js"])  # was `--json`
    assert e.value.code == 2 and "did you mean --json?" in capsys.readouterr().err


# --- --home naming a file -----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["run", "status", "init", "plot", "export"])
def test_a_home_that_is_a_regular_file_is_one_line_saying_so(tmp_path: Path, command: str) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a node directory")
    extra = {"run": HARMLESS, "export": ["--out", str(tmp_path / "out")]}.get(command, [])
    r = starling(command, "--home", str(afile), *extra, timeout=30)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f"{afile} is not a directory" in _one_error_line(r.stderr)
    r = starling(command, "--home", str(afile / "sub"), *extra, timeout=30)  # a file on the way there
    assert r.returncode == 2 and f"{afile} is not a directory" in _one_error_line(r.stderr)


# --- a bootstrap PeerID that cannot be one ------------------------------------------------------------------


@pytest.mark.parametrize("command", ["run", "doctor"])
def test_a_bootstrap_address_with_a_mistyped_peer_id_is_refused_at_start(tmp_path: Path, command: str) -> None:
    """`/p2p/12D3KooWtypo` decodes as base58 (py-libp2p takes it), but it is no PeerID: it was dialled forever."""
    addr = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWtypo"
    r = starling(command, "--home", str(tmp_path / "h"), *(HARMLESS if command == "run" else []),
                 "--bootstrap", addr, timeout=30)
    assert r.returncode == 2, (r.stdout, r.stderr)
    line = _one_error_line(r.stderr)
    assert "'12D3KooWtypo' is not a PeerID" in line and ("--bootstrap" in line or "node.bootstrap" in line)


def test_a_real_peer_id_and_the_other_peer_id_forms_are_still_accepted() -> None:
    from libp2p.crypto.secp256k1 import create_new_key_pair
    from libp2p.peer.id import ID

    from p2p.addrs import is_peer_id, parse_bootstrap  # was node.config.load's, for node.founder only

    secp = ID.from_pubkey(create_new_key_pair().public_key).to_base58()
    for peer in (REAL_PEER, secp, "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"):
        assert is_peer_id(peer), peer
        assert str(parse_bootstrap(f"/ip4/1.2.3.4/tcp/1/p2p/{peer}").peer_id) == peer
    for typo in ("12D3KooWtypo", REAL_PEER[:-1], REAL_PEER + "x", "12D3KooW"):
        assert not is_peer_id(typo), typo


# --- export: the format before anything slow ----------------------------------------------------------------


def test_export_refuses_an_unknown_format_before_loading_torch_or_the_task(tmp_path: Path) -> None:
    """It was refused only after ~10 s of loading."""
    from node.cli import EXPORT_FORMATS
    from node.worker.export import FORMATS

    assert EXPORT_FORMATS == FORMATS
    probe = ("import sys; from node.cli import main; rc = main(sys.argv[1:]); "
             "print('torch loaded' if 'torch' in sys.modules else 'torch not loaded'); sys.exit(rc)")
    (tmp_path / "home").mkdir()
    r = subprocess.run([sys.executable, "-c", probe, "export", "--home", str(tmp_path / "home"), "--out",
                        str(tmp_path / "out"), "--format", "bogus"], capture_output=True, text=True, cwd=ROOT,
                       timeout=60)
    assert r.returncode == 2 and "--format: one of safetensors, torch, hf; got 'bogus'" in r.stderr
    assert r.stdout.strip() == "torch not loaded"


# --- the dialling side names the cause: a wrong PeerID, a swarm key mismatch, an allowlist --------------------

OTHER_KEY, KEY = "11" * 32, "22" * 32
NOT_LISTED = ["12D3KooWPoxc3GetHDNMfRYL4h9TgTs2Dkrxk53DHHVDEVfqWV33"]


async def _bootstrap_once(dialler_key: str | None, listener_key: str | None, *, wrong_peer: bool = False,
                          allow: list[str] | None = None) -> tuple[str, str, str]:
    """Dial a listening host as a bootstrap peer through the connection manager until one dial failed:
    (the bootstrap peer's last_error in status, the PeerID that listens, the one dialled)."""
    import multiaddr
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import PeerInfo

    from p2p.auth import AccessControl
    from p2p.connmgr import ConnManager
    from p2p.host import build_host

    listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
    dialler = build_host(create_new_key_pair(), psk=dialler_key, dial_timeout=2)
    listener = build_host(create_new_key_pair(), psk=listener_key, dial_timeout=2)
    access = AccessControl(keyed=dialler_key is not None)
    access.install(dialler)
    AccessControl(keyed=listener_key is not None, allow=allow or ()).install(listener)
    cm = ConnManager(dialler, dial_timeout=2, explain=lambda p, since: access.explain_dial(str(p), since))
    async with dialler.run(listen_addrs=listen), listener.run(listen_addrs=listen):
        addr = listener.get_addrs()[0].decapsulate(multiaddr.Multiaddr(f"/p2p/{listener.get_id()}"))
        target = ID.from_pubkey(create_new_key_pair().public_key) if wrong_peer else listener.get_id()
        cm.add_candidate(PeerInfo(target, [addr]), source="bootstrap", permanent=True)
        async with trio.open_nursery() as nursery:
            await nursery.start(cm.run)
            with trio.fail_after(60):
                while cm.candidates[target].failures < 1:
                    await trio.sleep(0.05)
            [peer] = cm.bootstrap_status()
            nursery.cancel_scope.cancel()
    assert peer["peer_id"] == str(target) and not peer["connected"] and peer["failures"] >= 1
    return peer["last_error"], str(listener.get_id()), str(target)


def test_a_bootstrap_address_where_another_node_answers_names_both_peer_ids(caplog: pytest.LogCaptureFixture) -> None:
    """It was `SwarmDialAllFailedError: unable to connect to 12D3KooW...`, then `(negative cache)`."""
    import trio

    error, listening, dialled = trio.run(lambda: _bootstrap_once(None, None, wrong_peer=True))
    assert "the peer at 127.0.0.1:" in error and f"is {listening}, not {dialled}" in error, error
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name == "starling.connmgr"]
    assert any(f"is {listening}, not {dialled}" in m for m in warned), warned


@pytest.mark.parametrize(("dialler", "listener"), [(KEY, None), (None, KEY), (KEY, OTHER_KEY)],
                         ids=["keyed-to-open", "open-to-keyed", "another-key"])
def test_a_swarm_key_mismatch_is_named_by_the_dialling_side(dialler: str | None, listener: str | None) -> None:
    """It was only `cannot reach bootstrap peer ... timed out after 10s`; the key was named by the other side."""
    import trio

    from p2p.auth import KEY_MISMATCH_FIX

    error, _, _ = trio.run(lambda: _bootstrap_once(dialler, listener))
    assert error.startswith("peer at 127.0.0.1:") and "the handshake" in error and KEY_MISMATCH_FIX in error, error


def test_a_peer_whose_allowlist_leaves_us_out_is_named_as_such() -> None:
    import trio

    error, _, _ = trio.run(lambda: _bootstrap_once(KEY, KEY, allow=NOT_LISTED))
    assert "closed the connection right after the handshake" in error and "node.allow_peers" in error, error


def test_status_shows_why_each_unconnected_bootstrap_peer_is_not_connected() -> None:
    from node.ops.status_view import render_status

    why = f"the peer at 127.0.0.1:4001 is {REAL_PEER}, not 12D3KooWOther: correct the PeerID after /p2p/"
    peers = [{"peer_id": "12D3KooWOtherPeerIdentity", "addrs": ["/ip4/127.0.0.1/tcp/4001"], "connected": False,
              "failures": 3, "last_error": why},
             {"peer_id": REAL_PEER, "addrs": ["/ip4/127.0.0.1/tcp/4002"], "connected": True, "failures": 0,
              "last_error": ""}]
    text = render_status({"connected_peers": [REAL_PEER], "bootstrap": {"addrs": [], "files": [], "peers": peers}})  # type: ignore[typeddict-item]
    [line] = [line for line in text.splitlines() if line.startswith("bootstrap ")]
    assert "at /ip4/127.0.0.1/tcp/4001: not connected (3 failed dials): " + why in line


# --- an incompatible peer ------------------------------------------------------------------------------------


def test_status_shows_an_incompatible_peer_as_incompatible_with_what_differs() -> None:
    """It showed the connected, alive peer as `suspect ... 31s ago` and never said why."""
    from node.ops.status_view import render_status

    odd, other_swarm = "12D3KooWOddTaskPeerAAAAAAAAAAAA", "12D3KooWOtherSwarmPeerBBBBBBBBBBB"
    members = [{"peer_id": REAL_PEER, "self": True, "state": "alive"},
               {"peer_id": odd, "self": False, "state": "suspect", "last_seen_s": 31.0, "incompatible": True}]
    totals = {"manifest_error": None, "our_manifest": {"task": "stdlib-lm"}, "incompatible": [
        {"peer_id": odd, "field": "manifest", "theirs": "b" * 64, "ours": "a" * 64, "version": "0.2.0",
         "differs": []},
        {"peer_id": REAL_PEER[::-1], "field": "manifest", "theirs": "c" * 64, "ours": "a" * 64, "version": "",
         "differs": ["model_hash"]},
        {"peer_id": other_swarm, "field": "swarm", "theirs": "beta", "ours": "alpha", "version": ""}]}
    text = render_status({"members": members, "swarm_totals": totals})  # type: ignore[typeddict-item]
    [row] = [line for line in text.splitlines() if line.strip().startswith(f"{odd[:6]}..{odd[-6:]}")]
    assert "incompatible" in row and "suspect" not in row
    assert (f"incompatible {odd[:6]}..{odd[-6:]} (it runs starling 0.2.0): run manifest bbbbbbbbbbbb, ours: task "
            "'stdlib-lm', manifest aaaaaaaaaaaa: another task, model config, optimizer config or protocol version") in text
    assert f"incompatible {other_swarm[:6]}..{other_swarm[-6:]}: swarm 'beta', ours 'alpha'" in text
    assert "run manifest cccccccccccc, ours: task 'stdlib-lm', manifest aaaaaaaaaaaa: they differ in model_hash" in text


# --- a full disk ---------------------------------------------------------------------------------------------


def test_failing_checkpoints_are_logged_once_a_minute_with_a_count(caplog: pytest.LogCaptureFixture) -> None:
    """A full disk gave `checkpoint ... failed: [Errno 28] No space left on device` 124 times in 40 s."""
    import errno
    import logging

    from node.worker.loop import CheckpointErrorLog

    now = [1000.0]
    errors = CheckpointErrorLog(every=60.0, clock=lambda: now[0])
    enospc = OSError(errno.ENOSPC, "No space left on device")
    caplog.set_level(logging.INFO, logger="starling.worker")
    for i in range(124):  # 124 failures in 40 s of a fake clock
        now[0] = 1000.0 + i * 40 / 124
        errors.failed(10 + i, enospc)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(lines) == 1 and "checkpoint at step 10 failed: [Errno 28] No space left on device" in lines[0]
    assert "free space on the file system of HOME" in lines[0]
    now[0] = 1061.0
    errors.failed(200, enospc)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(lines) == 2 and "step 200" in lines[1] and "(123 more failures since the last such line)" in lines[1]
    errors.written(210)
    assert "checkpoint written again at step 210, after 125 failed ones" in caplog.text


def test_status_and_doctor_show_failing_checkpoints() -> None:
    from node.ops.doctor_findings import ERROR
    from node.ops.doctor_status import check_training
    from node.ops.status_view import render_status

    training = {"state": "training", "step": 500, "outer_step": 100, "checkpoint_step": 40,
                "checkpoint_error": "at step 500: [Errno 28] No space left on device", "checkpoint_failures": 30}
    text = render_status({"training": training})  # type: ignore[typeddict-item]
    assert ("checkpoints failing: 30 in a row, latest at step 500: [Errno 28] No space left on device; the last one "
            "written is at step 40: free space on the file system of HOME") in text
    [finding] = check_training({"training": training})  # type: ignore[typeddict-item]
    assert finding.level == ERROR and "No space left on device" in finding.message and "step 40" in finding.message



def test_a_handshake_cause_older_than_the_failed_dial_is_not_reported() -> None:
    """A peer that was refusing the handshake and is now down is unreachable, not "the wrong key"."""
    from p2p.auth import AccessControl, DialFailure

    access = AccessControl(keyed=True)
    access.dial_failures[REAL_PEER] = DialFailure("127.0.0.1:4001", "stalled", at=100.0)
    assert "swarm key" in (access.explain_dial(REAL_PEER, since=99.0) or "")
    assert access.explain_dial(REAL_PEER, since=101.0) is None
    assert access.explain_dial(REAL_PEER) is not None  # any age: what a negative-cache refusal falls back on


# --- the pace of a lone trainer -----------------------------------------------------------------------------


def test_a_lone_trainer_takes_h_inner_steps_and_the_swarms_pace_applies_once_a_partner_exists() -> None:
    """A lone trainer paced by its own smoothed speed did 25-47 inner steps per outer step at H = 50: with no
    possible partner the daemon sets no pace (the worker then publishes every H inner steps)."""
    from node.averaging.stepping import swarm_pace

    def pace(partner_speeds: list[float]) -> float:
        return swarm_pace(80.0, partner_speeds, 50 * 8)

    assert pace([]) == 0.0
    assert pace([100.0]) == pytest.approx(50 * 8 / 100.0)  # H inner steps of the fastest trainer
    assert pace([1e9]) == pytest.approx(50 * 8 / (80.0 * 64))  # a claimed speed is believed up to 64x ours
    assert pace([float("nan")]) == pytest.approx(50 * 8 / 80.0)

