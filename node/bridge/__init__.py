"""node.bridge: the torch-free contract between the daemon and its torch worker, and the daemon's side of it.

    supervisor.py   WorkerSupervisor: spawns, watches and restarts the worker; hands its exchanges to the averager
    ipc.py          Hello, Publish, Result, ...: the daemon-worker messages (framed by p2p/framing.py)
    shm.py          ExchangeSlots, SharedTensor: float32 arrays in shared memory, daemon and worker
    exchange.py     ExchangeRequest, ExchangeOutcome, ExchangeFn, Layout: what the supervisor and averager trade
    ckptfile.py     read_phi, write_phi, CheckpointError: the checkpoint file format, phi without torch
    group_procs.py  FollowerProcs, Rendezvous: a multi-GPU worker group's ranks as processes
    livephi.py      LivePhi: the worker's phi slot served to joiners while it is still (issue #55)

Both processes import these modules, so none of them imports torch: the worker (node/worker/) builds on
them, the daemon drives the worker through them. Imports the config and the status contract only.
"""
