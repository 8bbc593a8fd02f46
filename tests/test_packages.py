"""Each package's __init__: a docstring that lists every module, a curated surface that resolves, and no
heavy import (the surface is loaded lazily, PEP 562)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGES = ["p2p", "protocols", "node", "node.tasks"]


@pytest.mark.parametrize("name", PACKAGES)
def test_the_docstring_lists_every_module_of_the_package(name: str) -> None:
    package = importlib.import_module(name)
    assert package.__file__ is not None and package.__doc__
    modules = sorted(p.name for p in Path(package.__file__).parent.glob("*.py") if p.name != "__init__.py")
    assert [m for m in modules if m not in package.__doc__] == [], f"add them to {name}/__init__.py's docstring"


@pytest.mark.parametrize("name", ["p2p", "protocols", "node"])
def test_every_exported_name_resolves_from_its_module(name: str) -> None:
    package = importlib.import_module(name)
    for export in package.__all__:
        value = getattr(package, export)
        assert getattr(value, "__name__", export) == export, export
    assert set(package.__all__) <= set(dir(package))
    with pytest.raises(AttributeError):
        package.no_such_name  # noqa: B018


def test_importing_the_packages_loads_nothing_heavy() -> None:
    code = (
        "import sys, p2p, protocols, node, node.tasks, node.status_schema, node.status_view\n"
        "print(sorted(m for m in ('torch', 'libp2p', 'trio', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_the_daemon_process_loads_no_torch() -> None:
    """The daemon averages on numpy views of the shared memory and reads checkpoints' phi without torch:
    `starling run` (node.cli -> node.daemon and everything it imports) must never load torch, which
    would cost the daemon about 200 MB of memory and seconds of start-up. Only the worker imports it."""
    code = (
        "import sys, node.cli, node.daemon, node.supervisor, node.averager, node.latejoin\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"
