"""Package surfaces whose modules load on first use (PEP 562), shared by the packages' `__init__`s.

Why lazy: `import p2p` (or `protocols`, `node`) must stay light, so that `starling status` and other
small commands load neither libp2p nor torch, while `from node import Daemon` still works.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`: each name in `exports` (name -> module) is imported from
    its module on first use and then cached in the package's `namespace`."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
