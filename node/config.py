"""Configuration: dataclass sections, loaded from defaults < config.toml < STARLING_* env < flags.

Each section is a dataclass whose fields carry a one-line `help` (rendered as comments by `starling init`,
so the file documents every option). Values are coerced to the field's type with an error that names the
option (`node.target_peers: expected an integer, got 'x'`), because an operator reading a systemd journal
needs the option's name, not a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import tomli_w

CONFIG_FILE = "config.toml"
ENV_PREFIX = "STARLING_"


class ConfigError(Exception):
    """A bad option value or config file; the message names the option (one line, no traceback)."""


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A config field with a default and a one-line help text."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class NodeConfig:
    swarm: str = opt("default", "swarm name; only peers of the same swarm find and talk to each other")
    listen: list[str] = opt(["/ip4/0.0.0.0/tcp/4001"], "libp2p listen multiaddrs (TCP)")
    announce: list[str] = opt([], "addresses to advertise instead of the listen ones (e.g. a public IP)")
    bootstrap: list[str] = opt([], "bootstrap peers, full multiaddrs ending in /p2p/<peer id>")
    bootstrap_files: list[str] = opt([], "files listing bootstrap multiaddrs, one per line (re-read while running)")
    addr_file: str = opt("", "write this node's dialable multiaddrs to this file once listening ('' = off)")
    swarm_key_file: str = opt("", "swarm key file (private swarm); '' = HOME/swarm.key when it exists")
    allow_peers: list[str] = opt([], "if not empty, only these PeerIDs may use this node's protocols")
    target_peers: int = opt(8, "connections the node keeps open to swarm members")
    max_peers: int = opt(32, "hard cap on connections to swarm members")
    dial_timeout: float = opt(10.0, "seconds one dial may take")
    discovery_interval: float = opt(10.0, "seconds between DHT lookups for swarm members once settled")
    heartbeat_s: float = opt(2.0, "seconds between this node's signed heartbeats to the swarm state")
    suspect_after: float = opt(15.0, "a member silent this long is shown as suspect")
    gone_after: float = opt(60.0, "a member silent this long is shown as gone (its history is kept)")
    log_level: str = opt("info", "debug | info | warning | error")
    metrics_port: int = opt(0, "Prometheus metrics port on 127.0.0.1 (0 = off)")
    metrics_host: str = opt("127.0.0.1", "address the metrics endpoint binds")

    def validate(self) -> None:
        if not self.swarm or len(self.swarm) > 64 or not all(c.isalnum() or c in "-_." for c in self.swarm):
            raise ValueError("node.swarm: 1-64 characters of letters, digits, '-', '_' or '.'")
        if not self.listen:
            raise ValueError("node.listen: at least one listen address is needed")
        from p2p.addrs import AddrError, parse_bootstrap, parse_listen

        for a in self.listen:
            try:
                parse_listen(a)
            except AddrError as e:
                raise ValueError(f"node.listen: {e}") from None
        for a in self.announce:
            try:
                parse_listen(a, allow_wildcard=False)
            except AddrError as e:
                raise ValueError(f"node.announce: {e}") from None
        for a in self.bootstrap:
            try:
                parse_bootstrap(a)
            except AddrError as e:
                raise ValueError(f"node.bootstrap: {e}") from None
        for peer in self.allow_peers:
            from libp2p.peer.id import ID

            try:
                ID.from_base58(peer)
            except Exception:
                raise ValueError(f"node.allow_peers: {peer!r} is not a PeerID") from None
        if not 1 <= self.target_peers <= 32:
            raise ValueError("node.target_peers: must be between 1 and 32")
        if not self.target_peers <= self.max_peers <= 32:
            raise ValueError("node.max_peers: must be between target_peers and 32")
        if not 0.5 <= self.dial_timeout <= 120:
            raise ValueError("node.dial_timeout: must be between 0.5 and 120 seconds")
        if not 1 <= self.discovery_interval <= 3600:
            raise ValueError("node.discovery_interval: must be between 1 and 3600 seconds")
        if not 0.2 <= self.heartbeat_s <= 600:
            raise ValueError("node.heartbeat_s: must be between 0.2 and 600 seconds")
        if not self.heartbeat_s < self.suspect_after < self.gone_after:
            raise ValueError("node.suspect_after / node.gone_after: need heartbeat_s < suspect_after < gone_after")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError("node.log_level: one of debug, info, warning, error")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError("node.metrics_port: must be a port number (0 = off)")


def _sections() -> dict[str, type]:
    """The config file's sections, in file order. Later issues add sections here."""
    sections: dict[str, type] = {"node": NodeConfig}
    try:
        from node.train_config import TrainConfig
    except ImportError:  # the trainer is optional at import time for network-only tooling
        pass
    else:
        sections["train"] = TrainConfig
    try:
        from node.sync_config import SyncConfig
    except ImportError:
        pass
    else:
        sections["sync"] = SyncConfig
    return sections


@dataclass
class Config:
    """The whole configuration; one attribute per section (`cfg.node.swarm`, `cfg.train.inner_steps`)."""

    sections: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["sections"][name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(sec) for name, sec in self.sections.items()}


# --- coercion ---------------------------------------------------------------------------------------------


def _coerce(section: str, name: str, typ: Any, value: Any, *, from_text: bool) -> Any:
    """Coerce `value` to `typ`, naming the option on failure. Text (env/flags) is parsed; TOML is checked."""
    where = f"{section}.{name}"
    origin = getattr(typ, "__origin__", None)
    if origin is list:
        if from_text and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of strings, got {value!r}")
        return list(value)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if from_text and isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_text and isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_text and isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if typ is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise ConfigError(f"{where}: unsupported option type {typ!r}")


def _field_types(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


# --- loading ----------------------------------------------------------------------------------------------


def load_config(
    home: Path | None,
    *,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> Config:
    """Build the config: defaults < HOME/config.toml < STARLING_<SECTION>_<FIELD> env < `overrides`.

    `overrides` maps "section.field" to a value (already typed, or text as from a `--set` flag).
    Raises ConfigError with a one-line message naming the option.
    """
    environ = os.environ if environ is None else environ
    sections = _sections()
    values: dict[str, dict[str, Any]] = {name: {} for name in sections}

    # 1. the file
    if home is not None and (home / CONFIG_FILE).exists():
        path = home / CONFIG_FILE
        try:
            data = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid TOML ({e})") from None
        except RecursionError:
            raise ConfigError(f"{path}: not valid TOML (nested too deeply)") from None
        for sec_name, sec_values in data.items():
            if sec_name not in sections:
                raise ConfigError(f"{path}: unknown section [{sec_name}] (known: {', '.join(sections)})")
            if not isinstance(sec_values, dict):
                raise ConfigError(f"{path}: {sec_name} must be a [section]")
            types = _field_types(sections[sec_name])
            for key, value in sec_values.items():
                if key not in types:
                    raise ConfigError(f"{sec_name}.{key}: unknown option in {path}")
                values[sec_name][key] = _coerce(sec_name, key, types[key], value, from_text=False)

    # 2. the environment
    for sec_name, cls in sections.items():
        types = _field_types(cls)
        for key, typ in types.items():
            env_name = f"{ENV_PREFIX}{sec_name.upper()}_{key.upper()}"
            if env_name in environ:
                values[sec_name][key] = _coerce(sec_name, key, typ, environ[env_name], from_text=True)

    # 3. flags
    for dotted, value in (overrides or {}).items():
        sec_name, _, key = dotted.partition(".")
        if sec_name not in sections or key not in _field_types(sections[sec_name]):
            raise ConfigError(f"{dotted}: unknown option")
        typ = _field_types(sections[sec_name])[key]
        values[sec_name][key] = _coerce(sec_name, key, typ, value, from_text=isinstance(value, str))

    built: dict[str, Any] = {}
    for sec_name, cls in sections.items():
        sec = cls(**values[sec_name])
        try:
            sec.validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        built[sec_name] = sec
    return Config(built)


def render_config_file(overrides: dict[str, dict[str, Any]] | None = None) -> str:
    """The text of a fresh config.toml: every option present, commented out at its default, with its help.

    Values in `overrides` (e.g. the swarm name given to `init`) are written uncommented.
    """
    overrides = overrides or {}
    lines = [
        "# Starling configuration. Precedence: command-line flags > STARLING_<SECTION>_<OPTION> environment",
        "# variables > this file > built-in defaults. Uncomment a line to change an option.",
    ]
    for sec_name, cls in _sections().items():
        lines.append("")
        lines.append(f"[{sec_name}]")
        for f in dataclasses.fields(cls):
            help_text = f.metadata.get("help", "")
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if help_text:
                lines.append(f"# {help_text}")
            if f.name in overrides.get(sec_name, {}):
                lines.append(_toml_line(f.name, overrides[sec_name][f.name]))
            else:
                lines.append("# " + _toml_line(f.name, default))
    return "\n".join(lines) + "\n"


def _toml_line(key: str, value: Any) -> str:
    """One `key = value` line (lists inline, so the whole option can be commented with one '#')."""
    if isinstance(value, list):
        return f"{key} = [" + ", ".join(json.dumps(v) for v in value) + "]"
    return tomli_w.dumps({key: value}).strip()


def resolve_home(flag: str | None, environ: dict[str, str] | None = None) -> Path:
    """HOME is --home DIR, else $STARLING_HOME, else ~/.starling."""
    environ = os.environ if environ is None else environ
    if flag:
        return Path(flag).expanduser().resolve()
    if environ.get("STARLING_HOME"):
        return Path(environ["STARLING_HOME"]).expanduser().resolve()
    return Path("~/.starling").expanduser().resolve()
