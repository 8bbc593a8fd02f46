"""What an operator sees when something is wrong (issue #14, items 3, 4, 7, 12): a task or device the worker
cannot load stops the start with one line and exit 2; a worker that keeps failing says why in `status`,
which exits 3 once training has failed for good; a read-only HOME is one line (and a doctor finding); plus
the small CLI contracts (`--version`, a command's own usage, `plot` while the daemon runs)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import stat
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import torch
import trio

from node.bridge.exchange import solo_exchange
from node.bridge.supervisor import Lifetimes, WorkerSupervisor
from node.cli import main as cli_main
from node.config.home import Home
from node.config.train import TrainConfig
from node.ops.control import request_sync
from node.ops.history import HistoryError, LossHistory
from node.ops.sdnotify import summarize_status
from node.ops.status_view import render_status
from node.worker.task import TaskError, resolve_device
from starling_testing.daemon import STARLING, TINY, TINY_TRAIN, DaemonGroup, starling

# Tasks that go wrong in the ways operators meet: a factory that raises, a loss() that raises, and a
# factory that works once (the daemon's start-up check) and then fails (the worker): "failed for good".
TASKS = textwrap.dedent('''
    import os
    from node.tasks.stdlib_lm import make_task as _make

    def raising_factory(ctx):
        raise RuntimeError("the dataset server is down")

    def broken_loss(ctx):
        task = _make(ctx)
        def loss(model, batch):
            raise ZeroDivisionError("the loss is broken on purpose")
        task.loss = loss
        return task

    def works_once(ctx):
        marker = os.environ["ONCE_MARKER"]
        if os.path.exists(marker):
            raise FileNotFoundError("the dataset vanished after the start-up check")
        open(marker, "w").close()
        return _make(ctx)
''')


@pytest.fixture
def tasks_env(tmp_path: Path) -> dict[str, str]:
    """Environment that makes `optasks` importable by the daemon and its worker."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "optasks.py").write_text(TASKS)
    path = os.pathsep.join(p for p in (str(mods), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "ONCE_MARKER": str(tmp_path / "once-marker")}


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


# --- item 3: task and device errors stop the start ----------------------------------------------------------


BAD_TRAIN = [
    pytest.param(["--set", "train.task=nosuchmodule_xyz:make_task"], "cannot import 'nosuchmodule_xyz'", id="unimportable"),
    pytest.param(["--set", "train.task=optasks:raising_factory"], "RuntimeError: the dataset server is down", id="raising-factory"),
    pytest.param(["--set", "train.device=cuda"], "no CUDA device is available", id="missing-cuda"),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("args", "reason"), BAD_TRAIN)
def test_a_task_or_device_the_worker_cannot_load_exits_2_with_one_line_before_ready(
    tmp_path: Path, tasks_env: dict[str, str], args: list[str], reason: str
) -> None:
    if "train.device=cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    home = tmp_path / "home"
    assert starling("init", "--home", str(home)).returncode == 0
    r = starling("run", "--home", str(home), "--listen", "/ip4/127.0.0.1/tcp/0", *TINY_TRAIN, *args,
                 env=tasks_env, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = _error_lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("starling: error: train.") and reason in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    # It stopped before the daemon was ready: nothing was listening, no control socket was ever served.
    assert "listening on" not in r.stderr and not (Home(home).control_socket).exists()


@pytest.mark.slow
def test_status_exits_3_and_shows_the_error_once_training_has_failed_for_good(
    group: DaemonGroup, tasks_env: dict[str, str]
) -> None:
    d = group.start("once", *TINY, "--set", "train.task=optasks:works_once", env=tasks_env)
    deadline = time.monotonic() + 120
    while (as_json := starling("status", "--home", str(d.home), "--json")).returncode != 3:
        assert as_json.returncode in (0, 1), as_json  # training still, or not up yet
        assert time.monotonic() < deadline and d.proc is not None and d.proc.poll() is None, d.log()
        time.sleep(0.5)
    training = json.loads(as_json.stdout)["training"]
    assert training["state"] == "failed" and "the dataset vanished" in training["error"]
    human = starling("status", "--home", str(d.home))
    assert human.returncode == 3, human
    assert "training failed: train.task: optasks:works_once failed: FileNotFoundError: the dataset vanished" in human.stdout


@pytest.mark.slow
def test_the_exception_a_crashing_worker_died_of_is_shown_by_status(group: DaemonGroup, tasks_env: dict[str, str]) -> None:
    d = group.start("crash", *TINY, "--set", "train.task=optasks:broken_loss", env=tasks_env)
    st = d.wait_status(lambda s: "ZeroDivisionError" in str((s.get("training") or {}).get("error")), timeout=120)
    assert "ZeroDivisionError: the loss is broken on purpose" in st["training"]["error"]
    human = starling("status", "--home", str(d.home))
    assert human.returncode in (0, 3)  # 3 once the restart budget is spent
    assert "ZeroDivisionError: the loss is broken on purpose" in human.stdout


async def wait_until(predicate, timeout: float = 120.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.05)


@pytest.mark.slow
async def test_a_worker_that_keeps_crashing_is_given_up_after_its_restart_budget(
    tmp_path: Path, tasks_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in tasks_env.items():
        monkeypatch.setenv(key, value)
    cfg = TrainConfig(d_model=32, n_layers=1, n_heads=2, seq_len=32, batch_size=4, data_bytes=100_000,
                      eval_batches=1, task="optasks:broken_loss")
    sup = WorkerSupervisor(cfg, tmp_path, "peer-a", solo_exchange,
                           lifetimes=Lifetimes(backoff_initial=0.05, max_restarts=2))
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        await wait_until(lambda: sup.status()["state"] == "failed")
        await trio.sleep(0.5)  # and it stays failed: no further restart
        status = sup.status()
        assert status["restarts"] == 2 and status["pid"] is None
        assert status["error"].startswith("the worker failed 3 times in a row; last: worker exited (exit code 1)")
        assert status["error"].endswith("ZeroDivisionError: the loss is broken on purpose")
        nursery.cancel_scope.cancel()


def test_a_cuda_index_beyond_the_machines_gpus_is_a_task_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(TaskError, match=r"cuda:3 requested but this machine has 1 CUDA device"):
        resolve_device("cuda:3")


def _failed_status() -> dict:
    return {"peer_id": "p", "connected_peers": [], "training": {
        "task": "t", "device": "cpu", "state": "failed", "step": 0, "outer_step": 0, "restarts": 5,
        "error": "the worker failed 6 times in a row; last: worker exited (exit code 1): ValueError: nope"}}  # fmt: skip


def test_the_readable_status_and_systemds_status_line_say_why_training_failed() -> None:
    st = _failed_status()
    assert "training failed: the worker failed 6 times in a row; last: worker exited (exit code 1): ValueError: nope" \
        in render_status(st)
    assert summarize_status(st).startswith("TRAINING FAILED: the worker failed 6 times")
    st["training"].update(state="training", restarts=1, error="worker exited (exit code 1): ValueError: nope")
    assert "last worker error: worker exited (exit code 1): ValueError: nope" in render_status(st)
    assert "FAILED" not in summarize_status(st)


# --- item 4: a read-only HOME ----------------------------------------------------------------------------------


def _in_read_only_home(home: Path, *args: str) -> subprocess.CompletedProcess:
    """Run `starling ARGS` with HOME read-only: a read-only bind mount in a private mount namespace as root
    (mode bits do not stop root), mode 0500 otherwise."""
    if os.geteuid() != 0:
        home.chmod(0o500)
        try:
            return starling(*args)
        finally:
            home.chmod(0o700)
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--mount", "true"]).returncode != 0:
        pytest.skip("cannot make a private mount namespace here")
    script = 'mount --bind -o ro "$0" "$0" && exec "$@"'
    return subprocess.run(["unshare", "--mount", "sh", "-c", script, str(home), *STARLING, *args],
                          capture_output=True, text=True, timeout=60)


def test_a_read_only_home_is_one_line_with_exit_2_and_a_doctor_error(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert starling("init", "--home", str(home)).returncode == 0
    r = _in_read_only_home(home, "run", "--home", str(home), "--listen", "/ip4/127.0.0.1/tcp/0", "--no-train")
    assert r.returncode == 2, r.stderr
    lines = _error_lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"starling: error: {home}: cannot be this node's home: "), r.stderr
    assert "read-only file system" in lines[0] or "not writable" in lines[0]
    doctor = _in_read_only_home(home, "doctor", "--home", str(home))
    assert doctor.returncode == 1, doctor.stdout
    assert "ERROR  home" in doctor.stdout and "cannot hold a running node" in doctor.stdout
    assert "ok     home" in starling("doctor", "--home", str(home)).stdout


# --- item 7: the members table ------------------------------------------------------------------------------


def test_the_members_table_shows_the_inner_step_as_step_and_the_outer_step_as_outer() -> None:
    member = {"peer_id": "12D3KooWMemberMemberMember01", "state": "alive", "role": "trainer", "step": 1234,
              "outer_step": 56, "loss": 2.5, "samples_per_s": 10.0, "partners": [], "last_seen_s": 1.0}
    text = render_status({"members": [member]})
    header = next(line for line in text.splitlines() if line.startswith("  member"))
    row = next(line for line in text.splitlines() if line.startswith("  12D3Ko"))
    assert row[header.index("step"):].split()[0] == "1234"
    assert row[header.index("outer"):].split()[0] == "56"


# --- item 12: the smaller ones ----------------------------------------------------------------------------------


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        cli_main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"starling {version('starling')}"


@pytest.mark.parametrize("command", ["run", "status", "doctor", "plot"])
def test_an_unknown_option_prints_the_commands_own_usage(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main([command, "--foo"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith(f"usage: starling {command} ") and f"starling {command}: error: unrecognized arguments: --foo" in err


def test_a_home_created_by_run_is_private_like_one_created_by_init(tmp_path: Path) -> None:
    home = tmp_path / "fresh" / "home"
    proc = subprocess.Popen([*STARLING, "run", "--home", str(home), "--listen", "/ip4/127.0.0.1/tcp/0", "--no-train"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (Home(home).control_socket).exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.2)
        assert stat.S_IMODE(home.stat().st_mode) == 0o700
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)


@pytest.mark.slow
def test_plot_right_after_start_asks_the_daemon_and_the_curve_starts_at_the_first_inner_step(group: DaemonGroup) -> None:
    d = group.start("plotter", *TINY)
    st = d.wait_status(lambda s: (s.get("training") or {}).get("loss") is not None, timeout=120)
    assert st["uptime_s"] < 30 and not (d.home / "history.msgpack").exists()  # the daemon has not saved it yet
    out = d.home.parent / "loss.png"
    r = starling("plot", "--home", str(d.home), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    own = request_sync(Home(d.home).control_socket, {"cmd": "history"})["history"][st["peer_id"]]
    # The first point is the first inner step of a fresh model (the loss of uniform bytes is ln 256 = 5.5),
    # not the member record's value a heartbeat and some hundred steps later.
    assert own["step"][0] == 1 and own["loss"][0] > 5.0, own


def test_a_daemons_history_answer_is_read_back_exactly_and_garbage_is_refused() -> None:
    h = LossHistory()
    for s in range(1, 40):
        h.observe("12D3KooWA", s * 3, s // 5, 5.0 - s * 0.05, 4.0 if s % 10 == 0 else None, 1e9 + s)
    h.observe("12D3KooWB", 7, 1, None, 3.0, 1e9)
    assert LossHistory.from_series(json.loads(json.dumps(h.series()))).series() == h.series()
    good = h.series()["12D3KooWA"]
    garbage = [
        [],  # not a mapping
        {7: good},  # a peer id that is not a string
        {"12D3KooWA": {**good, "step": good["step"][::-1]}},  # steps going backwards
        {"12D3KooWA": {**good, "loss": ["5"] * len(good["loss"])}},  # a loss that is not a number
        {"12D3KooWA": {**good, "t": good["t"][:-1]}},  # columns of different lengths
    ]
    for bad in garbage:
        with pytest.raises(HistoryError):
            LossHistory.from_series(bad)


def test_the_train_config_survives_the_json_that_the_start_up_check_reads() -> None:
    # The start-up check sends the train config as JSON: every field must survive the round trip.
    cfg = dataclasses.replace(TrainConfig(), task="optasks:broken_loss")
    again = TrainConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))
    again.validate()
    assert again == cfg
