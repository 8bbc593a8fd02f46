"""What every config section module shares: :func:`opt`, a dataclass field with a default and a help text.

Its own module so that the section modules (node/config/train.py, node/config/sync.py) do not import
node/config/load.py, which imports them to list the config file's sections.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A config field with a default and a one-line help text."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})
