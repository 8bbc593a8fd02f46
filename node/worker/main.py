"""The worker process's modes: the daemon's worker (`--fd N`, rank 0 of a group with `--group DIR`), a group
rank 1.. (`--follow DIR --rank R`), or the daemon's start-up task check (`--check`).

`python -m node.worker` (node/worker/__main__.py) runs :func:`process_main`. Why a module apart from the
trainer: it is the one place that knows both the single worker (node/worker/loop.py) and the worker group
(node/worker/group.py, whose trainer subclasses the single one), so neither of those imports the other's
caller and there is no import cycle, lazy or not.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from node.bridge.group_procs import Rendezvous
from node.bridge.ipc import MAX_FRAME, Crashed, DaemonGone, Init, WorkerChannel
from node.config.train import TrainConfig
from node.ops.logs import setup_logging
from node.worker.group import check_group, exit_group_process, follow_main, lead_group
from node.worker.loop import StopFlag, run_worker
from node.worker.task import (
    TaskError,
    layout_hash,
    load_task,
    model_hash,
    param_layout,
    resolve_device,
    task_context,
)

log = logging.getLogger("starling.worker")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m node.worker", description="The local torch worker of a Starling node.", allow_abbrev=False
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--fd", type=int, help="this end of the daemon's control socketpair")
    mode.add_argument("--check", action="store_true",
                      help="only load the device and task of the JSON request on stdin; exit 0, or 2 and why")
    mode.add_argument("--follow", metavar="DIR", help="be rank --rank of the worker group meeting in DIR")
    parser.add_argument("--group", metavar="DIR", help="with --fd: be rank 0 of the worker group meeting in DIR")
    parser.add_argument("--rank", type=int, default=0, help="with --follow: this process's rank (>= 1)")
    parser.add_argument("--world-size", type=int, default=1, help="processes in the worker group")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args(argv))


def run_main(args: argparse.Namespace) -> int:
    """The worker process for parsed arguments: the daemon's worker (--fd, optionally rank 0 of a group
    with --group), a group follower (--follow), or the task check (--check). Returns the exit code."""
    if args.check:
        return check_main()
    build = None
    if args.follow or args.group:
        group = Rendezvous(Path(args.follow or args.group), args.world_size)
        if args.follow:
            return follow_main(group, args.rank)
        build = functools.partial(lead_group, group)
    stop = StopFlag()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    chan = WorkerChannel(socket.socket(fileno=args.fd))
    try:
        init = chan.receive(timeout=60.0)
        if not isinstance(init, Init):
            print("worker: no init message from the daemon", file=sys.stderr)
            return 2
        setup_logging(init.log_level)
        return run_worker(chan, init, stop, build)
    except DaemonGone:
        return 0
    except Exception as e:
        # The traceback goes to the log for whoever debugs the task; the daemon gets one line, which
        # `starling status` shows as the reason for the restart (or for giving up after too many).
        log.exception("the worker failed")
        text = " ".join(f"{type(e).__name__}: {e}".split())[:MAX_ERROR_CHARS]
        try:
            chan.send(Crashed(error=text))
        except DaemonGone:
            pass
        return 1
    finally:
        chan.close()


MAX_ERROR_CHARS = 300  # of an error sent to the daemon: one status line, not a dump


def answer_task_check(request: dict[str, Any]) -> str:
    """The worker's answer to the daemon's start-up check (node/bridge/supervisor.py `check_task`, which
    runs `python -m node.worker --check` and reads this): resolve the device and build the task of a
    `{"config": {...}, "peer_id": ...}` request, the way `Trainer` does; return the task's name. Raises TaskError (one line) for anything the operator must fix.

    With `"describe": true` the model is built too, and the answer is a JSON object of the task's name and
    its model (`model_hash`, `layout_hash`, `numel`, as the worker's hello says them): a daemon that will
    download a late join's snapshot needs its own model's size first, since a donor's claim must not
    decide what it writes to disk (protocols/snapshot.py, `ModelShape`).

    Why a separate process runs this and not the daemon: the task factory may put data on the GPU, and a
    CUDA context in the daemon would hold GPU memory for its whole life.
    """
    try:
        cfg = TrainConfig(**request["config"])
        cfg.validate()
        peer_id = str(request["peer_id"])
        options = dict(request.get("task_options") or {})
    except (KeyError, TypeError, ValueError) as e:
        raise TaskError(f"bad train config: {e}") from None
    device = resolve_device(cfg.device)
    if cfg.local_ranks > 1:
        check_group(cfg, device)
    task = load_task(cfg.task, task_context(cfg, peer_id, device, options))
    if not request.get("describe"):
        return task.name
    try:
        model = task.build_model()
    except Exception as e:  # the task's own code: its error is the operator's to fix
        raise TaskError(f"train.task: building the model failed: {type(e).__name__}: {e}") from e
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    return json.dumps({"name": task.name, "model_hash": model_hash(task, options),
                       "layout_hash": layout_hash(param_layout(model)), "numel": sum(p.numel() for p in params)})


def check_main() -> int:
    """`python -m node.worker --check`: read the request (JSON) on stdin; print the task's name (with
    `"describe": true`, the JSON object `answer_task_check` says) and exit 0,
    or print the reason on one line on stderr and exit 2 (with its traceback too at log level debug)."""
    try:
        request = json.loads(sys.stdin.read(MAX_FRAME))
        if not isinstance(request, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        print(f"worker --check: unreadable request: {e}", file=sys.stderr)
        return 2
    level = str(request.get("log_level") or "warning")
    setup_logging(level)
    try:
        name = answer_task_check(request)
    except TaskError as e:
        if level == "debug" and e.__cause__ is not None:
            log.debug("the task failed with", exc_info=e.__cause__)
        print(e, file=sys.stderr)
        return 2
    print(name)
    return 0


def process_main() -> None:
    """`python -m node.worker`: run the mode the arguments name and exit with its code; a group's rank
    leaves through `exit_group_process` (node/worker/group.py says why)."""
    args = parse_args()
    code = run_main(args)
    if args.follow or args.group:
        exit_group_process(code)
    sys.exit(code)
