"""node: the daemon and its worker, the top of p2p <- protocols <- node (pyproject.toml's import contracts).

Two processes, six rooms. The rooms follow the import graph, and the same contracts check their order:
cli > daemon > swarm | averaging > bridge > ops > config | status_schema, and worker beside them, on the
bridge; nothing on the daemon's side imports worker/, the only room that loads torch.

    daemon.py         Daemon, StartupError: owns the host and runs everything below; builds the status
    cli.py            main: the `starling` command (init, run, status, doctor, plot, export, swarm-key)
    status_schema.py  NodeStatus, TrainingStatus, SyncStatus, ...: the schema of `starling status --json`,
                      the contract every room reports in and ops/ reads

    config/     the config file: the [node] [train] [sync] sections, load_config, ConfigError
    swarm/      the swarm: its state as signed CRDTs and their replication, NAT traversal (daemon process)
    averaging/  the daemon's side of an outer step: averager, pairing, partner misses, bounds, late join
    bridge/     the torch-free daemon <-> worker contract: supervisor, messages, shared memory, the
                exchange, the checkpoint file, a worker group's processes
    worker/     the torch worker process (`python -m node.worker`): its loop, trainer, group, outer
                step, task, checkpoints, export
    ops/        the operator's side: control socket, lock, logs, metrics, status view, doctor, systemd
                notify, loss history and plot, the launcher and `make run`'s local swarm
    tasks/      the built-in tasks (stdlib_lm, hf_causal_lm), run in the worker; at node/'s top because
                config files name them by module path (`train.task = "node.tasks.stdlib_lm:make_task"`)
    task.py, train_config.py  the task API's 0.2 import paths (`from node.task import TaskContext`,
                `from node.train_config import TrainConfig`), kept for task modules written against them;
                they re-export node/worker/task.py and node/config/train.py and nothing imports them here

Each room's __init__ lists its modules. docs/architecture.md sketches the processes and the data path.

The names below are importable from the package itself (``from node import Daemon``); each module is
imported on first use, so ``import node`` loads nothing heavy. Code in this repository imports from the
modules themselves.
"""

from __future__ import annotations

from p2p.lazy import lazy_exports

_EXPORTS = {
    "Daemon": "node.daemon",
    "StartupError": "node.daemon",
    "Config": "node.config.load",
    "ConfigError": "node.config.load",
    "NodeConfig": "node.config.load",
    "load_config": "node.config.load",
    "TrainConfig": "node.config.train",
    "SyncConfig": "node.config.sync",
    "NatService": "node.swarm.nat",
    "SwarmState": "node.swarm.crdt",
    "StateReplicator": "node.swarm.replicator",
    "Averager": "node.averaging.averager",
    "UpdateBound": "node.averaging.robust",
    "CatchUp": "node.averaging.latejoin",
    "WorkerSupervisor": "node.bridge.supervisor",
    "ControlError": "node.ops.control",
    "request_status": "node.ops.control",
    "NodeStatus": "node.status_schema",
    "Metrics": "node.ops.metrics",
    "render_status": "node.ops.status_view",
    "PairingGraph": "node.ops.islands",
    "pairing_graph": "node.ops.islands",
    "Finding": "node.ops.doctor_findings",
    "run_checks": "node.ops.doctor",
    "LossHistory": "node.ops.history",
    "DaemonProcess": "node.ops.launcher",
    "Trainer": "node.worker.trainer",
    "OuterOptimizer": "node.worker.outer",
    "Task": "node.worker.task",
    "TaskContext": "node.worker.task",
    "load_task": "node.worker.task",
    "CheckpointStore": "node.worker.checkpoint",
}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
