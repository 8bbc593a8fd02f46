"""README's figures are the docs' figures (issue #52, item 2): where README quotes a figure that a bench writes
into docs/benchmarks.md, the two agree, so a rerun that changes the docs fails this test until README follows.

Each entry: the figure's pattern in the generated section of docs/benchmarks.md, and how README words it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: (name, section, the figure's pattern in that section, README's wording with {} for the figure)
FIGURES = [
    ("exchange against raw TCP", "## Sync", r"\*\*fp32 exchange / raw TCP = ([0-9.]+)\*\*",
     "fp32 exchange reaches {} of a raw TCP socket"),
    ("against hivemind", "## Sync", r"\*\*Starling is ([0-9.]+)x as fast per averaging call\*\*",
     "averaging is {}x as fast per call as hivemind"),
    ("throughput while averaging", "## Sync", r"\*\*averaging / alone = ([0-9.]+)\*\*",
     "training keeps {} of its throughput while averaging"),
    ("real daemons against the simulation", "## Swarm",
     r"convergence, swarm \(real daemons\): gap share closed [0-9.]+ vs the simulation's [0-9.]+, ratio ([0-9.]+)",
     "4 daemons close {}x the share"),
    ("fast with slow", "## Swarm", r"fast-slow exchanges >= 30% of all exchanges: [a-zA-Z ]+ \(([0-9]+)%",
     "{}% of exchanges fast with slow"),
]


def section(text: str, heading: str) -> str:
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end >= 0 else len(text)]


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize(("name", "heading", "pattern", "wording"), FIGURES, ids=[f[0] for f in FIGURES])
def test_readme_quotes_the_figure_its_docs_section_holds(name: str, heading: str, pattern: str, wording: str) -> None:
    docs = section((ROOT / "docs" / "benchmarks.md").read_text(), heading)
    match = re.search(pattern, docs)
    assert match, f"{name}: no figure matching {pattern!r} in section {heading!r} of docs/benchmarks.md"
    readme = _flat((ROOT / "README.md").read_text())
    assert wording.format(match.group(1)) in readme, (
        f"{name}: README should say {wording.format(match.group(1))!r} (docs/benchmarks.md, {heading})")
