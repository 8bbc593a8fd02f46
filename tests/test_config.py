"""Config precedence (flags > env > file > defaults) and one-line errors that name the option."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from node.config.load import ConfigError, load_config, render_config_file, resolve_home, unknown_environment
from starling_testing.daemon import starling


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


def test_a_bad_environment_value_names_the_variable_and_its_value(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path, environ={"STARLING_NODE_MAX_PEERS": "lots"})
    assert str(e.value).startswith("STARLING_NODE_MAX_PEERS=lots (environment): node.max_peers: ")


def test_an_out_of_range_environment_value_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path, environ={"STARLING_NODE_TARGET_PEERS": "99"})
    assert str(e.value) == "STARLING_NODE_TARGET_PEERS=99 (environment): node.target_peers: must be between 1 and 32"


@pytest.mark.parametrize("text", ["[node]\ntarget_peers = 99\n", "[node]\ntarget_peers = \"many\"\n"],
                         ids=["out-of-range", "wrong-type"])
def test_a_bad_file_value_names_the_file(tmp_path: Path, text: str) -> None:
    write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path, environ={})
    assert str(e.value).startswith(f"{tmp_path / 'config.toml'}: node.target_peers: ")


def test_a_check_across_options_names_the_source_of_each(tmp_path: Path) -> None:
    write(tmp_path, "[train]\nwarmup = 500\n")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path, environ={"STARLING_TRAIN_TOTAL_STEPS": "100"})
    assert str(e.value).startswith(
        f"{tmp_path / 'config.toml'}, STARLING_TRAIN_TOTAL_STEPS=100 (environment): train.warmup: "
    )


def test_a_flag_that_fixes_a_bad_environment_value_wins_and_a_bad_flag_is_named_alone(tmp_path: Path) -> None:
    env = {"STARLING_NODE_TARGET_PEERS": "99"}
    assert load_config(tmp_path, environ=env, overrides={"node.target_peers": "4"}).node.target_peers == 4
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path, environ={}, overrides={"node.target_peers": "99"})
    assert str(e.value).startswith("node.target_peers: ")


def test_unknown_starling_variables_are_warned_about_with_the_closest_option() -> None:
    env = {"STARLING_NODE_BOOTSTARP": "x", "STARLING_HOME": "/h", "STARLING_NODE_SWARM": "s", "PATH": "/bin"}
    assert unknown_environment(env) == [
        "environment variable STARLING_NODE_BOOTSTARP is not a Starling option and is ignored; "
        "did you mean STARLING_NODE_BOOTSTRAP?"
    ]
    assert unknown_environment({"STARLING_ZZZ": "1"}) == [
        "environment variable STARLING_ZZZ is not a Starling option and is ignored"
    ]


def test_cli_bad_environment_value_is_one_line_exit_2_naming_the_variable(tmp_path: Path) -> None:
    r = starling("run", "--home", str(tmp_path), env={"STARLING_NODE_TARGET_PEERS": "zero"}, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "starling: error: STARLING_NODE_TARGET_PEERS=zero (environment): node.target_peers: "
        "expected an integer, got 'zero'"
    ]


def test_init_refuses_to_move_an_existing_home_to_another_swarm(tmp_path: Path) -> None:
    home = tmp_path / "h"
    assert starling("init", "--home", str(home), "--swarm", "first").returncode == 0
    before = (home / "config.toml").read_text()

    again = starling("init", "--home", str(home), "--swarm", "first")
    other = starling("init", "--home", str(home), "--swarm", "other")

    assert again.returncode == 0
    assert other.returncode == 2 and "already names swarm 'first'" in other.stderr and "node.swarm" in other.stderr
    assert len(other.stderr.strip().splitlines()) == 1
    assert (home / "config.toml").read_text() == before
