"""Chaos run: N trainers as local processes; every INTERVAL seconds one is SIGKILLed and restarted at once.

What it does. A network-only bootstrap node (never killed) and N trainer daemons (`python -m node.cli run`,
a tiny model so that six fit on two cores) start on 127.0.0.1 and train together until every trainer
reports a loss. Then, for SECONDS, every INTERVAL seconds a random trainer that is up is killed with
SIGKILL - by default the whole node: the daemon and every process under it (its torch worker, the
resource tracker), as a power cut or `docker kill` would - and restarted at once on the same HOME. Kills
fall at INTERVAL, 2 x INTERVAL, ... before SECONDS, so the last stretch is quiet. Then the script waits
for the member tables to agree and for the last restarted trainers to train again, stops every daemon
with SIGTERM and verifies the checkpoints on disk. The HOMEs and logs are kept when a check fails.

What it checks (exit code 1 if any check fails):

(a) deadlines: no exchange took longer than its deadline. Each daemon runs with `--log-level debug`, so
    the averager logs every outer step's whole exchange ("outer step K: averaged|solo after X s": pairing
    window, handshake and transfer); the longest must stay within the bound the averager's own deadlines
    give (`sync.pair_window_s` + 2 x `sync.handshake_timeout_s` + the transfer's bound + 1.5 s for the
    shielded stream close), and the supervisor's hard cap (`train.exchange_timeout`) must never fire.
(b) resume: every restarted trainer resumed from the newest checkpoint on its disk at the time of the kill
    (its `training.resumed_step`), not from step 0, and its step counter never went below it afterwards.
(c) checkpoints: after the graceful stop, every checkpoint file in every HOME passes the checkpoint
    module's own verification (`read_checkpoint`: header, length, SHA-256, weights-only load); none was set
    aside as corrupt during the run, no temp file is left, and every daemon exited with status 0.
(d) loss: the swarm's mean training loss over the last WINDOW seconds of the chaos is below its mean over
    the first WINDOW seconds (WINDOW = 30 s, or a third of the run if that is shorter).
(e) members: once the kills stop, every node's member table shows the same set of alive members (all of
    them) within 15 s.
(f) newcomer: the churned swarm still accepts new members. After the checks above have had their time, a
    trainer with a fresh identity (a new, empty HOME) starts with the same bootstrap file and must, within
    120 s, connect, be listed alive by every other node, and average with one of the trainers at least once
    (its `sync.rounds`). The script prints a one-line verdict on it ("newcomer: PASS ...").

    .venv/bin/python bench/chaos.py                  # 6 trainers, a kill every 20 s for 180 s
    .venv/bin/python bench/chaos.py --daemons 8 --minutes 30   # issue #26's acceptance run
    .venv/bin/python bench/chaos.py --quick          # 3 trainers, a kill every 10 s for 40 s
    .venv/bin/python bench/chaos.py --write-docs     # also record the figures in docs/reliability.md
    .venv/bin/python bench/chaos.py --target daemon  # kill only the daemon; its worker checkpoints and exits
    .venv/bin/python bench/chaos.py --set node.heartbeat_s=0.5   # any daemon setting, for every node
    .venv/bin/python bench/chaos.py --wipe --nodes 4 --interval 60 --minutes 10   # issue #55's rejoin run

`--wipe`: every killed trainer comes back with its HOME wiped (a new identity, no checkpoint: a machine
replaced), so it must late-join from the swarm's live weights. Check (b) then reads "(b) wiped nodes rejoin":
each restart's late join ended "done" (it started from donors, not a fresh model) and its first averaged
outer step came within `REJOIN_WITHIN` of its own outer steps (issue #55's acceptance: 5).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.config.home import Home
from node.config.sync import SyncConfig
from node.worker.checkpoint import CheckpointError, read_checkpoint
from protocols.avg import WATCH_S, TransferLimits
from starling_testing.daemon import DaemonProc  # starts a daemon, its log in HOME
from starling_testing.report import replace_section

ROOT = Path(__file__).resolve().parent.parent

DOCS = ROOT / "docs" / "reliability.md"
SECTION = "## Chaos run"
REJOIN_SECTION = "## Rejoin run (wiped HOMEs)"  # --wipe's figures (issue #55)
SWARM = "chaos"

# A tiny model (the one tests/test_swarm.py uses) so that six trainers and their daemons share two cores;
# a checkpoint every 2 outer steps, so that a kill always has a recent one to resume from.
# A fresh swarm has no trained member to late-join from: waiting the default 10 s for one only slows the
# start (a restarted node has its own checkpoint and does not look for donors).
SYNC = {"pair_window_s": 2.0, "backoff_s": 1.0, "join_wait_s": 3.0}
TRAIN = {
    "d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32, "batch_size": 4, "inner_steps": 5,
    "data_bytes": 300_000, "warmup": 10, "lr": 0.003, "max_lag": 5, "checkpoint_every": 2,
    "checkpoint_min_s": 0.0, "eval_batches": 1,
}
# Heartbeats, suspect and gone times are the daemon's defaults (2 s, 15 s, 60 s). The 0.5 s / 3 s / 6 s of
# the swarm tests overload gossip with seven daemons on two busy cores: records arrive ever later and every
# member turns "gone" on most nodes within a minute, even with no training and no kills at all
# (docs/reliability.md, "Chaos run: what did not hold").
REJOIN_WITHIN = 5  # --wipe: a rejoin's own outer steps before its first averaged one, at most (issue #55)
CLOSE_GRACE_S = 1.5  # the initiator's shielded stream close (1 s) and its short sleeps between tries

# node/averaging/averager.py: "outer step K: averaged in a group of N after X s" | "outer step K: solo after X s"
EXCHANGE_LINE = re.compile(r"outer step (\d+): (averaged|solo)(?: in a group of \d+)? after ([0-9.]+)s")
HARD_CAP_LINE = re.compile(r"outer exchange \d+ timed out after")  # node/bridge/supervisor.py: exchange_timeout hit
FAILED_LINE = "exchange with "  # node/averaging/averager.py: "exchange with X failed: ..."


@dataclass
class ChaosPlan:
    """What to run (the command-line flags)."""

    nodes: int = 6
    seconds: float = 180.0
    interval: float = 20.0
    target: str = "node"  # node: the daemon and its worker | daemon: the daemon only
    seed: int = 0
    converge_within_s: float = 15.0
    poll_s: float = 1.0
    startup_timeout_s: float = 240.0
    newcomer_within_s: float = 120.0  # (f): connected, listed alive by all and averaged by then
    extra: tuple[str, ...] = ()  # more SECTION.OPTION=VALUE settings for every daemon (--set)
    wipe: bool = False  # a killed trainer restarts with an empty HOME (new identity, no checkpoint)

    @property
    def window_s(self) -> float:
        """The length of the first and last loss windows."""
        return min(30.0, self.seconds / 3)

    def daemon_args(self) -> list[str]:
        args = ["--listen", "/ip4/127.0.0.1/tcp/0", "--swarm", SWARM, "--log-level", "debug"]
        for section, options in (("sync", SYNC), ("train", TRAIN)):
            for key, value in options.items():
                args += ["--set", f"{section}.{key}={value}"]
        for setting in self.extra:
            args += ["--set", setting]
        return args


QUICK = ChaosPlan(nodes=3, seconds=40.0, interval=10.0)


@dataclass
class Kill:
    """One kill and what the restarted node did."""

    at_s: float  # since the chaos began
    node: str
    pids: list[int]
    disk_step: int | None  # the newest checkpoint file on disk right after the kill
    back_s: float | None = None  # until the new daemon answered its control socket
    training_s: float | None = None  # until its new worker was training (said hello)
    resumed_step: int | None = None
    last_step: int | None = None  # the highest step it reported in this life (it went on from the resume)
    rejected: list[str] = field(default_factory=list)  # checkpoints its worker set aside as corrupt
    seen_alive_s: float | None = None  # until every other node listed it alive again
    seen_down: bool = False  # some other node listed it suspect or gone meanwhile
    wiped: bool = False  # its HOME was wiped: it came back as a new identity that must late-join
    join: str | None = None  # its late join's state once it trained (wiped restarts)
    steps_before_averaging: int | None = None  # its own outer steps (solo, failed) before its first averaged one

    def rejoined_ok(self) -> bool:
        """A wiped restart started from the swarm's weights and averaged within REJOIN_WITHIN of its outer steps."""
        return (self.join == "done" and self.steps_before_averaging is not None
                and self.steps_before_averaging <= REJOIN_WITHIN)

    def resumed_ok(self, target: str) -> bool:
        """Resumed from the newest checkpoint at the kill (or later, when its orphaned worker wrote a
        final one: `--target daemon`), never from scratch when a checkpoint existed."""
        if self.training_s is None or self.rejected:
            return False
        if self.disk_step is None:
            return True  # killed before its first checkpoint: starting over is right
        if self.resumed_step is None or self.resumed_step <= 0:
            return False
        same = self.resumed_step == self.disk_step if target == "node" else self.resumed_step >= self.disk_step
        return same and (self.last_step or 0) >= self.resumed_step


@dataclass
class Admission:
    """(f): the fresh identity started once the churn is over, and how far it got (seconds since its start)."""

    within_s: float
    peer_id: str | None = None
    connected_s: float | None = None  # its first connection
    member_s: float | None = None  # every other node listed it alive
    averaged_s: float | None = None  # its first averaging round with a partner
    partner: str | None = None  # the node it averaged with first (by name)
    join: str | None = None  # its late join's state at the end
    exited: bool = False  # its daemon exited meanwhile

    @property
    def joined(self) -> bool:
        return None not in (self.connected_s, self.member_s, self.averaged_s) and not self.exited

    def figures(self) -> str:
        who = self.peer_id[-8:] if self.peer_id else "?"
        partner = f" (with {self.partner})" if self.partner else ""
        return (f"fresh identity ..{who}: connected after {fmt_s(self.connected_s)}, alive in every node's table "
                f"after {fmt_s(self.member_s)}, averaged{partner} after {fmt_s(self.averaged_s)} "
                f"(limit {self.within_s:g} s); late join {self.join or '-'}"
                + ("; its daemon EXITED" if self.exited else ""))


@dataclass
class Check:
    name: str
    passed: bool
    figures: str


@dataclass
class Outcome:
    """Everything measured, for the summary and the docs."""

    plan: ChaosPlan
    checks: list[Check]
    kills: list[Kill]
    skipped_kills: int
    exchanges: dict[str, Any]
    loss: dict[str, float]
    checkpoints: dict[str, Any]
    converge_s: float | None
    phases: dict[str, float]  # seconds spent in each phase of the run, in order
    cpu: dict[str, float]  # CPU use at the end of the chaos (see ChaosRun.cpu_use)
    admission: Admission  # (f)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)


class ChaosError(Exception):
    """The run could not be carried out (a daemon did not start); the message says why."""


# --- one node ---------------------------------------------------------------------------------------------


class Node:
    """One daemon on its own HOME, restartable; talks to it through its control socket (no CLI spawn,
    which would cost a second of CPU per call on a loaded machine)."""

    def __init__(self, name: str, home: Path, args: list[str]) -> None:
        self.name = name
        self.home = home
        self.args = args
        self.proc: DaemonProc | None = None
        self.peer_id: str | None = None

    def start(self) -> None:
        self.proc = DaemonProc(self.home, self.args).start()

    def status(self) -> dict[str, Any] | None:
        """The daemon's status, or None while it is down or starting."""
        st = self.proc.status(timeout=5.0) if self.proc is not None and self.proc.running() else None
        if st is not None:
            self.peer_id = st.get("peer_id", self.peer_id)
        return st

    def kill(self, target: str) -> list[int]:
        """SIGKILL the daemon (and, for target "node", every process under it); the pids killed."""
        assert self.proc is not None and self.proc.proc is not None
        daemon = self.proc.proc.pid
        victims = [daemon] + (descendants(daemon) if target == "node" else [])
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.proc.wait(10)
        return victims

    def force_stop(self) -> None:
        if self.proc is not None and self.proc.proc is not None and self.proc.proc.poll() is None:
            for pid in [self.proc.proc.pid] + descendants(self.proc.proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.proc.wait(10)

    def log(self) -> str:
        return self.proc.log() if self.proc is not None else ""

    def newest_checkpoint_on_disk(self) -> int | None:
        files = Home(self.home).checkpoint_files()
        return files[0][0] if files else None


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (read from /proc, children before their own children)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces and parentheses; the fields after the last ")" are fixed.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop(0)
        found.append(child)
        todo += children.get(child, [])
    return found


def core_share(pid: int) -> float:
    """The process's CPU time divided by its age: 1.0 = one core busy all its life (nan if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return float("nan")
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
    age = uptime - int(fields[19]) / ticks  # starttime
    return cpu / age if age > 0 else float("nan")


def is_worker(pid: int) -> bool:
    try:
        return b"node.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def alive_set(status: dict[str, Any] | None) -> frozenset[str]:
    if status is None:
        return frozenset()
    return frozenset(m["peer_id"] for m in status.get("members", []) if m.get("state") == "alive")


def listed(status: dict[str, Any] | None) -> frozenset[str]:
    """Every member in a node's table, whatever its state."""
    return frozenset(m["peer_id"] for m in (status or {}).get("members", []))


def training(status: dict[str, Any] | None) -> dict[str, Any]:
    return (status or {}).get("training") or {}


# --- the run ----------------------------------------------------------------------------------------------


class ChaosRun:
    """One chaos run in `root` (one HOME per node): `run()` starts, kills, waits, stops, verifies, judges."""

    def __init__(self, plan: ChaosPlan, root: Path) -> None:
        self.plan = plan
        self.root = root
        self.rng = random.Random(plan.seed)
        addr_file = str(root / "boot.addr")
        args = [*plan.daemon_args(), "--bootstrap-file", addr_file]
        boot_args = ["--listen", "/ip4/127.0.0.1/tcp/0", "--swarm", SWARM, "--no-train", "--addr-file", addr_file]
        for setting in plan.extra:
            if setting.startswith("node."):  # heartbeat and liveness settings concern the bootstrap node too
                boot_args += ["--set", setting]
        self.boot = Node("boot", root / "boot", boot_args)
        self.trainers = [Node(f"n{i}", root / f"n{i}", args) for i in range(plan.nodes)]
        # (f): a trainer with a fresh identity, started once the churn is over; never killed.
        self.newcomer = Node("new", root / "new", args)
        self.losses: list[tuple[float, float]] = []  # (seconds since the chaos began, swarm mean loss)
        self.kills: list[Kill] = []
        self.skipped_kills = 0
        # For the transfer bound: the largest round (both ways).
        self.round_bytes = 0
        self.t0 = self.chaos_end = 0.0  # monotonic times: the chaos began, the kills stopped
        self.views = ""  # the member tables at the last convergence poll
        self.cpu: dict[str, float] = {}

    @property
    def nodes(self) -> list[Node]:
        """Every node started so far (the newcomer once it was)."""
        return [self.boot, *self.all_trainers]

    @property
    def all_trainers(self) -> list[Node]:
        """The churned trainers and, once started, the newcomer: their exchanges and checkpoints are
        judged alike."""
        return [*self.trainers, *([self.newcomer] if self.newcomer.proc is not None else [])]

    def run(self) -> Outcome:
        phases: dict[str, float] = {}
        mark = time.monotonic()

        def phase(name: str) -> None:
            nonlocal mark
            phases[name] = time.monotonic() - mark
            mark = time.monotonic()

        try:
            self.start_swarm()
            phase("start-up")
            self.chaos()
            phase("chaos")
            self.cpu = self.cpu_use()
            converge_s = self.converge()
            phase("convergence")
            self.wait_for_restarts()
            phase("last restarts")
            admission = self.admit_newcomer()
            phase("newcomer")
            exits = self.stop_all()
            phase("graceful stop")
        finally:
            for n in self.nodes:
                n.force_stop()
        checkpoints = self.verify_checkpoints(exits)
        phase("verification")
        return self.judge(checkpoints, converge_s, phases, admission)

    def start_swarm(self) -> None:
        """Start the bootstrap node and the trainers together (the trainers read the bootstrap's address
        from the file it writes once listening) and wait until every trainer reports a loss."""
        for n in self.nodes:
            n.start()
        print(f"started {len(self.trainers)} trainers and a bootstrap node in {self.root}; waiting for a loss "
              "from every trainer", flush=True)
        deadline = time.monotonic() + self.plan.startup_timeout_s
        while True:
            statuses = [n.status() for n in self.trainers]
            if all(training(st).get("loss") is not None for st in statuses):
                return
            for n in self.nodes:
                if n.proc is not None and n.proc.proc is not None and n.proc.proc.poll() is not None:
                    raise ChaosError(f"{n.name} exited during start-up:\n{n.log()[-3000:]}")
            if time.monotonic() > deadline:
                waiting = [n.name for n, st in zip(self.trainers, statuses, strict=True)
                           if training(st).get("loss") is None]
                raise ChaosError(f"no loss from {', '.join(waiting)} within {self.plan.startup_timeout_s:.0f} s")
            time.sleep(1.0)

    def chaos(self) -> None:
        plan = self.plan
        self.t0 = t0 = time.monotonic()
        next_kill = plan.interval
        print(f"chaos: a SIGKILL ({plan.target}) every {plan.interval:g} s for {plan.seconds:g} s", flush=True)
        while (now := time.monotonic() - t0) < plan.seconds:
            tick = time.monotonic()
            statuses = {n.name: n.status() for n in self.nodes}
            self.record(now, statuses)
            self.follow_restarts(now, statuses)
            if now >= next_kill:
                self.kill_one(now, statuses)
                next_kill += plan.interval
            time.sleep(max(0.0, plan.poll_s - (time.monotonic() - tick)))
        self.chaos_end = t0 + plan.seconds

    def record(self, now: float, statuses: dict[str, dict[str, Any] | None]) -> None:
        losses = [training(statuses[n.name]).get("loss") for n in self.trainers]
        finite = [x for x in losses if isinstance(x, (int, float))]
        if finite:
            self.losses.append((now, statistics.fmean(finite)))
        for st in statuses.values():
            sync = (st or {}).get("sync") or {}
            if sync.get("last_bytes"):
                self.round_bytes = max(self.round_bytes, int(sync["last_bytes"]))

    def kill_one(self, now: float, statuses: dict[str, dict[str, Any] | None]) -> None:
        """Kill a random trainer that is up and training (one still coming back from a kill is spared)."""
        ready = [n for n in self.trainers if training(statuses[n.name]).get("state") == "training"
                 and not any(k.node == n.name and k.training_s is None for k in self.kills)]
        if not ready:
            self.skipped_kills += 1
            print(f"{now:6.1f}s  no trainer is up to kill; skipped", flush=True)
            return
        victim = self.rng.choice(ready)
        pids = victim.kill(self.plan.target)
        kill = Kill(at_s=now, node=victim.name, pids=pids, disk_step=victim.newest_checkpoint_on_disk(),
                    wiped=self.plan.wipe)
        if kill.wiped:  # a replaced machine: no identity, no checkpoint (the log goes with the HOME)
            shutil.rmtree(victim.home)
            victim.peer_id = None
        victim.start()
        self.kills.append(kill)
        print(f"{now:6.1f}s  killed {victim.name} (pids {', '.join(map(str, pids))}); newest checkpoint on "
              f"disk: step {kill.disk_step}; restarted" + (" with its HOME wiped" if kill.wiped else ""), flush=True)

    def follow_restarts(self, now: float, statuses: dict[str, dict[str, Any] | None]) -> None:
        """Fill in each recent kill's recovery: daemon back, worker resumed, seen alive by the others."""
        for kill in self.kills:
            node = next(n for n in self.trainers if n.name == kill.node)
            st = statuses[node.name]
            since = now - kill.at_s
            if kill.back_s is None and st is not None:
                kill.back_s = since
            tr = training(st)
            if kill.training_s is not None and kill is self.latest_kill(node.name) and tr.get("step") is not None:
                kill.last_step = max(kill.last_step or 0, int(tr["step"]))
            if kill.training_s is None and tr.get("state") == "training":
                kill.training_s = since
                kill.resumed_step = tr.get("resumed_step")
                kill.last_step = tr.get("step")
                kill.rejected = list(tr.get("checkpoint_rejected") or [])
                print(f"{now:6.1f}s  {node.name} is training again after {since:.1f} s, resumed at step "
                      f"{kill.resumed_step}", flush=True)
            if kill.wiped and kill.training_s is not None and kill.steps_before_averaging is None and st is not None:
                own = tr.get("exchanges") or {}
                kill.join = (st.get("join") or {}).get("state")
                if own.get("group", 0) >= 1:
                    kill.steps_before_averaging = int(own.get("solo", 0)) + int(own.get("failed", 0))
                    print(f"{now:6.1f}s  {node.name} (wiped) averaged after {kill.steps_before_averaging} outer "
                          f"steps of its own; late join: {kill.join}", flush=True)
            if kill.seen_alive_s is None and node.peer_id is not None and any(
                node.peer_id in listed(o) and node.peer_id not in alive_set(o)
                for n, o in statuses.items() if n != node.name
            ):
                kill.seen_down = True
            if kill.seen_alive_s is None and kill.training_s is not None and node.peer_id is not None:
                others = [statuses[n.name] for n in self.nodes if n is not node]
                if all(node.peer_id in alive_set(o) for o in others if o is not None):
                    kill.seen_alive_s = since

    def latest_kill(self, name: str) -> Kill | None:
        return next((k for k in reversed(self.kills) if k.node == name), None)

    def cpu_use(self) -> dict[str, float]:
        """How busy the machine was: each trainer daemon's and each worker's average share of one core
        over its life so far (means), the bootstrap daemon's, and the 1-minute load average. A daemon
        starved of CPU misses heartbeats and deadlines, so these explain a failed check."""
        daemons, workers = [], []
        for n in self.trainers:
            if n.proc is not None and n.proc.proc is not None and n.proc.proc.poll() is None:
                daemons.append(core_share(n.proc.proc.pid))
                workers += [core_share(pid) for pid in descendants(n.proc.proc.pid) if is_worker(pid)]
        boot = self.boot.proc.proc.pid if self.boot.proc is not None and self.boot.proc.proc is not None else 0
        mean = statistics.fmean
        return {"daemon": mean(daemons) if daemons else float("nan"),
                "worker": mean(workers) if workers else float("nan"),
                "boot": core_share(boot) if boot else float("nan"),
                "load1": os.getloadavg()[0], "cores": float(os.cpu_count() or 1)}

    def converge(self) -> float | None:
        """Seconds after the kills stopped until every node lists the same, complete set of alive members
        (None if not within a minute). Meanwhile `self.views` keeps who saw whom as what, for the report."""
        deadline = self.chaos_end + 60.0
        while time.monotonic() < deadline:
            now = time.monotonic()
            statuses = {n.name: n.status() for n in self.nodes}
            self.follow_restarts(now - self.t0, statuses)
            self.views = self.member_views(statuses)
            everyone = {n.peer_id for n in self.nodes}
            if None not in everyone and all(alive_set(st) == everyone for st in statuses.values()):
                return max(0.0, now - self.chaos_end)
            time.sleep(0.5)
        return None

    def wait_for_restarts(self, timeout: float = 60.0) -> None:
        """Give the nodes killed last the time to train again, so that check (b) judges every restart."""
        deadline = time.monotonic() + timeout
        while any(k.training_s is None or (k.wiped and k.steps_before_averaging is None) for k in self.kills) \
                and time.monotonic() < deadline:
            statuses = {n.name: n.status() for n in self.nodes}
            self.follow_restarts(time.monotonic() - self.t0, statuses)
            time.sleep(0.5)

    def admit_newcomer(self) -> Admission:
        """(f) Start a trainer with a fresh identity and follow it until it has connected, every other node
        lists it alive and it averaged once, or `newcomer_within_s` passed; print the verdict in one line."""
        node, adm = self.newcomer, Admission(within_s=self.plan.newcomer_within_s)
        others = [self.boot, *self.trainers]
        names = {n.peer_id: n.name for n in others if n.peer_id}
        node.start()
        began = time.monotonic()
        print(f"newcomer: a trainer with a fresh identity starts in {node.home}", flush=True)
        st: dict[str, Any] | None = None
        while not adm.joined and (since := time.monotonic() - began) < adm.within_s:
            st = node.status()
            adm.peer_id = node.peer_id
            if node.proc is not None and node.proc.proc is not None and node.proc.proc.poll() is not None:
                adm.exited = True
                break
            if st is not None:
                self.follow_newcomer(adm, since, st, [o.status() for o in others], names)
            time.sleep(self.plan.poll_s)
        adm.join = ((st or {}).get("join") or {}).get("state")
        verdict = "PASS" if adm.joined else "FAIL"
        print(f"newcomer: {verdict} {'a fresh identity joined' if adm.joined else 'no fresh identity joined'} "
              f"the swarm after {len(self.kills)} kills: {adm.figures()}", flush=True)
        return adm

    @staticmethod
    def follow_newcomer(adm: Admission, since: float, st: dict[str, Any], others: list[dict[str, Any] | None],
                        names: dict[str, str]) -> None:
        """Note each first: a connection, every other node listing it alive, an averaging round."""
        if adm.connected_s is None and st.get("connected_peers"):
            adm.connected_s = since
        if adm.member_s is None and adm.peer_id is not None and all(
            o is not None and adm.peer_id in alive_set(o) for o in others
        ):
            adm.member_s = since
        sync = st.get("sync") or {}
        if adm.averaged_s is None and int(sync.get("rounds") or 0) >= 1:
            adm.averaged_s = since
            partner = sync.get("last_partner")
            adm.partner = names.get(partner, str(partner)[-8:]) if partner else None

    def member_views(self, statuses: dict[str, dict[str, Any] | None]) -> str:
        """"n0: n1=alive n2=suspect ...; n1: down; ..." - each node's view of every other (by node name)."""
        names = {n.peer_id: n.name for n in self.nodes if n.peer_id}
        parts = []
        for name, st in statuses.items():
            if st is None:
                parts.append(f"{name}: down")
                continue
            seen = {names.get(m["peer_id"], m["peer_id"][-6:]): m["state"] for m in st.get("members", [])}
            connected = len(st.get("connected_peers", []))
            gossip = ((st.get("swarm_totals") or {}).get("replication") or {}).get("gossip_received")
            parts.append(f"{name} ({connected} connected, {gossip} gossip records received): "
                         + " ".join(f"{k}={v}" for k, v in sorted(seen.items()) if k != name))
        return "; ".join(parts)

    def stop_all(self, timeout: float = 30.0) -> dict[str, int | None]:
        """SIGTERM every daemon once, all at once; each exit status (None: still running after `timeout`
        seconds, and then killed by `run`'s clean-up)."""
        procs = {n.name: n.proc.proc for n in self.nodes if n.proc is not None and n.proc.proc is not None}
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        exits: dict[str, int | None] = {}
        for name, p in procs.items():
            try:
                exits[name] = p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                exits[name] = None
        return exits

    # --- after the run ---

    def verify_checkpoints(self, exits: dict[str, int | None]) -> dict[str, Any]:
        """Verify every checkpoint file with the checkpoint module's own reader."""
        good, corrupt = 0, []
        for n in self.all_trainers:
            for _, path in sorted(Home(n.home).checkpoint_files()):
                try:
                    read_checkpoint(path)
                    good += 1
                except CheckpointError as e:
                    corrupt.append(f"{path.relative_to(self.root)}: {e}")
        set_aside = sorted(str(p.relative_to(self.root)) for p in self.root.glob("*/checkpoints/*/*.corrupt"))
        temp = sorted(str(p.relative_to(self.root)) for p in self.root.glob("*/checkpoints/*/.ckpt-tmp-*"))
        without = [n.name for n in self.trainers if not Home(n.home).checkpoint_files()]
        bad_exits = {name: code for name, code in exits.items() if code != 0}
        return {"verified": good, "corrupt": corrupt, "set_aside": set_aside, "temp": temp,
                "without": without, "bad_exits": bad_exits, "shm_leaked": remove_leaked_shm(self.kills)}

    def exchange_bound(self) -> float:
        """The longest an exchange may take under the averager's own deadlines (see the module doc)."""
        cfg = dataclasses.replace(SyncConfig(), **SYNC)
        # protocols/avg.py TransferLimits: a transfer that is not cut moves at least the floor rate (counted
        # both ways, as last_bytes is) once it has run for the stall timeout, and is looked at every WATCH_S.
        limits = TransferLimits(stall_s=cfg.stall_timeout_s, max_s=cfg.max_transfer_s)
        transfer = min(limits.max_s, max(limits.stall_s, self.round_bytes / limits.floor_bps)) + WATCH_S
        return cfg.pair_window_s + 2 * cfg.handshake_timeout_s + transfer + CLOSE_GRACE_S

    def exchanges(self) -> dict[str, Any]:
        durations: list[tuple[float, str]] = []
        averaged = solo = hard_caps = failures = 0
        for n in self.all_trainers:
            text = n.log()
            for m in EXCHANGE_LINE.finditer(text):
                durations.append((float(m.group(3)), n.name))
                if m.group(2) == "averaged":
                    averaged += 1
                else:
                    solo += 1
            hard_caps += len(HARD_CAP_LINE.findall(text))
            failures += sum(1 for line in text.splitlines() if FAILED_LINE in line and " failed: " in line)
        longest = max(durations, default=(0.0, "-"))
        return {"count": len(durations), "averaged": averaged, "solo": solo, "longest_s": longest[0],
                "longest_node": longest[1], "median_s": statistics.median([d for d, _ in durations]) if durations else 0.0,
                "bound_s": self.exchange_bound(), "hard_caps": hard_caps, "failures": failures}

    def loss_windows(self) -> dict[str, float]:
        w = self.plan.window_s
        first = [x for t, x in self.losses if t < w]
        last = [x for t, x in self.losses if t >= self.plan.seconds - w]
        nan = float("nan")
        return {"first": statistics.fmean(first) if first else nan, "last": statistics.fmean(last) if last else nan,
                "window_s": w}

    def judge(self, ck: dict[str, Any], converge_s: float | None, phases: dict[str, float],
              admission: Admission) -> Outcome:
        plan = self.plan
        ex = self.exchanges()
        loss = self.loss_windows()
        resumed = [k for k in self.kills if k.resumed_ok(plan.target)]
        exact = sum(1 for k in self.kills if k.disk_step is not None and k.resumed_step == k.disk_step)
        steps = ", ".join(f"{k.node}@{k.resumed_step}" for k in self.kills)
        checks = [
            Check("(a) exchanges within their deadline",
                  ex["averaged"] > 0 and ex["longest_s"] <= ex["bound_s"] and ex["hard_caps"] == 0,
                  f"{ex['count']} exchanges ({ex['averaged']} averaged, {ex['solo']} solo, {ex['failures']} failed "
                  f"transfers); longest {ex['longest_s']:.2f} s ({ex['longest_node']}), median {ex['median_s']:.2f} s, "
                  f"bound {ex['bound_s']:.1f} s; hard-cap time-outs: {ex['hard_caps']}"),
            self.rejoin_check() if plan.wipe else Check(
                  "(b) restarted nodes resumed from their checkpoint",
                  bool(self.kills) and len(resumed) == len(self.kills),
                  f"{len(resumed)}/{len(self.kills)} restarts resumed ({exact} at exactly the newest file on disk): "
                  f"{steps}"),
            Check("(c) checkpoints verified after a graceful stop",
                  ck["verified"] > 0 and not (ck["corrupt"] or ck["set_aside"] or ck["temp"] or ck["without"]
                                              or ck["bad_exits"]),
                  f"{ck['verified']} files verified, {len(ck['corrupt'])} corrupt, {len(ck['set_aside'])} set aside, "
                  f"{len(ck['temp'])} temp files left, trainers without one: {len(ck['without'])}, "
                  f"non-zero exits: {ck['bad_exits'] or 'none'}"),
            Check("(d) loss falls",
                  loss["last"] < loss["first"],
                  f"swarm mean loss {loss['first']:.3f} in the first {loss['window_s']:.0f} s, {loss['last']:.3f} in "
                  f"the last {loss['window_s']:.0f} s"),
            Check("(e) member tables converge after the kills",
                  converge_s is not None and converge_s <= plan.converge_within_s,
                  f"all {len(self.nodes)} nodes list the same {len(self.nodes)} alive members "
                  + (f"{converge_s:.1f} s after the last kill window" if converge_s is not None else "never (60 s)")
                  + f" (limit {plan.converge_within_s:g} s)"
                  + ("" if converge_s is not None and converge_s <= plan.converge_within_s
                     else f"; last views: {self.views}")),
            Check("(f) a fresh identity joins the churned swarm", admission.joined, admission.figures()),
        ]
        return Outcome(plan, checks, self.kills, self.skipped_kills, ex, loss, ck, converge_s, phases, self.cpu,
                       admission)


    def rejoin_check(self) -> Check:
        """(b) with --wipe: every wiped restart late-joined and averaged within REJOIN_WITHIN outer steps."""
        ok = [k for k in self.kills if k.rejoined_ok()]
        each = ", ".join(f"{k.node}: {fmt(k.steps_before_averaging)} ({k.join or '-'})" for k in self.kills)
        return Check("(b) wiped nodes rejoin from the swarm's weights", bool(self.kills) and len(ok) == len(self.kills),
                     f"{len(ok)}/{len(self.kills)} rejoins late-joined and averaged within {REJOIN_WITHIN} of their "
                     f"outer steps; outer steps before the first averaged one (late join): {each}")


def remove_leaked_shm(kills: list[Kill]) -> int:
    """Count, then remove, the shared-memory segments that killed daemons left in /dev/shm (node/bridge/shm.py
    names them stl<daemon pid>_...): what a SIGKILL of the whole node leaves behind."""
    pids = {k.pids[0] for k in kills}
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return 0
    leaked = [p for p in shm.iterdir() if (m := re.match(r"stl(\d+)_", p.name)) and int(m.group(1)) in pids]
    for p in leaked:
        p.unlink(missing_ok=True)
    return len(leaked)


# --- reporting --------------------------------------------------------------------------------------------


def summary(out: Outcome) -> str:
    lines = [f"{'check':<50} {'result':<6} figures"]
    lines += [f"{c.name:<50} {'PASS' if c.passed else 'FAIL':<6} {c.figures}" for c in out.checks]
    lines.append("")
    lines.append(f"time per phase: {fmt_phases(out.phases)}")
    lines.append(f"CPU at the end of the chaos: {fmt_cpu(out.cpu)}")
    lines.append("")
    lines.append(f"{'kill at':>8} {'node':>5} {'ckpt on disk':>12} {'resumed at':>10} {'daemon up':>9} "
                 f"{'training':>8} {'seen down':>9} {'alive for all':>13}")
    for k in out.kills:
        lines.append(f"{k.at_s:7.1f}s {k.node:>5} {fmt(k.disk_step):>12} {fmt(k.resumed_step):>10} "
                     f"{fmt_s(k.back_s):>9} {fmt_s(k.training_s):>8} {'yes' if k.seen_down else 'no':>9} "
                     f"{fmt_s(k.seen_alive_s):>13}")
    return "\n".join(lines)


def fmt(x: int | None) -> str:
    return "-" if x is None else str(x)


def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} s"


def write_rejoin_docs(out: Outcome, command: str) -> None:
    """Replace the `## Rejoin run (wiped HOMEs)` section of docs/reliability.md with a --wipe run's figures."""
    plan = out.plan
    body = [
        REJOIN_SECTION, "",
        f"`{command}` on {os.cpu_count()} cores ({platform.machine()}), {time.strftime('%Y-%m-%d')}: "
        f"{plan.nodes} trainers and a network-only bootstrap node on 127.0.0.1, the tiny model of the chaos run. "
        f"For {plan.seconds:g} s, every {plan.interval:g} s a random trainer was killed with SIGKILL and restarted "
        f"at once with its HOME wiped (a new identity, no checkpoint: a replaced machine): {len(out.kills)} "
        "kills. Each must late-join from the swarm's current weights (issue #55: donors serve them from their "
        "worker's shared memory, no checkpoint needed) and average within "
        f"{REJOIN_WITHIN} of its own outer steps (`training.exchanges`: solo and failed steps before the first "
        f"group one). Sync settings: the chaos run's ({', '.join(f'{k} {v:g}' for k, v in SYNC.items())})"
        + (f", then `--set` {', '.join(plan.extra)}" if plan.extra else "")
        + f". Time per phase: {fmt_phases(out.phases)}. CPU at the end: {fmt_cpu(out.cpu)}.",
        "",
        "| check | result | figures |", "|---|---|---|",
    ]
    body += [f"| {c.name} | {'pass' if c.passed else '**FAIL**'} | {c.figures} |" for c in out.checks]
    body += ["", "| kill at | node | training after | late join | own outer steps before the first averaged one |",
             "|---|---|---|---|---|"]
    body += [f"| {k.at_s:.0f} s | {k.node} | {fmt_s(k.training_s)} | {k.join or '-'} | "
             f"{fmt(k.steps_before_averaging)} |" for k in out.kills]
    replace_section(DOCS, REJOIN_SECTION, "\n".join(body) + "\n")
    print(f"\nwrote the {REJOIN_SECTION} section of {DOCS.relative_to(ROOT)}", flush=True)


def write_docs(out: Outcome, command: str) -> None:
    """Replace the `## Chaos run` section of docs/reliability.md with this run's figures."""
    plan = out.plan
    if plan.wipe:
        write_rejoin_docs(out, command)
        return
    ck = out.checkpoints
    down = [k.training_s for k in out.kills if k.training_s is not None]
    seen = [k.seen_alive_s for k in out.kills if k.seen_alive_s is not None]
    body = [
        SECTION, "",
        f"`{command}` on {os.cpu_count()} cores ({platform.machine()}), {time.strftime('%Y-%m-%d')}: "
        f"{plan.nodes} trainers and a network-only bootstrap node as local processes on 127.0.0.1, a tiny model "
        f"(`bench/chaos.py` TRAIN), a checkpoint every {TRAIN['checkpoint_every']} outer steps. For "
        f"{plan.seconds:g} s, every {plan.interval:g} s a random trainer was killed with SIGKILL "
        + ("(the daemon and every process under it: worker and resource tracker)" if plan.target == "node"
           else "(the daemon only; its worker notices, checkpoints and exits)")
        + f" and restarted at once on the same HOME: {len(out.kills)} kills"
        + (f", {out.skipped_kills} skipped because no trainer was up" if out.skipped_kills else "")
        + f". Pairing window {SYNC['pair_window_s']:g} s; heartbeats, suspect and gone times "
        + (f"changed with `--set` ({', '.join(plan.extra)})" if plan.extra else "at the daemon's defaults (2 s, 15 s, 60 s)")
        + f". Time per phase: {fmt_phases(out.phases)}. CPU at the end of the chaos: {fmt_cpu(out.cpu)}.",
        "",
        "How each check is measured: (a) every daemon logs each outer step's whole exchange (pairing, "
        "handshake, transfer) at debug level, and the longest must stay within the bound the averager's own "
        "deadlines give (pairing window + 2 x handshake timeout + transfer deadline + 1.5 s), with no "
        "exchange cut by the supervisor's `train.exchange_timeout`; (b) the restarted worker's "
        "`training.resumed_step` against the newest checkpoint file on disk right after the kill; (c) "
        "`node.worker.checkpoint.read_checkpoint` (header, length, SHA-256, weights-only load) on every file after a "
        "SIGTERM of every daemon; (d) the mean over trainers of `training.loss`, polled every second; (e) the "
        "set of `alive` members in every node's status; (f) after (e), a trainer with a fresh identity (a new "
        "HOME) starts with the same bootstrap file and must connect, be listed `alive` by every other node "
        f"and average once (its `sync.rounds`) within {plan.newcomer_within_s:g} s; its exchanges and "
        "checkpoints count in (a) and (c).",
        "",
        "| check | result | figures |", "|---|---|---|",
    ]
    body += [f"| {c.name} | {'pass' if c.passed else '**FAIL**'} | {c.figures} |" for c in out.checks]
    body += [
        "",
        f"Recovery per kill: the restarted worker was training again after {fmt_range(down)}, and every other "
        f"node listed it alive again after {fmt_range(seen)} (median, max); "
        f"{sum(k.seen_down for k in out.kills)} of the {len(out.kills)} restarted nodes were listed suspect or "
        f"gone by another node meanwhile. "
        f"Shared-memory segments left in /dev/shm by killed daemons (4 per kill when the whole node dies; "
        f"removed by the script afterwards): {ck['shm_leaked']}.",
        "",
        "| kill at | node | newest checkpoint on disk | resumed at step | daemon up after | training after "
        "| listed down by others | alive for all after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    body += [f"| {k.at_s:.0f} s | {k.node} | {fmt(k.disk_step)} | {fmt(k.resumed_step)} | {fmt_s(k.back_s)} | "
             f"{fmt_s(k.training_s)} | {'yes' if k.seen_down else 'no'} | {fmt_s(k.seen_alive_s)} |"
             for k in out.kills]
    if not DOCS.exists():
        DOCS.parent.mkdir(parents=True, exist_ok=True)
        DOCS.write_text("# Reliability\n")
    replace_section(DOCS, SECTION, "\n".join(body) + "\n")
    print(f"\nwrote the {SECTION} section of {DOCS.relative_to(ROOT)}", flush=True)


def fmt_cpu(cpu: dict[str, float]) -> str:
    return (f"each trainer daemon {cpu['daemon']:.0%} of a core, each worker {cpu['worker']:.0%}, the bootstrap "
            f"daemon {cpu['boot']:.0%} (means over their lives); load average {cpu['load1']:.1f} on "
            f"{cpu['cores']:.0f} cores")


def fmt_phases(phases: dict[str, float]) -> str:
    return ", ".join(f"{name} {seconds:.0f} s" for name, seconds in phases.items()) + \
        f" (total {sum(phases.values()):.0f} s)"


def fmt_range(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} s / {max(xs):.1f} s" if xs else "-"


# --- command line -----------------------------------------------------------------------------------------


def command_line(argv: list[str]) -> str:
    """The command as the docs show it: --root (where the HOMEs went) does not change the run."""
    shown, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--root":
            skip = True
        elif not arg.startswith("--root="):
            shown.append(arg)
    return " ".join(["python bench/chaos.py", *shown])


def parse_args(argv: list[str] | None) -> tuple[ChaosPlan, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 trainers, a kill every 10 s for 40 s")
    p.add_argument("--nodes", "--daemons", dest="nodes", type=int, help="trainers (default 6)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--seconds", type=float, help="length of the chaos in seconds (default 180)")
    length.add_argument("--minutes", type=float, help="length of the chaos in minutes (e.g. 30)")
    p.add_argument("--interval", type=float, help="seconds between two kills (default 20)")
    p.add_argument("--target", choices=["node", "daemon"], default="node",
                   help="kill the whole node (daemon + worker, default) or only the daemon")
    p.add_argument("--seed", type=int, default=0, help="seed for the choice of victims")
    p.add_argument("--wipe", action="store_true",
                   help="restart every killed trainer with its HOME wiped (a new identity that must late-join)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.OPTION=VALUE",
                   help="one more setting for every daemon, e.g. --set node.heartbeat_s=0.5 (repeatable)")
    p.add_argument("--root", type=Path, help="keep the nodes' HOMEs here (default: a temp dir, removed on success)")
    p.add_argument("--write-docs", action="store_true", help=f"record the figures in {DOCS.relative_to(ROOT)}")
    args = p.parse_args(argv)
    plan = QUICK if args.quick else ChaosPlan()
    seconds = args.minutes * 60 if args.minutes is not None else args.seconds
    changes = {k: v for k, v in (("nodes", args.nodes), ("seconds", seconds), ("interval", args.interval))
               if v is not None}
    plan = dataclasses.replace(plan, target=args.target, seed=args.seed, extra=tuple(args.set), wipe=args.wipe,
                               **changes)
    if any("=" not in setting or "." not in setting.split("=", 1)[0] for setting in args.set):
        p.error("--set: expected SECTION.OPTION=VALUE")
    if plan.nodes < 2:
        p.error("--nodes: at least 2 trainers")
    if plan.seconds <= 0 or plan.interval <= 0:
        p.error("--seconds and --interval must be positive")
    return plan, args


def main(argv: list[str] | None = None) -> int:
    plan, args = parse_args(argv)
    root = args.root or Path(tempfile.mkdtemp(prefix="starling-chaos-"))
    if args.root is not None:
        if root.exists() and any(root.iterdir()):
            print(f"chaos: {root} is not empty; give an empty or new directory", file=sys.stderr)
            return 2
        root.mkdir(parents=True, exist_ok=True)
    try:
        out = ChaosRun(plan, root).run()
    except ChaosError as e:
        print(f"chaos: {e}\nlogs kept in {root}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\ninterrupted; logs kept in {root}", file=sys.stderr)
        return 130
    print()
    print(summary(out))
    if args.write_docs:
        write_docs(out, command_line(argv if argv is not None else sys.argv[1:]))
    if out.passed:
        print("\nall checks passed")
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
        return 0
    print(f"\nsome checks FAILED; the nodes' HOMEs and logs are kept in {root}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
