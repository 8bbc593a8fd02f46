"""What an idle daemon repeats, done once (issue #24: bench/scale.py --profile on 16 network-only daemons)."""

from __future__ import annotations

import pytest

from node import daemon


def test_the_package_version_in_every_heartbeat_is_read_from_its_metadata_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """importlib.metadata parses the package's METADATA file on every call: 5% of an idle daemon's CPU when
    each heartbeat (every 2 s) asked for it."""
    calls = []
    monkeypatch.setattr(daemon, "version", lambda name: calls.append(name) or "9.9.9")
    daemon.starling_version.cache_clear()
    try:
        assert [daemon.starling_version() for _ in range(5)] == ["9.9.9"] * 5
        assert calls == ["starling"]
    finally:
        daemon.starling_version.cache_clear()
