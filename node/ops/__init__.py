"""node.ops: what the operator touches: the control socket, status views, metrics, logs, doctor, plots.

    control.py      serve_control, request_status, ControlError: the local control socket
    lock.py         HomeLock: one daemon per HOME
    logs.py         setup_logging: levels for the journal, py-libp2p's chatter tamed (daemon and worker)
    metrics.py      Metrics, serve_metrics: Prometheus metrics from the status
    status_view.py  render_status: the readable `starling status`
    refusals.py     collect: what every limit refused to peers, summed by kind (`status`: refusals)
    islands.py      PairingGraph, pairing_graph: the swarm's pairing graph (islands), from the status;
                    mutual_share, window_mixing: how a pairing rule agrees across views and mixes
    doctor.py       run_checks, doctor_main: `starling doctor`, its checks in report order and the report
    doctor_findings.py  Finding, its levels: what every doctor check returns
    doctor_local.py     the checks that need no daemon: identity, HOME, config, swarm key, ports
    doctor_bootstrap.py check_bootstrap: do the bootstrap peers answer and complete a handshake
    doctor_status.py    the checks of the running daemon's status: reachability, clocks, training, pairing
    sdnotify.py     Notifier, summarize_status: systemd's notify protocol and watchdog
    history.py      LossHistory: every member's loss curve;  plot.py  plot_history: it as a PNG
    dashboards.py   StatusLog, scalars_of: one point per outer step of the status, for the dashboards below
    tensorboard.py  TensorBoardLog: this node's training and averaging as TensorBoard event files
    wandb_log.py    WandbLog: the same points as an offline Weights & Biases run
    launcher.py     DaemonProcess: starts a `starling run` process and watches its status
    localswarm.py   main: `make run`, a local swarm with a live view

These read the status (node/status_schema.py) and the config, and import nothing else of node/: the
daemon and the CLI use them, never the other way round. `starling status` renders with them alone.
"""
