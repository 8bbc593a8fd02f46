"""Each package's __init__: a docstring that lists every module, a curated surface that resolves, and no
heavy import (the surface is loaded lazily, PEP 562)."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOMS = ["node.config", "node.swarm", "node.averaging", "node.bridge", "node.worker", "node.ops"]
PACKAGES = ["p2p", "protocols", "node", *ROOMS, "node.tasks"]


@pytest.mark.parametrize("name", PACKAGES)
def test_the_docstring_lists_every_module_of_the_package(name: str) -> None:
    package = importlib.import_module(name)
    assert package.__file__ is not None and package.__doc__
    modules = sorted(p.name for p in Path(package.__file__).parent.glob("*.py") if p.name != "__init__.py")
    assert [m for m in modules if m not in package.__doc__] == [], f"add them to {name}/__init__.py's docstring"


@pytest.mark.parametrize("name", ["p2p", "protocols", "node", "node.config", "node.worker"])
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
        "import sys, p2p, protocols, node, node.tasks, node.status_schema, node.ops.status_view, "
        + ", ".join(ROOMS) + "\n"
        "print(sorted(m for m in ('torch', 'libp2p', 'trio', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_the_daemon_process_loads_no_torch() -> None:
    """The daemon averages on numpy views of the shared memory and reads checkpoints' phi without torch:
    `starling run` (node.cli -> node.daemon and everything it imports) must never load torch, which
    would cost the daemon about 200 MB of memory and seconds of start-up. Only the worker imports it."""
    code = (
        "import sys, node.cli, node.daemon, node.bridge.supervisor, node.averaging.averager, "
        "node.averaging.latejoin\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_task_modules_written_against_0_2_still_import(tmp_path: Path) -> None:
    """A task module is the operator's code, named by their config files: the task API's 0.2 import paths
    (`node.task`, `node.train_config`, `node.worker`'s `default_optimizer`) keep working after the rooms
    moved those modules, and give the same objects, so that `load_task`'s Task check still holds."""
    (tmp_path / "old_task.py").write_text(
        "from node.task import TaskContext, TaskError, autocast, load_task\n"
        "from node.train_config import TrainConfig\n"
        "from node.worker import default_optimizer\n"
        "from node.config import load_config\n"
    )
    code = (
        "import old_task, node.worker.task as t, node.config.train as c, node.worker.trainer as w, node.config.load as l\n"
        "print(old_task.TaskContext is t.TaskContext and old_task.load_task is t.load_task and "
        "old_task.TrainConfig is c.TrainConfig and old_task.default_optimizer is w.default_optimizer and "
        "old_task.load_config is l.load_config)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         env=env)
    assert out.stdout.strip() == "True"


def _imports_of(path: Path, package_root: Path) -> set[str]:
    """Every module of the repository's packages that `path` imports anywhere: at the top, inside functions
    (lazy) and under TYPE_CHECKING alike."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    modules = set()
    for name in names:
        parts = name.split(".")
        while parts and not ((package_root.joinpath(*parts).with_suffix(".py")).exists()
                             or package_root.joinpath(*parts, "__init__.py").exists()):
            parts.pop()
        if parts and parts[0] in ("p2p", "protocols", "node"):
            modules.add(".".join(parts))
    return modules


def test_no_module_imports_itself_through_others_not_even_lazily() -> None:
    """No import cycles, lazy imports and TYPE_CHECKING ones included: a cycle hidden in a function is still
    two modules that cannot be read, tested or moved apart (node/worker/main.py exists to break the
    trainer <-> group one). A package's __init__ counts as a module of its own."""
    root = Path(__file__).resolve().parent.parent
    graph: dict[str, set[str]] = {}
    for top in ("p2p", "protocols", "node"):
        for path in (root / top).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
            graph[name] = _imports_of(path, root) - {name}
    cycles = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            module, trail = stack.pop()
            for dep in graph.get(module, ()):
                if dep == start:
                    cycles.append(" -> ".join([*trail, start]))
                elif dep not in seen:
                    seen.add(dep)
                    stack.append((dep, [*trail, dep]))
    assert cycles == []
