"""node.ops.sdnotify against a fake systemd: an AF_UNIX datagram socket that records what arrives."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from node.ops.sdnotify import (
    Notifier,
    parse_notify_address,
    parse_watchdog_interval,
    summarize_status,
    watchdog_loop,
)


class FakeSystemd:
    """The receiving end of $NOTIFY_SOCKET."""

    def __init__(self, sock: socket.socket, env_value: str) -> None:
        self.sock = sock
        self.env_value = env_value

    def messages(self) -> list[dict[str, str]]:
        """Every datagram received so far, parsed into its assignments."""
        out = []
        while True:
            try:
                data = self.sock.recv(4096, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return out
            lines = data.decode().splitlines()
            out.append(dict(line.split("=", 1) for line in lines))


@pytest.fixture
def fake_systemd(tmp_path: Path) -> Iterator[FakeSystemd]:
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    try:
        yield FakeSystemd(sock, str(path))
    finally:
        sock.close()


@pytest.fixture
def abstract_fake_systemd() -> Iterator[FakeSystemd]:
    name = f"starling-test-{os.getpid()}-{id(object())}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    try:
        yield FakeSystemd(sock, "@" + name)
    finally:
        sock.close()


def test_ready_status_watchdog_and_stopping_arrive_as_assignments(fake_systemd: FakeSystemd) -> None:
    notifier = Notifier.from_env({"NOTIFY_SOCKET": fake_systemd.env_value})

    assert notifier.ready("listening on /ip4/0.0.0.0/tcp/4001")
    assert notifier.status("3 peers")
    assert notifier.watchdog()
    assert notifier.stopping()
    assert notifier.extend_timeout(12.5)
    notifier.close()

    assert fake_systemd.messages() == [
        {"READY": "1", "STATUS": "listening on /ip4/0.0.0.0/tcp/4001"},
        {"STATUS": "3 peers"},
        {"WATCHDOG": "1"},
        {"STOPPING": "1"},
        {"EXTEND_TIMEOUT_USEC": "12500000"},
    ]


def test_abstract_socket_address_with_at_sign_is_reached(abstract_fake_systemd: FakeSystemd) -> None:
    notifier = Notifier.from_env({"NOTIFY_SOCKET": abstract_fake_systemd.env_value})

    assert notifier.ready()
    assert abstract_fake_systemd.messages() == [{"READY": "1"}]


def test_status_with_newlines_stays_one_assignment(fake_systemd: FakeSystemd) -> None:
    notifier = Notifier.from_env({"NOTIFY_SOCKET": fake_systemd.env_value})
    notifier.status("line one\nREADY=1\n  line two")

    assert fake_systemd.messages() == [{"STATUS": "line one READY=1 line two"}]


def test_without_notify_socket_every_call_is_a_no_op() -> None:
    notifier = Notifier.from_env({})

    assert not notifier.enabled
    assert notifier.watchdog_interval_s is None
    assert not notifier.ready("x")
    assert not notifier.watchdog()
    assert not notifier.stopping()


def test_unsupported_notify_addresses_disable_notifications() -> None:
    assert parse_notify_address("relative/path.sock") is None
    assert parse_notify_address("vsock:2:1234") is None
    assert parse_notify_address("@") is None
    assert not Notifier.from_env({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled


def test_a_vanished_socket_is_reported_as_false_not_raised(tmp_path: Path) -> None:
    notifier = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})

    assert notifier.enabled
    assert not notifier.ready()


def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    pid = os.getpid()
    assert parse_watchdog_interval({"WATCHDOG_USEC": "60000000"}, pid) == 30.0
    assert parse_watchdog_interval({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": str(pid)}, pid) == 30.0


@pytest.mark.parametrize(
    "env",
    [{}, {"WATCHDOG_USEC": "0"}, {"WATCHDOG_USEC": "soon"}, {"WATCHDOG_USEC": "-5"},
     {"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": str(os.getpid() + 1)}, {"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "x"}],
    ids=["unset", "zero", "malformed", "negative", "other-pid", "malformed-pid"],
)
def test_no_watchdog_when_unset_malformed_or_meant_for_another_process(env: dict[str, str]) -> None:
    assert parse_watchdog_interval(env, os.getpid()) is None


def test_from_env_reads_the_watchdog_and_can_unset_the_environment(fake_systemd: FakeSystemd) -> None:
    env = {"NOTIFY_SOCKET": fake_systemd.env_value, "WATCHDOG_USEC": "4000000",
           "WATCHDOG_PID": str(os.getpid()), "OTHER": "kept"}
    notifier = Notifier.from_env(env, unset_environment=True)

    assert notifier.watchdog_interval_s == 2.0
    assert env == {"OTHER": "kept"}  # the torch worker must not inherit the notify socket


async def test_watchdog_loop_pings_at_half_the_timeout_with_fresh_status(
    fake_systemd: FakeSystemd, autojump_clock: trio.abc.Clock
) -> None:
    notifier = Notifier.from_env({"NOTIFY_SOCKET": fake_systemd.env_value, "WATCHDOG_USEC": "20000000"})
    calls = 0

    def status() -> str:
        nonlocal calls
        calls += 1
        return f"tick {calls}"

    with trio.move_on_after(25):  # ticks at 0, 10 and 20 s
        await watchdog_loop(notifier, status)

    assert fake_systemd.messages() == [
        {"STATUS": "tick 1", "WATCHDOG": "1"},
        {"STATUS": "tick 2", "WATCHDOG": "1"},
        {"STATUS": "tick 3", "WATCHDOG": "1"},
    ]


async def test_watchdog_loop_keeps_pinging_when_the_status_function_fails(
    fake_systemd: FakeSystemd, autojump_clock: trio.abc.Clock
) -> None:
    notifier = Notifier.from_env({"NOTIFY_SOCKET": fake_systemd.env_value, "WATCHDOG_USEC": "2000000"})

    def broken() -> str:
        raise RuntimeError("summary bug")

    with trio.move_on_after(1.5):  # ticks at 0 and 1 s
        await watchdog_loop(notifier, broken)

    assert fake_systemd.messages() == [{"WATCHDOG": "1"}, {"WATCHDOG": "1"}]


async def test_watchdog_loop_without_watchdog_only_refreshes_status(
    fake_systemd: FakeSystemd, autojump_clock: trio.abc.Clock
) -> None:
    notifier = Notifier.from_env({"NOTIFY_SOCKET": fake_systemd.env_value})

    with trio.move_on_after(15):  # default 10 s period: ticks at 0 and 10 s
        await watchdog_loop(notifier, lambda: "idle")

    assert fake_systemd.messages() == [{"STATUS": "idle"}, {"STATUS": "idle"}]


async def test_watchdog_loop_returns_at_once_outside_systemd() -> None:
    with trio.fail_after(1):
        await watchdog_loop(Notifier.from_env({}), lambda: "never sent")


def test_summarize_status_copes_with_full_and_network_only_statuses() -> None:
    full = {
        "connected_peers": ["a", "b", "c"],
        "training": {"step": 1200, "outer_step": 12, "loss": 2.31449},
        "sync": {"rounds": 11, "solo_rounds": 1, "failures": 0},
    }
    assert summarize_status(full) == "peers 3 | step 1200 outer 12 loss 2.314 | sync 11 rounds (1 solo, 0 failed)"
    assert summarize_status({"connected_peers": []}) == "peers 0"
    assert summarize_status({"training": {"loss": None}, "sync": {"rounds": "x"}}) == "running"
