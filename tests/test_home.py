"""HOME's layout (node/config/home.py) is an on-disk format: a HOME written by an earlier release must still be
found after an upgrade. Each path a `Home` names is pinned here to its literal spelling."""

from __future__ import annotations

from pathlib import Path

from node.config.home import Home, checkpoint_name, checkpoint_step


def test_every_path_of_a_home_is_the_layout_earlier_releases_wrote() -> None:
    root = Path("/srv/starling")
    home = Home(root)
    assert {
        "config": home.config, "run_config": home.run_config, "identity": home.identity, "swarm_key": home.swarm_key,
        "lock": home.lock, "control_socket": home.control_socket, "log": home.log, "history": home.history,
        "swarm_state": home.swarm_state, "manifest_pin": home.manifest_pin, "checkpoints": home.checkpoints,
        "model_checkpoints": home.model_checkpoints("stdlib_lm", "0123456789abcdef"),
        "join": home.join.path, "join_snapshot": home.join.snapshot, "join_partial": home.join.partial,
        "catchup": home.catchup.path, "catchup_snapshot": home.catchup.snapshot,
        "catchup_partial": home.catchup.partial,
    } == {
        "config": root / "config.toml", "run_config": root / "run-config.toml", "identity": root / "identity.key",
        "swarm_key": root / "swarm.key", "lock": root / "daemon.lock", "control_socket": root / "control.sock",
        "log": root / "daemon.log", "history": root / "history.msgpack", "swarm_state": root / "state.msgpack",
        "manifest_pin": root / "manifest.pin", "checkpoints": root / "checkpoints",
        "model_checkpoints": root / "checkpoints" / "stdlib_lm-0123456789ab",
        "join": root / "join", "join_snapshot": root / "join" / "snapshot.pt", "join_partial": root / "join" / "partial",
        "catchup": root / "catchup", "catchup_snapshot": root / "catchup" / "snapshot.pt",
        "catchup_partial": root / "catchup" / "partial",
    }
    assert home.private_folders == (root / "checkpoints", root / "join", root / "catchup")
    assert home.swarm_key_file("") == root / "swarm.key"
    assert home.swarm_key_file("/etc/starling/swarm.key") == Path("/etc/starling/swarm.key")
    assert Home(str(root)) == home  # --home and $STARLING_HOME arrive as text


def test_checkpoint_names_are_the_step_zero_padded_and_only_they_count(tmp_path: Path) -> None:
    assert checkpoint_name(1500) == "ckpt-000000001500.pt"
    assert checkpoint_step("ckpt-000000001500.pt") == 1500
    assert [checkpoint_step(n) for n in (".ckpt-tmp-x", "ckpt-000000001500.pt.corrupt", "ckpt-15.pt")] == [None] * 3
    home = Home(tmp_path)
    assert home.checkpoint_files() == []  # no checkpoints folder yet
    for model, step in (("a-1", 5), ("a-1", 10), ("b-2", 7)):
        (home.checkpoints / model).mkdir(parents=True, exist_ok=True)
        (home.checkpoints / model / checkpoint_name(step)).write_bytes(b"")
    (home.checkpoints / "a-1" / ".ckpt-tmp-123").write_bytes(b"")
    assert home.checkpoint_files() == [(10, home.checkpoints / "a-1" / "ckpt-000000000010.pt"),
                                       (7, home.checkpoints / "b-2" / "ckpt-000000000007.pt"),
                                       (5, home.checkpoints / "a-1" / "ckpt-000000000005.pt")]
