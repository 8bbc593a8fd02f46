"""`python -m node.worker`: the worker process (node/worker/main.py says its modes, node/worker/loop.py
what the daemon's worker does). Only an entry point: the code lives in importable modules, so the classes
the loop knows are the ones node/worker/group.py subclasses."""

from node.worker.main import process_main

process_main()
