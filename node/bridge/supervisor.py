"""The daemon's side of the local torch worker: spawn it, talk to it, restart it, stop it cleanly.

The worker (node/worker/loop.py) is a separate OS process so that trio never competes with torch for the GIL.
The supervisor talks to it with length-prefixed msgpack over a socketpair read by trio, and shares the
slow weights and outer gradients through four named shared-memory segments it owns (node/bridge/shm.py).

For every `publish` from the worker it calls the daemon's `exchange` function (at most one in flight),
bounded by `train.exchange_timeout`; whatever happens - a result, an exception, the deadline - the worker
gets an answer, a solo step when nothing better came.

Streaming fragments (`sync.fragments` = F > 1, issue #23): each publish names a fragment, and the exchange
gets that fragment's slices of the slots (protocols/compress.py `stream_fragment_range`, the worker's cut),
while the worker trains on and other fragments' results change the rest. At most one publish per fragment
is in flight (a second one is a protocol error, as a second whole-vector publish is), and the exchanges run
one at a time, in the order of the publishes: a fragment published while another's exchange runs waits
for it. Why not several at once: the fragments share one link, so parallel transfers would not end the
period's syncs sooner (each would crawl at 1/k of the rate), while one at a time brings each result as
early as the link allows, and the averager's round (its pairing, claims and responder state,
node/averaging/averager.py) stays the single round it was. `train.exchange_timeout` bounds each exchange
from its start, not its wait behind the others (at most F - 1 of them). A catch-up snapshot answers a publish only
when no other fragment is in flight, since adopting it replaces every fragment's slice at once. The daemon therefore never has to worry about the
worker waiting forever, and the worker never waits on the network beyond the configured bound.

Catch-up: when the daemon has downloaded the swarm's weights for a node that drifted too far to pair
(`adopt_at_next_outer_step`), the worker's next publish is answered with that snapshot instead of an
exchange, and the worker's `adopted` report goes to `on_adopted`. The offer survives a worker restart.

Lifecycle: `run()` restarts a worker that dies with exponential backoff (1 s doubling to 60 s, reset
after a minute of healthy running); the new worker resumes from its latest checkpoint. A worker that
reports a fatal start-up error (a bad task or config) is not restarted, nor is one that died `max_restarts`
times in a row without a healthy minute between (a task whose loss() raises would otherwise restart
forever): the state becomes "failed" for good and status says why. `error` in the status is the last
worker error (the exception text a crashing worker sent, or how it ended); it stays after a recovery, so
that a flapping worker can be diagnosed while it trains. On cancellation `run()` asks the worker to
checkpoint and stop, waits up to `stop_grace` seconds (shielded), then kills it - no stray process is left
behind. A worker group (`train.local_ranks > 1`, node/worker/group.py) is one worker here: its ranks
start together, rank 0 alone speaks the protocol, and when any rank dies the others are stopped and the
whole group restarts.

`check_task()` is the daemon's start-up check: it loads the device and the task in a throwaway worker
process (`python -m node.worker --check`) before the daemon reports ready, so that a task that cannot be
imported or built, or a missing GPU, stops the start with one line instead of a failed worker later.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from node.bridge.exchange import ExchangeFn, ExchangeOutcome, ExchangeRequest
from node.bridge.group_procs import FollowerProcs
from node.bridge.ipc import (
    Adopted,
    Attach,
    CheckpointFailed,
    CheckpointSaved,
    Crashed,
    Fatal,
    FrameBuffer,
    Hello,
    Init,
    Message,
    Metrics,
    Publish,
    Result,
    Stop,
    Stopped,
    encode_message,
)
from node.bridge.livephi import LivePhi, hold_for
from node.bridge.shm import ExchangeSlots, sweep_orphans
from node.config.train import TrainConfig
from node.status_schema import TrainingStatus
from p2p.framing import ProtocolError, Reason
from protocols.compress import stream_fragment_range

log = logging.getLogger("starling.supervisor")

# The start-up check imports torch and calls the task factory (which may read its data): generous, yet
# well inside systemd's TimeoutStartSec (deploy/systemd/starling.service).
TASK_CHECK_TIMEOUT_S = 60.0
# Worker deaths in a row, each within `healthy_after` of its start, before training is given up for good.
MAX_RESTARTS = 5


class TaskCheckError(Exception):
    """The configured task or device cannot be used; the message is one line for the operator."""


@dataclass(frozen=True)
class CheckedTask:
    """What the start-up check said: the task's name and, when asked to `describe` it, its model as the
    worker's hello will say it (else "" and 0)."""

    name: str
    model_hash: str = ""
    layout_hash: str = ""
    numel: int = 0


async def check_task(
    cfg: TrainConfig,
    peer_id: str,
    *,
    python: str = sys.executable,
    log_level: str = "warning",
    timeout: float = TASK_CHECK_TIMEOUT_S,
    task_options: Mapping[str, Any] | None = None,
    describe: bool = False,
) -> CheckedTask | None:
    """Load `cfg.device` and `cfg.task` (given the `[task]` section's `task_options`) in a throwaway worker
    process; return what it said, or None when the check ran out of `timeout` (a slow factory is not an
    error: the worker's own start-up timeout still applies). Raises TaskCheckError with the worker's
    one-line reason otherwise. `describe`: build the model too and say it (a late join checks its donors
    against it before it downloads a byte)."""
    request = json.dumps({"config": dataclasses.asdict(cfg), "peer_id": peer_id, "log_level": log_level,
                          "task_options": dict(task_options or {}), "describe": describe})
    result = None
    with trio.move_on_after(timeout):
        result = await trio.run_process(
            [python, "-P", "-m", "node.worker", "--check"],  # -P: as the worker itself is started
            stdin=request.encode(),
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    if result is None:
        log.warning("loading train.task %r took longer than %.0f s; starting the worker anyway", cfg.task, timeout)
        return None
    if result.returncode == 0:
        out = result.stdout.decode(errors="replace").strip()
        if not describe:
            return CheckedTask(out) if out else None
        try:
            said = json.loads(out.splitlines()[-1])  # the task may print lines of its own before
            return CheckedTask(str(said["name"]), str(said["model_hash"]), str(said["layout_hash"]),
                               int(said["numel"]))
        except (IndexError, ValueError, KeyError, TypeError):
            log.warning("the task check did not describe the model: %r", out[-200:])
            return None
    lines = [line for line in result.stderr.decode(errors="replace").splitlines() if line.strip()]
    for line in lines[:-1]:  # the task's own output, or a traceback at log level debug
        log.debug("task check: %s", line)
    reason = lines[-1].strip() if lines else ""
    if result.returncode == 2 and reason:
        raise TaskCheckError(reason)
    how = f"killed by signal {-result.returncode}" if result.returncode < 0 else f"exit code {result.returncode}"
    raise TaskCheckError(f"train.task: loading {cfg.task!r} failed ({how}){': ' + reason if reason else ''}")


@dataclass
class _Adoption:
    """A swarm snapshot on disk for the worker to take at its next outer step (a catch-up)."""

    path: Path
    outer_step: Callable[[], int | None]  # the swarm's outer step to continue from, asked when it is sent
    sent_to: set[int] = field(default_factory=set)  # pids of the workers it was sent to


class _Channel:
    """The supervisor's end of the control socket: framed msgpack with a send lock."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self._frames = FrameBuffer()
        self._send_lock = trio.Lock()

    async def send(self, msg: Message) -> None:
        async with self._send_lock:
            await self._stream.send_all(encode_message(msg))

    async def receive(self) -> Message | None:
        """The next message, or None at end of file (the worker exited)."""
        while True:
            msg = self._frames.next_message()
            if msg is not None:
                return msg
            try:
                data = await self._stream.receive_some(1 << 16)
            except trio.BrokenResourceError:
                data = b""
            if not data:
                return None
            self._frames.feed(data)

    async def aclose(self) -> None:
        await self._stream.aclose()


@dataclass
class _Exit:
    """How one worker lifetime ended."""

    fatal: str | None = None  # a start-up error a restart cannot fix
    reason: str = ""


def _ignore(_msg: Any) -> None:
    return None


@dataclass(frozen=True)
class SupervisorHooks:
    """What the daemon hears from its worker and what it tells it, as calls (defaults: a node alone).

    `on_metrics`: every progress report as it comes (the daemon's loss history records its own trainer from
    it); `on_adopted`: a catch-up's outcome; `pace`: the seconds between two publishes that the swarm sets
    (0: every H inner steps), asked at each result."""

    on_metrics: Callable[[Metrics], None] = _ignore
    on_adopted: Callable[[Adopted], None] = _ignore
    pace: Callable[[], float] = lambda: 0.0


@dataclass(frozen=True)
class Lifetimes:
    """How long the supervisor waits on a worker, and how often it restarts one."""

    stop_grace: float = 8.0  # a stopping worker's time to checkpoint before it is killed
    startup_timeout: float = 600.0  # import torch + read the data + load a checkpoint
    silence_timeout: float = 300.0  # a worker that sends nothing this long is hung
    backoff_initial: float = 1.0  # seconds before the first restart, doubled after each crash...
    backoff_max: float = 60.0  # ... up to this
    healthy_after: float = 60.0  # a worker that lived this long resets the back-off
    max_restarts: int = MAX_RESTARTS  # crashes in a row before the supervisor gives up


class WorkerSupervisor:
    """Runs and watches the local torch worker for the daemon (see the module docstring)."""

    def __init__(
        self,
        cfg: TrainConfig,
        home: Path,
        peer_id: str,
        exchange: ExchangeFn,
        *,
        task_options: Mapping[str, Any] | None = None,
        hooks: SupervisorHooks | None = None,
        lifetimes: Lifetimes | None = None,
        python: str = sys.executable,
        fragments: int = 1,
        live: LivePhi | None = None,
    ) -> None:
        self.cfg = cfg
        # The phi slot as joiners' snapshot source: told of every worker life, report and result.
        self.live = live or LivePhi(hold_s=hold_for(cfg.overlap))
        self.fragments = fragments  # sync.fragments: streaming fragments (1: the whole vector at once)
        self.task_options = dict(task_options or {})  # the [task] section, handed to the worker's task
        self.home = home
        self.peer_id = peer_id
        self._exchange = exchange
        self._python = python
        self._hooks = hooks or SupervisorHooks()
        self._lifetimes = lifetimes or Lifetimes()
        self._crash: str | None = None  # what the current worker said before it died (a Crashed message)
        self.final_checkpoint_error: str | None = None  # the worker's checkpoint on stop could not be written
        self._group_exit: str | None = None  # why a worker group's rank 1.. ended the current lifetime
        self._adoption: _Adoption | None = None
        self._slots: ExchangeSlots | None = None
        self._hello: Hello | None = None
        self._status: TrainingStatus = {
            "state": "idle",
            "task": cfg.task,
            "device": None,
            "step": 0,
            "outer_step": 0,
            "loss": None,
            "val_loss": None,
            "samples_per_s": 0.0,
            "lr": None,
            "restarts": 0,
            "pid": None,
            "group_pids": None,  # with train.local_ranks > 1: the worker group's pids, rank 0 first
            "resumed_step": None,
            "checkpoint_step": None,
            "checkpoint_rejected": [],
            "checkpoint_error": None,  # while checkpoints fail (a full disk): the latest failure
            "checkpoint_failures": 0,  # in a row, since the last checkpoint written
            "exchanges": {"group": 0, "solo": 0, "failed": 0},
            "last_group_size": None,
            "last_inner_steps": None,  # inner steps in the latest outer step (fewer on slower machines)
            "period_s": None,  # the swarm's pace: seconds between two outer steps (None: every H steps)
            "error": None,
        }

    # -- the public surface --

    def status(self) -> TrainingStatus:
        """The `training` section of `status --json` (plain JSON types, a copy)."""
        out = self._status.copy()
        out["exchanges"] = self._status["exchanges"].copy()
        out["checkpoint_rejected"] = list(self._status["checkpoint_rejected"])
        return out

    def manifest_fields(self) -> dict[str, Any] | None:
        """Task name, model hash and parameter-layout hash, once the worker has said them."""
        if self._hello is None:
            return None
        return {
            "task": self._hello.task,
            "model_hash": self._hello.model_hash,
            "layout_hash": self._hello.layout_hash,
            "numel": self._hello.numel,
            "outer": self.cfg.outer,
        }

    def adopt_at_next_outer_step(self, path: Path, outer_step: Callable[[], int | None]) -> None:
        """Have the worker continue from the swarm snapshot at `path` at its next outer step instead of
        exchanging; `outer_step()` is asked then for the swarm's outer step (None: the snapshot's)."""
        self._adoption = _Adoption(path, outer_step)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Keep a worker running until cancelled."""
        swept = sweep_orphans()
        if swept:
            log.info("removed %d shared-memory segments left by a killed daemon", swept)
        task_status.started()
        backoff = self._lifetimes.backoff_initial
        failures = 0  # worker deaths in a row, none after a healthy run
        try:
            while True:
                self._status["state"] = "starting"
                began = trio.current_time()
                ended = await self._run_one_worker()
                if ended.fatal is not None:
                    self._status.update({"state": "failed", "error": ended.fatal, "pid": None})
                    log.error("training stopped: %s", ended.fatal)
                    await trio.sleep_forever()
                if trio.current_time() - began >= self._lifetimes.healthy_after:
                    backoff = self._lifetimes.backoff_initial
                    failures = 0
                failures += 1
                if failures > self._lifetimes.max_restarts:
                    error = f"the worker failed {failures} times in a row; last: {ended.reason}"
                    self._status.update({"state": "failed", "error": error, "pid": None})
                    log.error("training stopped: %s", error)
                    await trio.sleep_forever()
                self._status["restarts"] += 1
                self._status.update({"state": "restarting", "pid": None, "error": ended.reason})
                log.warning("%s; restarting the worker in %.0f s", ended.reason, backoff)
                await trio.sleep(backoff)
                backoff = min(backoff * 2, self._lifetimes.backoff_max)
        finally:
            self._status.update({"state": "stopped", "pid": None})
            if self._slots is not None:
                self._slots.close()
                self._slots = None

    # -- one worker lifetime --

    async def _run_one_worker(self) -> _Exit:
        self._crash = None
        self._group_exit = None
        # train.local_ranks > 1: this process is rank 0 of a worker group whose other ranks start, stop and
        # restart with it (node/worker/group.py).
        followers = FollowerProcs(self.cfg.local_ranks, self._python) if self.cfg.local_ranks > 1 else None
        ours, theirs = socket.socketpair()
        try:
            proc = await trio.lowlevel.open_process(
                # -P: do not put the current directory first on sys.path, so a stray `node/` folder
                # where the daemon was started cannot shadow our package.
                [self._python, "-P", "-m", "node.worker", "--fd", str(theirs.fileno()),
                 *(followers.leader_args() if followers is not None else ())],
                pass_fds=(theirs.fileno(),),
                start_new_session=True,  # terminal signals go to the daemon, which stops us properly
            )
        except BaseException:
            ours.close()
            if followers is not None:
                await followers.stop(0)
            raise
        finally:
            theirs.close()
        self._status["pid"] = proc.pid
        chan = _Channel(trio.SocketStream(trio.socket.from_stdlib_socket(ours)))
        try:
            if followers is not None:
                await followers.start()
                self._status["group_pids"] = [proc.pid, *followers.pids()]
            async with trio.open_nursery() as nursery:
                if followers is not None:
                    nursery.start_soon(self._watch_group, followers, proc)
                ended = await self._serve(proc, chan, nursery)
                nursery.cancel_scope.cancel()  # an exchange still running belongs to the dead worker
            return ended
        finally:
            self.live.detached()
            with trio.CancelScope(shield=True):
                await self._stop_process(proc, chan)
                await chan.aclose()
                if followers is not None:
                    await followers.stop(self._lifetimes.stop_grace)  # rank 0 told them to stop; stragglers are killed
                    self._status["group_pids"] = None

    async def _watch_group(self, followers: FollowerProcs, proc: trio.Process) -> None:
        """A worker group whose rank 1.. exited cannot go on: end rank 0 too, so the group restarts as a
        unit. Rank 0 gets `stop_grace` first, to report a fatal start-up error that both ranks hit."""
        rank, code = await followers.first_exit()
        if proc.poll() is not None:
            return  # rank 0 ended first: its own reason stands, and the others were following it
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        self._group_exit = f"worker rank {rank} exited ({how}); the whole worker group is restarted"
        log.warning("%s", self._group_exit)
        with trio.move_on_after(self._lifetimes.stop_grace):
            while proc.poll() is None:
                await trio.sleep(0.1)
        proc.kill()

    async def _serve(self, proc: trio.Process, chan: _Channel, nursery: trio.Nursery) -> _Exit:
        cfg_dict = dataclasses.asdict(self.cfg)
        level = logging.getLevelName(logging.getLogger("starling").getEffectiveLevel()).lower()
        try:
            await chan.send(Init(config=cfg_dict, home=str(self.home), peer_id=self.peer_id, log_level=level,
                                 task_options=self.task_options))
            first: Message | None = None
            with trio.move_on_after(self._lifetimes.startup_timeout) as startup:
                first = await chan.receive()
            if startup.cancelled_caught:
                proc.kill()
                return _Exit(reason=f"no hello within {self._lifetimes.startup_timeout:.0f} s; killed")
            if isinstance(first, Fatal):
                return _Exit(fatal=first.error)
            if isinstance(first, Crashed):
                self._crash = first.error
                return await self._exited(proc, "failed before saying hello")
            if first is None:
                return await self._exited(proc, "ended before saying hello")
            if not isinstance(first, Hello):
                raise ProtocolError(Reason.BAD_KIND, f"expected hello, got {type(first).__name__}")
            await self._on_hello(chan, first)
            return await self._serve_messages(proc, chan, nursery)
        except ProtocolError as e:
            proc.kill()
            return _Exit(reason=f"protocol error: {e}")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return await self._exited(proc, "closed the control socket")

    async def _on_hello(self, chan: _Channel, hello: Hello) -> None:
        self._hello = hello
        if self._slots is None or self._slots.numel != hello.numel:
            if self._slots is not None:
                self._slots.close()
            self._slots = ExchangeSlots.create(hello.numel)
        self.live.attached(self._slots.phi.array, hello.layout_hash)
        self._status.update({
            "state": "training",
            "task": hello.task,
            "device": hello.device,
            "step": hello.step,
            "outer_step": hello.outer_step,
            "resumed_step": hello.step if hello.resumed_from else None,
            "checkpoint_rejected": list(hello.rejected),
        })
        for rejected in hello.rejected:
            log.warning("corrupt checkpoint set aside: %s", rejected)
        if hello.resumed_from:
            log.info("worker %d resumed from %s at step %d", hello.pid, hello.resumed_from, hello.step)
        await chan.send(Attach(names=self._slots.names(), fragments=self.fragments))

    async def _serve_messages(self, proc: trio.Process, chan: _Channel, nursery: trio.Nursery) -> _Exit:
        """Handle the worker's messages until it exits or falls silent (its metrics double as a
        heartbeat, so silence means a hung worker)."""
        in_flight: set[int] = set()  # the fragments whose publish awaits its result (0: the whole vector)
        turn = trio.Lock()  # one exchange at a time, in the order of the publishes (module docstring)

        async def exchange_then_answer(publish: Publish) -> None:
            try:
                async with turn:
                    result = await self._run_exchange(publish)
                await self.live.before_result()  # the worker changes phi on it: a download of phi ends first
                # Cleared before the answer goes out: the worker may publish again the moment it has it.
                in_flight.discard(publish.fragment)
                await chan.send(result)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the worker is gone; the message loop sees end of file and restarts it
            finally:
                in_flight.discard(publish.fragment)

        scope = trio.CancelScope()
        with scope:
            while True:
                scope.deadline = trio.current_time() + self._lifetimes.silence_timeout
                msg = await chan.receive()
                if msg is None:
                    return await self._exited(proc, "exited")
                if isinstance(msg, Publish):
                    if msg.fragments != self.fragments or not 0 <= msg.fragment < msg.fragments:
                        raise ProtocolError(Reason.BAD_FIELD, f"publish of fragment {msg.fragment} of {msg.fragments}; "
                                                              f"sync.fragments is {self.fragments}")
                    if msg.fragment in in_flight:
                        raise ProtocolError(Reason.BAD_KIND, "publish while an exchange is in flight")
                    self._status["outer_step"] = msg.outer_step  # partners are chosen by it
                    self._status["last_inner_steps"] = msg.inner_steps
                    adoption = self._adoption
                    if adoption is not None and proc.pid not in adoption.sent_to and not in_flight:
                        await self.live.before_result()
                        await chan.send(self._adoption_result(msg, adoption, proc.pid))
                        continue
                    in_flight.add(msg.fragment)
                    nursery.start_soon(exchange_then_answer, msg)
                elif isinstance(msg, Fatal):
                    return _Exit(fatal=msg.error)
                else:
                    self._note(msg)
        proc.kill()
        return _Exit(reason=f"silent for {self._lifetimes.silence_timeout:.0f} s (hung?); killed")

    def _note(self, msg: Message) -> None:
        """Fold a progress report into the status."""
        if isinstance(msg, Metrics):
            self._status.update({
                "step": msg.step,
                "outer_step": msg.outer_step,
                "val_loss": msg.val_loss,
                "samples_per_s": round(msg.samples_per_s, 2),
                "lr": msg.lr,
            })
            self.live.metrics(msg.results, msg.step, msg.outer_step)
            if msg.loss is not None:
                self._status["loss"] = msg.loss
            try:
                self._hooks.on_metrics(msg)
            except Exception:  # a bookkeeping bug must not end the worker's life
                log.exception("recording the worker's progress failed")
        elif isinstance(msg, Crashed):
            self._crash = msg.error  # it exits next; `_exited` puts this in the reason
        elif isinstance(msg, CheckpointSaved):
            self._status.update({"checkpoint_step": msg.step, "step": msg.step, "outer_step": msg.outer_step,
                                 "checkpoint_error": None, "checkpoint_failures": 0})
        elif isinstance(msg, CheckpointFailed):
            self._status["checkpoint_error"] = f"at step {msg.step}: {msg.error}"
            self._status["checkpoint_failures"] += 1
            if msg.final:
                self.final_checkpoint_error = f"the final checkpoint (step {msg.step}) failed: {msg.error}"
        elif isinstance(msg, Adopted):
            self._adoption = None
            if not msg.error:
                self._status.update({"step": msg.step, "outer_step": msg.outer_step, "val_loss": msg.val_loss})
            self._hooks.on_adopted(msg)
        elif isinstance(msg, Stopped):
            log.info("worker stopped at step %d (outer step %d)", msg.step, msg.outer_step)
        else:
            raise ProtocolError(Reason.BAD_KIND, f"unexpected {type(msg).__name__} from the worker")

    def _adoption_result(self, publish: Publish, adoption: _Adoption, pid: int) -> Result:
        """The answer to a publish when a catch-up is ready: no exchange, the snapshot instead. Sent once
        to each worker: a worker that dies before reporting gets it again from its successor."""
        adoption.sent_to.add(pid)
        return Result(outer_step=publish.outer_step, group_size=1, adopt=str(adoption.path),
                      adopt_outer_step=adoption.outer_step(), fragment=publish.fragment,
                      fragments=publish.fragments)

    async def _run_exchange(self, publish: Publish) -> Result:
        """Call the daemon's exchange within the deadline; any failure means a solo step."""
        assert self._slots is not None and self._hello is not None
        slots = self._slots
        phi, delta, phi_out, delta_out = slots.phi.array, slots.delta.array, slots.phi_out.array, slots.delta_out.array
        if publish.fragments > 1:  # the fragment's slices (views: the sums land in the slots)
            lo, hi = stream_fragment_range(self._hello.numel, publish.fragment, publish.fragments)
            phi, delta, phi_out, delta_out = phi[lo:hi], delta[lo:hi], phi_out[lo:hi], delta_out[lo:hi]
        request = ExchangeRequest(
            outer_step=publish.outer_step,
            phi=phi,
            delta=delta,
            phi_out=phi_out,
            delta_out=delta_out,
            layout=[(str(name), tuple(shape)) for name, shape in self._hello.layout],
            layout_hash=self._hello.layout_hash,
            inner_steps=publish.inner_steps,
            samples=publish.samples,
            fragment=publish.fragment,
            fragments=publish.fragments,
        )
        outcome = ExchangeOutcome(0)  # a failed exchange: a solo step
        counts = self._status["exchanges"]
        with trio.move_on_after(self.cfg.exchange_timeout) as deadline:
            try:
                outcome = await self._exchange(request)
            except Exception:
                log.exception("outer exchange %d failed; taking a solo step", publish.outer_step)
                counts["failed"] += 1
        if deadline.cancelled_caught:
            log.warning("outer exchange %d timed out after %.0f s; taking a solo step",
                        publish.outer_step, self.cfg.exchange_timeout)
            counts["failed"] += 1
            outcome = ExchangeOutcome(0)
        size = int(outcome.group_size)
        counts["group" if size >= 2 else "solo"] += 1
        self._status["last_group_size"] = max(size, 1)
        return Result(
            outer_step=publish.outer_step,
            group_size=size,
            group_outer_step=outcome.group_outer_step,
            partner_samples=outcome.partner_samples if size == 2 else 0,
            period_s=self._record_period(self._period()),
            shift_s=outcome.shift_s,
            compression=outcome.compression if size >= 2 else "none",
            phi_range=list(outcome.phi_range) if size >= 2 and outcome.phi_range is not None else None,
            exact_outer_step=outcome.exact_outer_step if size < 2 else None,
            own_exact=bool(outcome.own_exact) if size >= 2 else False,
            fragment=publish.fragment,
            fragments=publish.fragments,
        )

    def _record_period(self, period: float) -> float:
        self._status["period_s"] = round(period, 3) if period > 0 else None
        return period

    def _period(self) -> float:
        try:
            period = float(self._hooks.pace())
        except Exception:  # a pace that cannot be computed leaves the worker on H inner steps
            log.exception("the swarm's pace could not be computed")
            return 0.0
        return period if period > 0 and period == period and period != float("inf") else 0.0

    async def _exited(self, proc: trio.Process, what: str) -> _Exit:
        with trio.move_on_after(self._lifetimes.stop_grace):
            await proc.wait()
        code = proc.returncode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        said = f": {self._crash}" if self._crash else ""
        if self._group_exit:  # another rank died first; what rank 0 said is only the consequence
            return _Exit(reason=self._group_exit)
        return _Exit(reason=f"worker {what} ({how}){said}")

    async def _stop_process(self, proc: trio.Process, chan: _Channel) -> None:
        """Ask the worker to checkpoint and exit; kill it if it does not within the grace period."""
        if proc.returncode is None:
            self._status["state"] = "stopping"
            with trio.move_on_after(self._lifetimes.stop_grace):
                try:
                    await chan.send(Stop())
                    # Read its last reports (the final checkpoint) until it closes the socket.
                    while (msg := await chan.receive()) is not None:
                        if not isinstance(msg, (Publish, Fatal, Hello)):
                            self._note(msg)
                except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
                    pass
                except ProtocolError:
                    pass  # it is being stopped anyway; the deadline and kill below still apply
                await proc.wait()
        if proc.returncode is None:
            log.warning("worker %d did not stop within %.0f s; killing it", proc.pid, self._lifetimes.stop_grace)
            proc.kill()
        await proc.wait()
