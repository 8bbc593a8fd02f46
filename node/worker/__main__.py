"""`python -m node.worker`: the worker process (node/worker/trainer.py says what it does).

The code lives in importable modules, so the classes the loop knows are the ones node/worker/group.py
subclasses: no copy of a module runs as ``__main__``.
"""

from __future__ import annotations

import sys

from node.worker.trainer import parse_args, run_main

args = parse_args()
code = run_main(args)
if args.follow or args.group:
    from node.worker.group import exit_group_process

    exit_group_process(code)
sys.exit(code)
