"""node.worker: the torch worker process, the only room of node/ that imports torch.

    __main__.py   `python -m node.worker`: the process the supervisor starts
    main.py       process_main, answer_task_check: the worker's modes (the daemon's worker, a group rank, the task check)
    trainer.py    Trainer: the training core, inner and outer steps, slow weights, counters, checkpoints
    loop.py       run_worker, train_loop: the process loop, the worker's side of the conversation with the daemon
    group.py      WorkerGroup, GroupTrainer: a multi-GPU host as one node (torch.distributed)
    outer.py      OuterOptimizer: NoLoCo and DiLoCo on flat fp32 slow weights
    task.py       Task, TaskContext, load_task: what a training task provides (node/tasks/: the built-in ones)
    checkpoint.py CheckpointStore: atomic, hashed checkpoints
    export.py     export_weights: `starling export`

Imports the bridge (node/bridge/: messages, shared memory, the checkpoint file), the config and
node.ops.logs; nothing on the daemon's side imports this package (pyproject.toml's import contracts).
The names below are importable from the package (``from node.worker import Trainer``, the 0.2 module's
path for a task's `default_optimizer`), each on first use.
"""

from __future__ import annotations

from p2p.lazy import lazy_exports

_EXPORTS = {
    "Trainer": "node.worker.trainer",
    "default_optimizer": "node.worker.trainer",
    "lr_at": "node.worker.trainer",
}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
