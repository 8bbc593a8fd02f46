"""node.config: the config file's sections and how they are loaded (defaults < config.toml < env < flags).

    load.py     Config, NodeConfig, load_config, ConfigError: the [node] section, the whole file, its loading
    train.py    TrainConfig: the [train] section (what the worker trains and how)
    sync.py     SyncConfig: the [sync] section (how a node pairs and moves tensors at an outer step)
    base.py     opt: a config field with its help text (the sections' shared helper, apart so that the
                sections do not import load.py, which imports them to list the file's sections)
    home.py     Home: HOME's layout, every file and folder a node keeps there, named once (an on-disk format)

Imports nothing of node/ but itself: every room may read its section. The names below are importable from
the package (``from node.config import load_config``, the 0.2 module's path), each on first use.
"""

from __future__ import annotations

from p2p.lazy import lazy_exports

_EXPORTS = {
    "Config": "node.config.load",
    "ConfigError": "node.config.load",
    "NodeConfig": "node.config.load",
    "load_config": "node.config.load",
    "TrainConfig": "node.config.train",
    "SyncConfig": "node.config.sync",
    "Home": "node.config.home",
}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
