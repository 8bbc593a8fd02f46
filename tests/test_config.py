"""Config precedence (flags > env > file > defaults) and one-line errors that name the option."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from procs import starling

from node.config import ConfigError, load_config, render_config_file, resolve_home


def write(home: Path, text: str) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(text)


def test_defaults_apply_without_file(tmp_path: Path) -> None:
    cfg = load_config(tmp_path, environ={})
    assert cfg.node.target_peers == 8 and cfg.node.max_peers == 32 and cfg.node.swarm == "default"


def test_file_overrides_defaults(tmp_path: Path) -> None:
    write(tmp_path, '[node]\nswarm = "filed"\ntarget_peers = 5\n')
    cfg = load_config(tmp_path, environ={})
    assert (cfg.node.swarm, cfg.node.target_peers) == ("filed", 5)


def test_env_overrides_file_and_flags_override_env(tmp_path: Path) -> None:
    write(tmp_path, '[node]\nswarm = "filed"\ntarget_peers = 5\n')
    env = {"STARLING_NODE_SWARM": "envd", "STARLING_NODE_TARGET_PEERS": "6"}
    cfg = load_config(tmp_path, environ=env)
    assert (cfg.node.swarm, cfg.node.target_peers) == ("envd", 6)
    cfg = load_config(tmp_path, environ=env, overrides={"node.swarm": "flagged"})
    assert (cfg.node.swarm, cfg.node.target_peers) == ("flagged", 6)


def test_env_list_is_comma_separated(tmp_path: Path) -> None:
    env = {"STARLING_NODE_LISTEN": "/ip4/127.0.0.1/tcp/1, /ip4/127.0.0.1/tcp/2"}
    assert load_config(tmp_path, environ=env).node.listen == ["/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/2"]


@pytest.mark.parametrize(
    "text, option",
    [
        ("[node]\ntarget_peers = \"many\"\n", "node.target_peers"),
        ("[node]\ntarget_peers = 99\n", "node.target_peers"),
        ("[node]\nbootstrap = [\"/ip4/1.2.3.4/tcp/1\"]\n", "node.bootstrap"),
        ("[node]\nlisten = [\"nonsense\"]\n", "node.listen"),
        ("[node]\nno_such_option = 1\n", "node.no_such_option"),
        ("[node]\nswarm = \"has space\"\n", "node.swarm"),
    ],
)
def test_invalid_file_value_names_the_option(tmp_path: Path, text: str, option: str) -> None:
    write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path, environ={})
    assert option in str(e.value) and "\n" not in str(e.value)


def test_invalid_env_value_names_the_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="node.max_peers"):
        load_config(tmp_path, environ={"STARLING_NODE_MAX_PEERS": "lots"})


def test_broken_toml_is_reported_with_the_file(tmp_path: Path) -> None:
    write(tmp_path, "[node\n")
    with pytest.raises(ConfigError, match="config.toml"):
        load_config(tmp_path, environ={})


def test_rendered_file_is_valid_toml_with_every_option_commented(tmp_path: Path) -> None:
    text = render_config_file({"node": {"swarm": "mine"}})
    data = tomllib.loads(text)
    assert data["node"] == {"swarm": "mine"}
    for name in ("target_peers", "max_peers", "bootstrap", "listen", "log_level"):
        assert f"# {name} = " in text
    write(tmp_path, text)
    assert load_config(tmp_path, environ={}).node.swarm == "mine"


def test_home_resolution_order(tmp_path: Path) -> None:
    assert resolve_home(str(tmp_path / "a"), {"STARLING_HOME": str(tmp_path / "b")}) == tmp_path / "a"
    assert resolve_home(None, {"STARLING_HOME": str(tmp_path / "b")}) == tmp_path / "b"
    assert resolve_home(None, {}).name == ".starling"


def test_cli_bad_option_is_one_line_exit_2_without_traceback(tmp_path: Path) -> None:
    r = starling("run", "--home", str(tmp_path), "--set", "node.target_peers=zero", timeout=60)
    assert r.returncode == 2
    assert "node.target_peers" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_malformed_bootstrap_flag_is_rejected_clearly(tmp_path: Path) -> None:
    r = starling("run", "--home", str(tmp_path), "--bootstrap", "/ip4/127.0.0.1/tcp/9", timeout=60)
    assert r.returncode == 2 and "node.bootstrap" in r.stderr and "/p2p/" in r.stderr
