"""hivemind's side of bench/wan.py: a DHT bootstrap node, or one trainer of `hivemind.Optimizer` in local-update mode.

Runs inside `bench/.venv-hivemind` (hivemind 1.1.12 and torch's CPU wheel, created by bench/sync.py), one process
per lab namespace, started by bench/wan.py. It imports torch-only code of the repository (node.worker.task,
node.config.train, node.tasks.stdlib_lm: the bench model, its data shards and its validation batches), never
trio or libp2p.

Two roles, one JSON spec each (argv[2]):

- `dht`: a hivemind DHT node on the lab's bootstrap host (what Starling's `--no-train` bootstrap daemon is to
  its trainers); prints `MADDR <multiaddr>` and serves until SIGTERM.
- `peer`: a trainer. A DHT joined through the bootstrap node, the bench model on this trainer's shard (its
  PeerID is Starling's trainer's, so the shard is the same), and `hivemind.Optimizer(use_local_updates=True)`
  around the trainers' inner optimizer (AdamW, decay on weight matrices only, as node.worker.trainer.default_optimizer)
  with the inner learning rate set before every local step from the schedule bench/wan.py passes
  (node.worker.trainer.lr_at at each step). `target_batch_size` = peers x H x batch size: the collaboration starts a new
  epoch, and averages parameters (all-reduce in one group, no compression), about every H local steps of each
  peer. Once everything is built (hivemind forks its DHT and averager processes then), it prints `READY <pid>`
  and waits for the go file, so that bench/wan.py can cap this process alone (the worker's analogue: the
  networking processes stay uncapped, as Starling's daemon does) and start every peer together. It trains
  until the go file's deadline, evaluating the validation loss (the task's own evaluation: the same held-out
  batches as the simulation and Starling's workers) each time an averaging result (or a state download from
  peers) is applied, and appends one JSON line per evaluation to `out`; then one summary line, then `DONE`.

What hivemind does here (1.1.12, read from its source and seen in the logs): in local-update mode it averages with
its delta rule in a background thread, but `TrainingStateAverager.step` waits for every pending update, the running
averaging round included, before each local optimizer step; so a peer computes nothing from an epoch's end until
that round's matchmaking (`matchmaking_time`) and all-reduce are over, and a peer that fell an epoch behind
downloads the whole state from a peer before it trains on.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from node.config.train import TrainConfig  # noqa: E402
from node.worker.task import TaskContext, autocast, load_task  # noqa: E402  (torch only: no trio, no libp2p)


def inner_optimizer(model: torch.nn.Module, cfg: TrainConfig, lr: float) -> torch.optim.AdamW:
    """node.worker.trainer.default_optimizer (which this venv cannot import: node.worker.trainer pulls in the daemon's wire
    codecs) at learning rate `lr`: AdamW, `cfg.weight_decay` on parameters of 2 or more dimensions, none on the
    others, the decayed group first. tests/test_bench_hivemind_wan.py checks that the two agree."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    plain = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr)


class Rounds(logging.Handler):
    """The group size of each of hivemind's state-averaging rounds, read from its own log lines (INFO with
    `verbose=True`): "Averaged parameters with N peers" or "Averaging failed with ..."."""

    AVERAGED = re.compile(r"Averaged parameters with (\d+) peers")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.sizes: list[int] = []  # 0: failed
        self.seen = 0  # sizes already matched to an applied result
        self.guard = threading.Lock()  # not `lock`: logging.Handler holds its own `lock` around emit()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if (m := self.AVERAGED.search(text)) is not None:
            with self.guard:
                self.sizes.append(int(m.group(1)))
        elif text.startswith("Averaging failed"):
            with self.guard:
                self.sizes.append(0)


def _maddr(ip: str, port: int, peer_id: Any) -> str:
    return f"/ip4/{ip}/tcp/{port}/p2p/{peer_id}"


def _listen(spec: dict[str, Any]) -> dict[str, Any]:
    return {"host_maddrs": [f"/ip4/0.0.0.0/tcp/{spec['port']}"],
            "announce_maddrs": [f"/ip4/{spec['ip']}/tcp/{spec['port']}"]}


def run_dht(spec: dict[str, Any]) -> int:
    from hivemind import DHT

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    dht = DHT(start=True, **_listen(spec))
    print(f"MADDR {_maddr(spec['ip'], spec['port'], dht.peer_id)}", flush=True)
    try:
        stop.wait()
    finally:
        dht.shutdown()
    return 0


def _wait_go(path: Path, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no go file {path} within {timeout:.0f} s")
        time.sleep(0.05)
    return json.loads(path.read_text())


def run_peer(spec: dict[str, Any]) -> int:
    import hivemind

    torch.set_num_threads(1)
    cfg = TrainConfig(**spec["train"])
    task = load_task(cfg.task, TaskContext(cfg, spec["peer_id"], torch.device("cpu")))
    model = task.build_model()
    params = [p for p in model.parameters() if p.requires_grad]
    stream = task.train_stream()
    lrs: list[float] = spec["lrs"]  # node.worker.trainer.lr_at(cfg, step) for step 0..total_steps (flat after)

    rounds = Rounds()
    logging.getLogger("hivemind.optim.state_averager").addHandler(rounds)
    dht = hivemind.DHT(start=True, initial_peers=[spec["initial_peer"]], **_listen(spec))
    # lr 0 while hivemind initialises the Adam state with one zero-gradient step (its design): AdamW's decoupled
    # decay would otherwise shrink the weights once before training; the schedule sets lr before every step.
    inner = inner_optimizer(model, cfg, 0.0)
    opt = hivemind.Optimizer(
        dht=dht, run_id=spec["run_id"], optimizer=inner, use_local_updates=True,
        target_batch_size=spec["target_batch_size"], batch_size_per_step=cfg.batch_size,
        matchmaking_time=spec["matchmaking_time"], averaging_timeout=spec["averaging_timeout"],
        next_chunk_timeout=spec["next_chunk_timeout"], averager_opts={"request_timeout": spec["request_timeout"]},
        verbose=True,
    )
    applied = {"averaged": 0, "loaded": 0}
    groups: list[int] = []  # per applied averaging result: its group size (0: the round failed)
    state = opt.state_averager
    apply_results = state._apply_averaging_results_

    def counted_apply() -> None:
        apply_results()
        with rounds.guard:  # the round's log line comes before its result is handed over
            new, rounds.seen = rounds.sizes[rounds.seen:], len(rounds.sizes)
        groups.append(new[-1] if new else 0)  # no line: the round was aborted
        applied["averaged"] += 1

    state._apply_averaging_results_ = counted_apply  # the instance's own: hivemind calls self._apply_...()
    load_state = opt.load_state_from_peers

    def counted_load(**kwargs: Any) -> None:
        load_state(**kwargs)
        applied["loaded"] += 1

    opt.load_state_from_peers = counted_load

    out = Path(spec["out"])
    initial = task.evaluate(model)
    print(f"READY {os.getpid()}", flush=True)
    go = _wait_go(Path(spec["go_file"]), spec["go_timeout_s"])
    cgroup = [ln for ln in Path("/proc/self/cgroup").read_text().splitlines() if "cpu" in ln]
    t0, deadline = float(go["t0"]), float(go["t0"]) + float(go["seconds"])
    while time.time() < t0:
        time.sleep(0.01)
    cpu0 = time.process_time()
    steps = 0
    seen = dict(applied)
    with out.open("a") as f:
        while time.time() < deadline:
            lr = lrs[min(steps, len(lrs) - 1)]
            for pg in inner.param_groups:
                pg["lr"] = lr
            opt.zero_grad(set_to_none=True)
            with autocast(torch.device("cpu"), cfg.precision):
                loss = task.loss(model, stream.next_batch())
            loss.backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            steps += 1
            if applied != seen:
                loaded = applied["loaded"] != seen["loaded"]
                group = None if loaded else groups[-1]
                kind = "loaded" if loaded else "averaged" if group and group > 1 else "failed"
                seen = dict(applied)
                val = task.evaluate(model)
                f.write(json.dumps({"t": time.time(), "val": val, "steps": steps, "epoch": opt.local_epoch,
                                    "kind": kind, "group": group}) + "\n")
                f.flush()
        wall = time.time() - t0
        cpu = (time.process_time() - cpu0) / wall if wall > 0 else 0.0
        f.write(json.dumps({"summary": True, "steps": steps, "seconds": wall, "cpu": cpu, "initial": initial,
                            "epoch": opt.local_epoch, "groups": groups, "loaded": applied["loaded"],
                            "cgroup": cgroup}) + "\n")
    print("DONE", flush=True)
    try:
        opt.shutdown()
    finally:
        dht.shutdown()
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("dht", "peer"):
        print("usage: hivemind_wan.py dht|peer SPEC_JSON", file=sys.stderr)
        return 2
    spec = json.loads(argv[1])
    return run_dht(spec) if argv[0] == "dht" else run_peer(spec)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
