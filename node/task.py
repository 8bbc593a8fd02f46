"""The task API's 0.2 import path, kept for task modules written against it (README: Bring your own model):
``from node.task import TaskContext, TaskError, autocast`` still works. The API lives in node/worker/task.py
and new code imports it from there; nothing in this repository imports this module."""

from node.worker.task import *  # noqa: F403
