"""Configuration: dataclass sections, loaded from defaults < config.toml < STARLING_* env < flags.

Each section is a dataclass whose fields carry a one-line `help` (rendered as comments by `starling init`,
so the file documents every option). Values are coerced to the field's type with an error that names the
option (`node.target_peers: expected an integer, got 'x'`), because an operator reading a systemd journal
needs the option's name, not a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import tomli_w

from node.config.base import opt
from node.config.home import Home
from p2p.fsutil import atomic_write_bytes

#: The sections of HOME/run-config.toml (`Home.run_config`): the [train] and [task] options a trainer last
#: ran with (written by the daemon at start), which fix the model and the task. `export` reads them, so that
#: it rebuilds the model that HOME's checkpoints hold without repeating `run`'s `--set`.
RUN_SECTIONS = ("train", "task")
ENV_PREFIX = "STARLING_"
#: STARLING_* variables that are not options (unknown_environment warns about any other).
NON_OPTION_VARIABLES = frozenset({"STARLING_HOME"})


class ConfigError(Exception):
    """A bad option value or config file; the message names the option (one line, no traceback)."""


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
    discovery_interval: float = opt(10.0, "seconds between DHT lookups for swarm members once settled "
                                          "(doubling, up to 8x, while none finds a new member)")
    heartbeat_s: float = opt(2.0, "seconds between this node's signed heartbeats to the swarm state")
    suspect_after: float = opt(15.0, "gossip mode: a member silent this long is shown as suspect "
                                     "(swim mode: swim_ack_timeout_s and swim_suspicion_mult decide)")
    gone_after: float = opt(60.0, "gossip mode: a member silent this long is shown as gone (its history is kept; "
                                  "swim mode: a suspect that does not refute in time is gone)")
    membership: str = opt("swim", "how members' liveness is judged: swim (SWIM probes of connected members; records "
                                  "re-signed only on change; per-node cost flat in N) | gossip (signed heartbeats every "
                                  "heartbeat_s, heard by every node; every node of a swarm must use the same)")
    swim_period_s: float = opt(1.0, "swim mode: seconds between two probes of a member by this node")
    swim_ack_timeout_s: float = opt(0.5, "swim mode: a direct probe unanswered this long asks helpers to probe too; "
                                         "unanswered 4x this long, the member is suspect")
    swim_suspicion_mult: int = opt(4, "swim mode: a suspect unrefuted for this x max(1, log10 members) x "
                                      "swim_period_s (up to 6x that while one member alone accuses) is gone")
    founder: str = opt("", "PeerID of the swarm's founder: only its run manifest is adopted ('' = trust the first seen)")
    manifest_hash: str = opt("", "the only run manifest hash this node adopts ('' = any allowed by founder)")
    max_members_per_subnet: int = opt(256, "most swarm members one IPv4 /24 or IPv6 /48 may place in the member table")
    max_conns_per_subnet: int = opt(16, "most connections from one IPv4 /24 or IPv6 /48 (loopback exempt)")
    log_level: str = opt("info", "debug | info | warning | error")
    metrics_port: int = opt(0, "Prometheus metrics port on 127.0.0.1 (0 = off)")
    metrics_host: str = opt("127.0.0.1", "address the metrics endpoint binds")

    def validate(self) -> None:
        if not self.swarm or len(self.swarm) > 64 or not all(c.isalnum() or c in "-_." for c in self.swarm):
            raise ValueError("node.swarm: 1-64 characters of letters, digits, '-', '_' or '.'")
        if not self.listen:
            raise ValueError("node.listen: at least one listen address is needed")
        from p2p.addrs import AddrError, is_peer_id, parse_bootstrap, parse_listen

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
            if not is_peer_id(peer):
                raise ValueError(f"node.allow_peers: {peer[:80]!r} is not a PeerID")
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
        if self.membership not in ("gossip", "swim"):
            raise ValueError(f"node.membership: gossip or swim, got {self.membership[:40]!r}")
        if not 0.1 <= self.swim_period_s <= 60:
            raise ValueError("node.swim_period_s: must be between 0.1 and 60 seconds")
        if not 0.05 <= self.swim_ack_timeout_s < self.swim_period_s:
            raise ValueError("node.swim_ack_timeout_s: must be at least 0.05 seconds and less than swim_period_s")
        if not 1 <= self.swim_suspicion_mult <= 32:
            raise ValueError("node.swim_suspicion_mult: must be between 1 and 32")
        if self.founder and not is_peer_id(self.founder):
            raise ValueError(
                f"node.founder: {self.founder[:80]!r} is not a PeerID (the 12D3KooW... line `starling init` "
                "prints on the founder)"
            )
        if self.manifest_hash and not re.fullmatch(r"[0-9a-f]{64}", self.manifest_hash):
            raise ValueError("node.manifest_hash: expected 64 lowercase hex digits (the swarm's manifest_hash)")
        if not 1 <= self.max_members_per_subnet <= 1024:
            raise ValueError("node.max_members_per_subnet: must be between 1 and 1024")
        if not 1 <= self.max_conns_per_subnet <= 32:
            raise ValueError("node.max_conns_per_subnet: must be between 1 and 32")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError("node.log_level: one of debug, info, warning, error")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError("node.metrics_port: must be a port number (0 = off)")


TASK_OPTION_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
MAX_TASK_OPTION_CHARS = 64 << 10  # of one option's value as JSON: settings, not data


@dataclass
class TaskOptions:
    """The free-form `[task]` section: settings of the training task (`train.task`), handed to its factory
    as they are (`TaskContext.options`), e.g. a data directory or a hidden size.

    Why free-form: what a task needs is the task author's business, not Starling's, so no option list can
    be fixed here. Values are any TOML value (string, number, boolean, list, table); from the environment
    (`STARLING_TASK_<NAME>`) or a flag (`--set task.<name>=...`) the text is read as a TOML value when it
    is one (`64`, `true`, `[1, 2]`, `{ n_embd = 64 }`) and as a plain string otherwise (`/srv/text`).
    Names are lower-case so that each maps to exactly one environment variable. The task checks the
    values; the options that fix the model are part of the run manifest (node/worker/task.py, `model_hash`).
    """

    free_form = True  # load_config, render_config_file and unknown_environment take any option name
    values: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        for name, value in self.values.items():
            if not TASK_OPTION_NAME.match(name):
                raise ValueError(f"task.{name}: option names are lower-case letters, digits and '_'")
            problem = _plain_value_problem(value)
            if problem:
                raise ValueError(f"task.{name}: {problem}")
            if len(json.dumps(value)) > MAX_TASK_OPTION_CHARS:
                raise ValueError(f"task.{name}: value longer than {MAX_TASK_OPTION_CHARS} characters")


def _plain_value_problem(value: Any, depth: int = 0) -> str:
    """Why `value` cannot travel to the worker (msgpack) and into the manifest hash (JSON), or ''."""
    if depth > 8:
        return "nested too deeply"
    if isinstance(value, bool | int | str) or (isinstance(value, float) and value == value):
        return ""
    if isinstance(value, float):
        return "NaN is not a usable value"
    if isinstance(value, list):
        return next((p for v in value if (p := _plain_value_problem(v, depth + 1))), "")
    if isinstance(value, dict):
        return next((p for v in value.values() if (p := _plain_value_problem(v, depth + 1))), "")
    return f"{type(value).__name__} values (dates, times) are not supported; quote it as a string"


def parse_task_value(text: str) -> Any:
    """A `[task]` value given as text (environment, `--set`): a TOML value if it reads as one, else the text."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        return text
    return value if not _plain_value_problem(value) else text


def _sections() -> dict[str, type]:
    """The config file's sections, in file order. Later issues add sections here."""
    sections: dict[str, type] = {"node": NodeConfig}
    try:
        from node.config.train import TrainConfig
    except ImportError:  # the trainer is optional at import time for network-only tooling
        pass
    else:
        sections["train"] = TrainConfig
    try:
        from node.config.sync import SyncConfig
    except ImportError:
        pass
    else:
        sections["sync"] = SyncConfig
    sections["task"] = TaskOptions
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
        return {name: dict(sec.values) if isinstance(sec, TaskOptions) else dataclasses.asdict(sec)
                for name, sec in self.sections.items()}


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
    run_config: bool = False,
) -> Config:
    """Build the config: defaults < HOME/config.toml < STARLING_<SECTION>_<FIELD> env < `overrides`.

    `overrides` maps "section.field" to a value (already typed, or text as from a `--set` flag).
    `run_config` (export): the [train] and [task] options the trainer last ran with (HOME/run-config.toml,
    `write_run_config`) come after the environment and before `overrides`; the [task] section is taken
    whole (an option the run did not have is not the run's).
    Raises ConfigError with a one-line message naming the option.
    """
    environ = os.environ if environ is None else environ
    sections = _sections()
    values: dict[str, dict[str, Any]] = {name: {} for name in sections}
    # "section.option" -> where its value came from, when not a flag: an operator reading
    # "node.max_peers: must be ..." must know whether to fix config.toml or a unit's Environment= line.
    sources: dict[str, str] = {}

    # 1. the file
    if home is not None and Home(home).config.exists():
        path = Home(home).config
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
            if getattr(sections[sec_name], "free_form", False):
                for key, value in sec_values.items():
                    sources[f"{sec_name}.{key}"] = str(path)
                    values[sec_name][key] = value
                continue
            types = _field_types(sections[sec_name])
            for key, value in sec_values.items():
                if key not in types:
                    raise ConfigError(f"{sec_name}.{key}: unknown option in {path}")
                sources[f"{sec_name}.{key}"] = str(path)
                try:
                    values[sec_name][key] = _coerce(sec_name, key, types[key], value, from_text=False)
                except ConfigError as e:
                    raise ConfigError(f"{path}: {e}") from None

    # 2. the environment
    for sec_name, cls in sections.items():
        if getattr(cls, "free_form", False):
            prefix = f"{ENV_PREFIX}{sec_name.upper()}_"
            for env_name in sorted(k for k in environ if k.startswith(prefix) and len(k) > len(prefix)):
                key = env_name[len(prefix) :].lower()
                sources[f"{sec_name}.{key}"] = _env_source(env_name, environ[env_name])
                values[sec_name][key] = parse_task_value(environ[env_name])
            continue
        types = _field_types(cls)
        for key, typ in types.items():
            env_name = f"{ENV_PREFIX}{sec_name.upper()}_{key.upper()}"
            if env_name in environ:
                source = _env_source(env_name, environ[env_name])
                sources[f"{sec_name}.{key}"] = source
                try:
                    values[sec_name][key] = _coerce(sec_name, key, typ, environ[env_name], from_text=True)
                except ConfigError as e:
                    raise ConfigError(f"{source}: {e}") from None

    # 3. what a trainer last ran with (export only): it replaces those sections, flags still win
    if run_config and home is not None:
        for sec_name, section in read_run_config(home).items():
            if getattr(sections[sec_name], "free_form", False):
                values[sec_name] = dict(section)
                continue
            types = _field_types(sections[sec_name])
            for key, value in section.items():
                if key in types:  # an option of another version is left out
                    try:
                        values[sec_name][key] = _coerce(sec_name, key, types[key], value, from_text=False)
                    except ConfigError as e:
                        raise ConfigError(f"{Home(home).run_config}: {e}") from None
                    sources[f"{sec_name}.{key}"] = str(Home(home).run_config)

    # 4. flags
    for dotted, value in (overrides or {}).items():
        sec_name, _, key = dotted.partition(".")
        if sec_name in sections and getattr(sections[sec_name], "free_form", False) and key:
            values[sec_name][key] = parse_task_value(value) if isinstance(value, str) else value
            sources.pop(dotted, None)
            continue
        if sec_name not in sections or key not in _field_types(sections[sec_name]):
            raise ConfigError(f"{dotted}: unknown option")
        typ = _field_types(sections[sec_name])[key]
        values[sec_name][key] = _coerce(sec_name, key, typ, value, from_text=isinstance(value, str))
        sources.pop(dotted, None)  # the operator typed it: the option's name is enough

    built: dict[str, Any] = {}
    for sec_name, cls in sections.items():
        sec = cls(values[sec_name]) if getattr(cls, "free_form", False) else cls(**values[sec_name])
        try:
            sec.validate()
        except ValueError as e:
            raise ConfigError(_with_sources(str(e), sources)) from None
        built[sec_name] = sec
    return Config(built)


def write_run_config(home: Path, cfg: Config) -> None:
    """Record the [train] and [task] options this trainer runs with in HOME/run-config.toml (private,
    written atomically). Why: `export` rebuilds the model from the config, and a node started with
    `--set train.d_model=...` (or a task's options) had to be given the same flags again, else it said
    there was no checkpoint of the configured model, or that the task was not a Hugging Face model."""
    data = {name: cfg.to_dict()[name] for name in RUN_SECTIONS if name in cfg.sections}
    text = ("# The [train] and [task] options this node's trainer last ran with, written at each start.\n"
            "# `starling export` reads them; edit config.toml, not this file.\n" + tomli_w.dumps(data))
    atomic_write_bytes(Home(home).run_config, text.encode(), mode=0o600)


def read_run_config(home: Path) -> dict[str, dict[str, Any]]:
    """HOME/run-config.toml's sections ({} where there is none); a file that cannot be read is a
    ConfigError naming it."""
    path = Home(home).run_config
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it ({e}); delete it or start the trainer once") from None
    return {name: data[name] for name in RUN_SECTIONS if isinstance(data.get(name), dict)}


def _env_source(name: str, value: str) -> str:
    """`NAME=value (environment)`, the value quoted only when it would not read as one word."""
    shown = value if value and len(value) <= 80 and value.isprintable() and " " not in value else repr(value[:80])
    return f"{name}={shown} (environment)"


def _with_sources(message: str, sources: dict[str, str]) -> str:
    """A validation message prefixed by where the options it names got their values (file or environment)."""
    named = []
    for m in re.finditer(r"\b[a-z_]+\.[a-z_]+\b", message):
        where = sources.get(m.group(0))
        if where is not None and where not in named:
            named.append(where)
    return f"{', '.join(named)}: {message}" if named else message


def unknown_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning per STARLING_* variable that is neither an option nor STARLING_HOME, naming the closest
    known variable. Warned about, not refused: wrappers may export their own STARLING_* names (compose's
    STARLING_SWARM), yet a misspelt option must not be ignored silently."""
    environ = os.environ if environ is None else environ
    sections = _sections()
    known = {f"{ENV_PREFIX}{sec.upper()}_{key.upper()}" for sec, cls in sections.items() for key in _field_types(cls)
             if not getattr(cls, "free_form", False)}
    known |= NON_OPTION_VARIABLES
    # Any STARLING_TASK_<NAME> is a [task] option: the task, not Starling, knows which names it reads.
    free = tuple(f"{ENV_PREFIX}{sec.upper()}_" for sec, cls in sections.items() if getattr(cls, "free_form", False))
    warnings = []
    suffixes = sorted(k[len(ENV_PREFIX) :] for k in known)  # the shared prefix would make everything "close"
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX) and name not in known and not name.startswith(free):
            close = difflib.get_close_matches(name[len(ENV_PREFIX) :], suffixes, n=1, cutoff=0.6)
            hint = f"; did you mean {ENV_PREFIX}{close[0]}?" if close else ""
            warnings.append(f"environment variable {name} is not a Starling option and is ignored{hint}")
    return warnings


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
        if getattr(cls, "free_form", False):
            lines.append("# Settings of the training task (train.task), handed to it as they are; which names it reads is")
            lines.append("# the task's own (see README: Bring your own model). The built-in stdlib-lm reads none. E.g.:")
            lines.append('# data = "/srv/text"')
            for key, value in overrides.get(sec_name, {}).items():
                lines.append(_toml_line(key, value))
            continue
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
