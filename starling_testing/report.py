"""Writing measured figures into the docs: the benchmarks' `--write-docs`."""

from __future__ import annotations

from pathlib import Path

__all__ = ["replace_section"]


def replace_section(path: Path, heading: str, body: str) -> None:
    """Replace one `## ` section of a Markdown file such as docs/benchmarks.md (or append it), leaving the
    others alone."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\nEach section says the command that produced it.\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.strip() == heading), None)
    if start is None:
        text = text.rstrip("\n") + "\n\n" + body
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        text = "".join(lines[:start]) + body + ("\n" if end < len(lines) else "") + "".join(lines[end:])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def publish(text: str, path: Path, heading: str, *, write: bool) -> None:
    """What every bench does with its report: print it, and with ``--write-docs`` make it section `heading`
    of `path` (docs/benchmarks.md)."""
    print(text)
    if write:
        replace_section(path, heading, text)
