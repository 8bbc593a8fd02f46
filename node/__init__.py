"""node: the daemon, the top of p2p <- protocols <- node (pyproject.toml's import contracts).

The daemon process (trio, libp2p, numpy; it loads no torch):

    daemon.py         Daemon, StartupError: owns the host and runs everything below; builds the status
    cli.py            main: the `starling` command (init, run, status, doctor, plot, export, swarm-key)
    config.py         Config, NodeConfig, load_config, ConfigError: defaults < config.toml < env < flags
    train_config.py   TrainConfig: the [train] section;  sync_config.py  SyncConfig: the [sync] section
    config_base.py    opt: a config field with its help text
    nat.py            NatService: reachability, circuit relays, hole punching, the path to each peer
    crdt.py           SwarmState, MemberState, ManifestAuthority: the swarm state as signed CRDTs
    replicator.py     StateReplicator: that state replicated by gossip and anti-entropy
    averager.py       Averager: the daemon's side of an outer step (pair and average, or step solo)
    pairing.py        schedule, scheduled_partners: who averages with whom at each outer step
    partner_misses.py PartnerMisses: trainers that miss round after round stop counting as partners
    robust.py         UpdateBound: how far one partner's values may move us
    compression_choice.py  choose_compression: `sync.compression = auto`'s preset for each exchange
    latejoin.py       CatchUp, late_join: a trainer takes the swarm's weights instead of its own
    ckptfile.py       read_phi, write_phi, CheckpointError: the checkpoint file format, phi without torch
    supervisor.py     WorkerSupervisor: spawns, watches and restarts the torch worker
    ipc.py            Hello, Publish, Result, ...: the daemon-worker messages and their framing
    group_procs.py    FollowerProcs, Rendezvous: a multi-GPU worker group's ranks as processes
    exchange.py       ExchangeRequest, ExchangeOutcome, ExchangeFn: what the supervisor and averager trade
    shm.py            ExchangeSlots, SharedTensor: float32 arrays in shared memory, daemon and worker
    control.py        serve_control, request_status, ControlError: the local control socket
    lock.py           HomeLock: one daemon per HOME
    status_schema.py  NodeStatus, TrainingStatus, SyncStatus, ...: the schema of `starling status --json`
    metrics.py        Metrics, serve_metrics: Prometheus metrics from that status
    status_view.py    render_status: the readable `starling status`
    refusals.py       collect: what every limit refused to peers, summed by kind (`status`: refusals)
    mixing.py         PairingGraph, pairing_graph: the swarm's pairing graph (islands)
    doctor.py         run_checks, Finding: `starling doctor`
    sdnotify.py       Notifier, summarize_status: systemd's notify protocol and watchdog
    history.py        LossHistory: every member's loss curve;  plot.py  plot_history: it as a PNG
    logs.py           setup_logging: levels for the journal, py-libp2p's chatter tamed
    launcher.py       DaemonProcess: starts a `starling run` process and watches its status
    localswarm.py     main: `make run`, a local swarm with a live view

The torch worker process (imports torch):

    worker.py         Trainer: inner and outer steps, the worker's side of the conversation
    worker_group.py   WorkerGroup: a multi-GPU host as one node (torch.distributed)
    outer.py          OuterOptimizer: NoLoCo and DiLoCo on flat fp32 slow weights
    task.py           Task, TaskContext, load_task: what a training task provides (tasks/: the built-in ones)
    checkpoint.py     CheckpointStore: atomic, hashed checkpoints
    export.py         export_weights: `starling export`

The names below are importable from the package itself (``from node import Daemon``); each module is
imported on first use, so ``import node`` loads nothing heavy. Code in this repository imports from the
modules themselves.
"""

from __future__ import annotations

from p2p.lazy import lazy_exports

_EXPORTS = {
    "Daemon": "node.daemon",
    "StartupError": "node.daemon",
    "Config": "node.config",
    "ConfigError": "node.config",
    "NodeConfig": "node.config",
    "load_config": "node.config",
    "TrainConfig": "node.train_config",
    "SyncConfig": "node.sync_config",
    "NatService": "node.nat",
    "SwarmState": "node.crdt",
    "StateReplicator": "node.replicator",
    "Averager": "node.averager",
    "UpdateBound": "node.robust",
    "CatchUp": "node.latejoin",
    "WorkerSupervisor": "node.supervisor",
    "ControlError": "node.control",
    "request_status": "node.control",
    "NodeStatus": "node.status_schema",
    "Metrics": "node.metrics",
    "render_status": "node.status_view",
    "PairingGraph": "node.mixing",
    "pairing_graph": "node.mixing",
    "Finding": "node.doctor",
    "run_checks": "node.doctor",
    "LossHistory": "node.history",
    "DaemonProcess": "node.launcher",
    "Trainer": "node.worker",
    "OuterOptimizer": "node.outer",
    "Task": "node.task",
    "TaskContext": "node.task",
    "load_task": "node.task",
    "CheckpointStore": "node.checkpoint",
}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
