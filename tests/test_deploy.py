"""Deployment files are valid for the tools that consume them: systemd and Docker Compose.

Each test is skipped (with the reason) when its tool is missing; `make install` installs Debian's
`systemd` (systemd-analyze) and `docker-compose` packages so that they run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "deploy" / "systemd" / "starling.service"
COMPOSE = REPO / "docker" / "docker-compose.yml"
TOOL_TIMEOUT_S = 60


def unit_assignments(text: str) -> dict[str, list[str]]:
    """``Section.Key`` -> every value assigned to it, in order (systemd allows repeated keys)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


@pytest.fixture
def verifiable_unit(tmp_path: Path) -> Path:
    """A copy of the unit whose ExecStart binary exists here (verify checks that it is executable)."""
    starling = Path(sys.executable).parent / "starling"
    binary = str(starling) if os.access(starling, os.X_OK) else "/bin/true"
    lines = []
    for line in UNIT.read_text().splitlines():
        if line.startswith("ExecStart=/usr/local/bin/starling"):
            line = line.replace("/usr/local/bin/starling", binary, 1)
        lines.append(line)
    copy = tmp_path / "starling.service"
    copy.write_text("\n".join(lines) + "\n")
    return copy


def systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze not installed (Debian package: systemd)")
    return tool


def compose_command() -> list[str]:
    """docker-compose (v1, Debian's package) or the `docker compose` v2 plugin, whichever is here."""
    if tool := shutil.which("docker-compose"):
        return [tool]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True,
                                 timeout=TOOL_TIMEOUT_S).returncode == 0:
        return [docker, "compose"]
    pytest.skip("neither docker-compose nor the docker compose plugin is installed (Debian package: docker-compose)")


def run_compose(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STARLING_", "COMPOSE_"))}
    return subprocess.run([*compose_command(), "-f", str(COMPOSE), *args], capture_output=True, text=True,
                          timeout=TOOL_TIMEOUT_S, env=env, cwd=REPO)


def test_systemd_unit_passes_systemd_analyze_verify(verifiable_unit: Path) -> None:
    result = subprocess.run([systemd_analyze(), "verify", str(verifiable_unit)], capture_output=True,
                            text=True, timeout=TOOL_TIMEOUT_S, cwd=verifiable_unit.parent)
    # verify exits 0 on mere warnings (unknown keys, unparsable values): those must not appear either.
    complaints = [line for line in (result.stdout + result.stderr).splitlines() if "starling.service" in line]

    assert result.returncode == 0, result.stdout + result.stderr
    assert complaints == []


def test_systemd_unit_hardening_keeps_exposure_at_or_below_3(verifiable_unit: Path) -> None:
    tool = systemd_analyze()
    result = subprocess.run([tool, "security", "--offline=yes", "--threshold=30", str(verifiable_unit)],
                            capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, cwd=verifiable_unit.parent)
    if "--offline" in result.stderr and "unrecognized" in result.stderr:
        pytest.skip("systemd-analyze too old for `security --offline` (needs systemd >= 250)")
    overall = [line for line in result.stdout.splitlines() if "Overall exposure level" in line]

    assert result.returncode == 0, overall or result.stderr


def test_systemd_unit_is_a_notify_service_with_watchdog_and_state_directory() -> None:
    unit = unit_assignments(UNIT.read_text())

    assert unit["Service.Type"] == ["notify"]
    assert unit["Service.NotifyAccess"] == ["main"]
    assert unit["Service.ExecStart"] == ["/usr/local/bin/starling run"]
    assert unit["Service.Restart"] == ["on-failure"]
    assert unit["Service.WatchdogSec"] == ["60"]
    assert unit["Service.TimeoutStopSec"] == ["30"]
    assert unit["Service.StateDirectory"] == ["starling"]
    assert "STARLING_HOME=/var/lib/starling" in unit["Service.Environment"]
    assert unit["Service.ProtectSystem"] == ["strict"]
    assert unit["Service.NoNewPrivileges"] == ["yes"]


def test_compose_file_validates() -> None:
    result = run_compose("config", "-q")

    assert result.returncode == 0, result.stderr


def test_compose_has_bootstrap_and_trainer_sharing_the_bootstrap_address_file() -> None:
    services = run_compose("config", "--services")
    volumes = run_compose("config", "--volumes")
    rendered = run_compose("config")
    assert rendered.returncode == 0, rendered.stderr

    def flag_values(flag: str) -> set[str]:
        return {line.split(f"{flag}=", 1)[1].strip() for line in rendered.stdout.splitlines() if f"{flag}=" in line}

    # Monitoring is in profiles (not started by a plain `up`): compose v1 lists their services, v2 does not.
    assert {"bootstrap", "trainer"} <= set(services.stdout.split()) <= {"bootstrap", "trainer", "prometheus", "grafana"}
    assert {"bootstrap-home", "bootstrap-addr"} <= set(volumes.stdout.split())
    written, read = flag_values("--addr-file"), flag_values("--bootstrap-file")
    assert len(written) == 1
    assert written == read


DOCKERFILE = REPO / "docker" / "Dockerfile"
MAKEFILE = REPO / "Makefile"


def dockerfile_env() -> dict[str, str]:
    """The runtime stage's ENV assignments (`ENV A=1 \\` continuation lines joined)."""
    runtime = DOCKERFILE.read_text().rsplit("\nFROM ", 1)[1]
    joined = runtime.replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in joined.splitlines():
        if line.startswith("ENV "):
            for item in line[4:].split():
                key, _, value = item.partition("=")
                env[key] = value
    return env


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _yaml_block(lines: list[str], header: str) -> list[str]:
    """The lines nested under `header` (a line of the compose file), by indentation."""
    start = lines.index(header)
    body = []
    for line in lines[start + 1 :]:
        if line.strip() and not line.lstrip().startswith("#") and _indent(line) <= _indent(header):
            break
        body.append(line)
    return body


def _yaml_entries(block: list[str], key: str) -> list[str]:
    """The entries under `key:` in a block: list items without their "- ", or "name: value" lines."""
    header = next((line for line in block if line.strip() == f"{key}:"), None)
    if header is None:
        return []
    entries = _yaml_block(block, header)
    return [e.strip().removeprefix("- ").strip('"') for e in entries if e.strip() and not e.lstrip().startswith("#")]


def compose_service(name: str) -> tuple[list[str], list[str], dict[str, str]]:
    """(command, ports, environment) of a service, from the compose file's text (no YAML library here);
    the environment includes the shared `x-starling` defaults the services merge in."""
    lines = COMPOSE.read_text().splitlines()
    common, service = _yaml_block(lines, "x-starling: &starling"), _yaml_block(lines, f"  {name}:")
    env = dict(e.split(": ", 1) for e in _yaml_entries(common, "environment") + _yaml_entries(service, "environment"))
    return _yaml_entries(service, "command"), _yaml_entries(service, "ports"), env


def test_the_bootstrap_s_metrics_listen_where_the_published_port_reaches_them() -> None:
    """`curl localhost:9100` on the host: the container must bind the metrics on all its interfaces (its own
    127.0.0.1 is unreachable through a published port), while the host side stays on loopback."""
    from node.cli import build_parser, run_overrides
    from node.config.load import load_config

    command, ports, compose_env = compose_service("bootstrap")
    command = [c.replace("${STARLING_SWARM:-starling}", "starling") for c in command]
    environ = {**dockerfile_env(), **compose_env}
    cfg = load_config(None, environ=environ, overrides=run_overrides(build_parser().parse_args(command)))

    assert cfg.node.metrics_port == 9100
    assert cfg.node.metrics_host == "0.0.0.0"
    # As compose reads it with no STARLING_* variable set: `${VAR:-default}` is its default.
    defaults = [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", p) for p in ports]
    assert [p for p in defaults if p.endswith(":9100/tcp")] == ["127.0.0.1:9100:9100/tcp"]


@pytest.mark.parametrize(
    "tools, expected",
    [({"docker": "compose"}, "docker compose -f docker/docker-compose.yml up -d --build --scale trainer=2"),
     ({"docker": "", "docker-compose": "v1"}, "docker-compose -f docker/docker-compose.yml up -d --build --scale trainer=2"),
     ({"docker-compose": "v1"}, "docker-compose -f docker/docker-compose.yml up -d --build --scale trainer=2")],
    ids=["compose-plugin", "docker-without-plugin", "standalone-only"],
)
def test_make_swarm_up_uses_whichever_compose_is_installed(tmp_path: Path, tools: dict[str, str], expected: str) -> None:
    make = shutil.which("make")
    if make is None:
        pytest.skip("make not installed")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, plugin in tools.items():
        # A stand-in that records its arguments; `docker compose version` succeeds only with the plugin.
        script = bin_dir / tool
        check = f'[ "$1 $2" = "compose version" ] && {{ [ -n "{plugin}" ] && exit 0 || exit 1; }}\n'
        script.write_text(f"#!/bin/sh\n{check if tool == 'docker' else ''}echo \"{tool} $*\" >> {tmp_path}/calls\n")
        script.chmod(0o755)
    r = subprocess.run([make, "-s", "-f", str(MAKEFILE), "swarm-up", "TRAINERS=2"], cwd=REPO, capture_output=True,
                       text=True, timeout=TOOL_TIMEOUT_S, env={"PATH": str(bin_dir), "HOME": str(tmp_path)})

    assert r.returncode == 0, r.stderr
    assert (tmp_path / "calls").read_text().splitlines() == [expected]


def test_make_swarm_up_without_any_compose_says_so(tmp_path: Path) -> None:
    make = shutil.which("make")
    if make is None:
        pytest.skip("make not installed")
    (tmp_path / "bin").mkdir()
    r = subprocess.run([make, "-s", "-f", str(MAKEFILE), "swarm-up"], cwd=REPO, capture_output=True, text=True,
                       timeout=TOOL_TIMEOUT_S, env={"PATH": str(tmp_path / "bin"), "HOME": str(tmp_path)})

    assert r.returncode != 0
    assert "neither 'docker compose' nor 'docker-compose' is installed" in r.stderr


DEPLOY = REPO / "deploy"


def test_the_dashboard_reads_the_provisioned_prometheus_and_every_recorded_series_is_shown() -> None:
    """The Grafana dashboard's panels query the data source Grafana is provisioned with, and every recording
    rule of deploy/prometheus feeds a panel; `make test-compose` runs each panel's query against the compose
    swarm's Prometheus (docker/compose_test.py)."""
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "starling.json").read_text())
    provisioned = (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    exprs = []
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert f"uid: {target['datasource']['uid']}" in provisioned, panel["title"]
            exprs.append(target["expr"])
    records = re.findall(r"record: (\S+)", (DEPLOY / "prometheus" / "rules.yml").read_text())
    assert records and all(any(r in e for e in exprs) for r in records), records
    config = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    assert "/etc/starling/prometheus/rules.yml" in config and "names: [bootstrap, trainer]" in config
