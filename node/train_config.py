"""The [train] section's 0.2 import path, kept for task modules written against it:
``from node.train_config import TrainConfig`` still works. The section lives in node/config/train.py and new
code imports it from there; nothing in this repository imports this module."""

from node.config.train import *  # noqa: F403
