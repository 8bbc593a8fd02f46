#!/usr/bin/env python3
"""`make test-compose`: the compose swarm of docker/docker-compose.yml, brought up for real and checked.

1. Docker: uses a running engine; else, as root, starts `dockerd` (installing Debian's docker.io first if it
   is missing) with `--iptables=false --ip-forward=false`, so that the host's firewall and forwarding stay as
   they are (containers then reach each other on their bridge and nothing else), and stops it at the end.
2. Builds the image offline (`make image OFFLINE=1`: a debootstrapped base, the local wheelhouse), installing
   Debian's debootstrap first where the base image is still to be made and it is missing (issue #56).
3. `up` bootstrap + 3 trainers (a tiny model through STARLING_* variables in an override file; ports
   published on the host's loopback only, on free ports), then checks, through `starling status --json` run
   inside the containers (`exec`), that every trainer averaged with >= 2 distinct partners, that every
   container turns healthy (the HEALTHCHECK is `starling status`, whose exit code says it), and that the
   metrics endpoint answers: in each container, from the bootstrap to each trainer over the compose
   network, and from the host through the bootstrap's loopback-published port.
4. Monitoring (profile "monitoring", issue #56): the compose file's Prometheus, from Debian's `prometheus` package in
   an offline image (docker/base-image.sh with BASE_PACKAGES=prometheus), published on the host's loopback.
   Through its HTTP API: every node is a target that is up, every recording rule of deploy/prometheus/rules.yml
   returns a series, and so does every query of every panel of the Grafana dashboard
   (deploy/grafana/dashboards/starling.json).
5. `down`: every node must exit 0 on SIGTERM after a graceful drain, each trainer after writing its final
   checkpoint (its log line, and the file in its volume), with no container restarted during the run.
6. Removes what it made: containers, network, volumes, the image (unless --keep-image), the build stage's
   intermediate image, the base image and the wheelhouse if it made them; stops dockerd if it started it.

Stdlib only: it runs with the system python3. Exit 0 when every check passed; prints the timings and the
image size. Not part of `make test` (minutes on 2 cores, needs root or a Docker engine).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "deploy" / "prometheus" / "rules.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "starling.json"
COMPOSE_FILE = REPO / "docker" / "docker-compose.yml"
WHEELHOUSE = REPO / "docker" / "wheelhouse"
PROJECT = "starling-compose-test"
TRAINERS = 3
MIN_PARTNERS = 2

# A model small enough for 3 trainers and a bootstrap on 2 shared cores (starling_testing.daemon.TINY_TRAIN
# as environment variables); the compose file's own defaults are the real ones.
TINY_ENV = {
    "STARLING_TRAIN_D_MODEL": "32", "STARLING_TRAIN_N_LAYERS": "1", "STARLING_TRAIN_N_HEADS": "2",
    "STARLING_TRAIN_SEQ_LEN": "32", "STARLING_TRAIN_BATCH_SIZE": "4", "STARLING_TRAIN_INNER_STEPS": "5",
    "STARLING_TRAIN_DATA_BYTES": "300000", "STARLING_TRAIN_WARMUP": "10", "STARLING_TRAIN_LR": "0.003",
    "STARLING_TRAIN_MAX_LAG": "5", "STARLING_TRAIN_CHECKPOINT_EVERY": "2", "STARLING_TRAIN_EVAL_BATCHES": "1",
    "STARLING_SYNC_PAIR_WINDOW_S": "2", "STARLING_SYNC_BACKOFF_S": "1", "STARLING_SYNC_JOIN_WAIT_S": "2",
    # Trainers start seconds apart on a loaded machine and step solo meanwhile: let them pair anyway.
    "STARLING_SYNC_MAX_STEP_GAP": "50",
}  # fmt: skip

CHECKPOINT_LINE = re.compile(r"checkpoint (\S+) written at step (\d+)")


class Failed(Exception):
    pass


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list[str], *, check: bool = True, env: dict[str, str] | None = None, timeout: float = 600,
        quiet: bool = False) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    if check and p.returncode != 0:
        raise Failed(f"{' '.join(cmd)} exited {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}")
    if not quiet and p.returncode != 0:
        log(f"{' '.join(cmd[:4])}... exited {p.returncode}: {(p.stdout + p.stderr).strip()[-300:]}")
    return p


def is_root() -> bool:
    return os.geteuid() == 0


def apt_install(*pkgs: str) -> None:
    if not is_root() or shutil.which("apt-get") is None:
        raise Failed(f"{' '.join(pkgs)} missing: install it (Debian: apt-get install {' '.join(pkgs)}) or run as root")
    log(f"installing Debian packages: {' '.join(pkgs)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], env=env)
    run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *pkgs], env=env)


class Engine:
    """A Docker engine for the test: the running one, or a dockerd this test starts (and stops)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.had_docker0 = Path("/sys/class/net/docker0").exists()
        self.log_path = Path(tempfile.gettempdir()) / "starling-compose-test-dockerd.log"

    def up(self) -> bool:
        return shutil.which("docker") is not None and run(["docker", "info"], check=False, quiet=True).returncode == 0

    def ensure(self) -> None:
        if self.up():
            log("using the running Docker engine")
            return
        if not is_root():
            raise Failed("no Docker engine answers and this is not root: start dockerd, or run as root")
        if shutil.which("dockerd") is None:
            apt_install("docker.io")
        if self.up():  # the package's service may have started it
            log("using the Docker engine docker.io started")
            return
        log(f"starting dockerd (log: {self.log_path})")
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(["dockerd", "--iptables=false", "--ip-forward=false"],
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while not self.up():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise Failed(f"dockerd did not start: {self.log_path.read_text()[-2000:]}")
            time.sleep(1)

    def stop(self) -> None:
        if self.proc is None:
            return
        log("stopping the dockerd this test started")
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if not self.had_docker0 and Path("/sys/class/net/docker0").exists() and shutil.which("ip"):
            run(["ip", "link", "delete", "docker0"], check=False)


def ensure_build_tools(base_missing: bool) -> None:
    """docker/base-image.sh makes the offline base image with debootstrap: install it where the base image is
    still to be made and it is missing (a fresh machine had only what `make install` gets)."""
    if base_missing and shutil.which("debootstrap") is None:
        apt_install("debootstrap")


def compose_command() -> list[str]:
    if run(["docker", "compose", "version"], check=False, quiet=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose") is None:
        apt_install("docker-compose")
    return ["docker-compose"]


class Swarm:
    def __init__(self, compose: list[str], image: str, prometheus_image: str, workdir: Path) -> None:
        override = workdir / "compose.test.yml"
        env_lines = "".join(f"      {k}: \"{v}\"\n" for k, v in TINY_ENV.items())
        override.write_text(f"services:\n  trainer:\n    environment:\n{env_lines}")
        self.cmd = [*compose, "-p", PROJECT, "-f", str(COMPOSE_FILE), "-f", str(override), "--profile", "monitoring"]
        self.env = {**os.environ, "STARLING_IMAGE": image, "STARLING_SWARM": PROJECT,
                    "STARLING_P2P_PUBLISH": "127.0.0.1:", "STARLING_METRICS_PUBLISH": "127.0.0.1:",
                    "STARLING_PROMETHEUS_IMAGE": prometheus_image, "STARLING_PROMETHEUS_PUBLISH": "127.0.0.1:"}

    def __call__(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return run([*self.cmd, *args], check=check, env=self.env, timeout=timeout)

    def containers(self) -> dict[str, str]:
        """`service_N` -> id for the project's containers, stopped ones included. From compose's labels, since
        the container names differ: `<project>_trainer_1` (docker-compose 1.x), `<project>-trainer-1` (v2)."""
        fmt = '{{.ID}} {{.Label "com.docker.compose.service"}} {{.Label "com.docker.compose.container-number"}}'
        p = run(["docker", "ps", "-a", "--filter", f"label=com.docker.compose.project={PROJECT}", "--format", fmt])
        rows = [line.split() for line in p.stdout.splitlines() if line.strip()]
        return {f"{service}_{number}": cid for cid, service, number in rows}

    def nodes(self) -> dict[str, str]:
        """The Starling nodes among `containers` (not the monitoring services)."""
        return {name: cid for name, cid in self.containers().items() if name.startswith(("bootstrap_", "trainer_"))}

    def exec(self, service: str, index: int, *cmd: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        return run([*self.cmd, "exec", "-T", "--index", str(index), service, *cmd], check=check, env=self.env,
                   timeout=60, quiet=True)

    def status(self, service: str, index: int) -> tuple[int, dict]:
        p = self.exec(service, index, "starling", "status", "--json")
        try:
            return p.returncode, json.loads(p.stdout)
        except ValueError:
            return p.returncode, {"error": (p.stdout + p.stderr).strip()[-300:]}


FETCH = ("import sys, urllib.request; t = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode(); "
         "print(sum(1 for l in t.splitlines() if l.startswith('starling_')))")


def metrics_lines(swarm: Swarm, service: str, index: int, url: str) -> int:
    p = swarm.exec(service, index, "python", "-c", FETCH, url)
    if p.returncode != 0:
        raise Failed(f"{service}_{index}: GET {url} failed: {(p.stdout + p.stderr).strip()[-500:]}")
    return int(p.stdout.strip().splitlines()[-1])


def inspect(cid: str) -> dict:
    return json.loads(run(["docker", "inspect", cid]).stdout)[0]


def check_swarm(swarm: Swarm, timeout: float) -> dict:
    """Wait until every trainer averaged with MIN_PARTNERS partners and every container is healthy."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        partners, states = [], []
        for i in range(1, TRAINERS + 1):
            rc, st = swarm.status("trainer", i)
            if rc == 3:
                raise Failed(f"trainer_{i}: `starling status` exits 3, training failed: {st.get('training')}")
            partners.append(((st.get("sync") or {}).get("distinct_partners")) or 0)
            states.append(((st.get("training") or {}).get("state")) or st.get("error", "?"))
        health = {name: (inspect(cid)["State"].get("Health") or {}).get("Status")
                  for name, cid in swarm.nodes().items()}
        line = f"partners {partners}, training {states}, health {sorted(health.values())}"
        if line != last:
            log(line)
            last = line
        if min(partners) >= MIN_PARTNERS and len(health) == TRAINERS + 1 and set(health.values()) == {"healthy"}:
            return {"partners": partners, "health": health}
        if time.monotonic() > deadline:
            raise Failed(f"after {timeout:.0f}s: {line}")
        time.sleep(5)


def check_metrics(swarm: Swarm) -> dict:
    found: dict[str, int] = {}
    # In each container, on its own loopback (the endpoint binds the container's interfaces: 0.0.0.0).
    found["bootstrap_1 (its loopback)"] = metrics_lines(swarm, "bootstrap", 1, "http://127.0.0.1:9100/metrics")
    # From the bootstrap to each trainer over the compose network.
    for i in range(1, TRAINERS + 1):
        found[f"trainer_{i} (its loopback)"] = metrics_lines(swarm, "trainer", i, "http://127.0.0.1:9100/metrics")
    for name, cid in swarm.containers().items():
        if not name.startswith("trainer_"):
            continue
        nets = inspect(cid)["NetworkSettings"]["Networks"]
        ip = next(iter(nets.values()))["IPAddress"]
        found[f"{name} (from the bootstrap, {ip})"] = metrics_lines(swarm, "bootstrap", 1, f"http://{ip}:9100/metrics")
    # From the host, through the port the compose file publishes on the host's loopback.
    hostport = swarm("port", "bootstrap", "9100").stdout.strip()
    if not hostport.startswith("127.0.0.1:"):
        raise Failed(f"the bootstrap's metrics are published on {hostport!r}, not on the host's loopback")
    with urllib.request.urlopen(f"http://{hostport}/metrics", timeout=10) as r:
        found[f"host {hostport}"] = sum(1 for ln in r.read().decode().splitlines() if ln.startswith("starling_"))
    for where, n in found.items():
        if n == 0:
            raise Failed(f"metrics from {where}: no starling_ series")
    log("metrics answer: " + ", ".join(f"{k}: {v} lines" for k, v in found.items()))
    return found


def prometheus_query(base: str, expr: str) -> list[dict]:
    """The result vector of an instant query through Prometheus's HTTP API."""
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        answer = json.loads(r.read().decode())
    if answer.get("status") != "success":
        raise Failed(f"Prometheus refused {expr!r}: {answer}")
    return answer["data"]["result"]


def check_monitoring(swarm: Swarm, timeout: float = 240) -> dict:
    """Prometheus scrapes every node; every recording rule and every dashboard panel's query returns data."""
    hostport = swarm("port", "prometheus", "9090").stdout.strip()
    if not hostport.startswith("127.0.0.1:"):
        raise Failed(f"Prometheus is published on {hostport!r}, not on the host's loopback")
    base = f"http://{hostport}"
    records = re.findall(r"record: (\S+)", RULES.read_text())
    panels = {f"{p['title']} [{t['refId']}]": t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"]
              for t in p["targets"]}
    queries = {**{f"rule {r}": r for r in records}, **panels}
    t0 = time.monotonic()
    empty: list[str] = []
    while True:
        try:
            up = prometheus_query(base, 'up{job="starling"}')
            empty = [name for name, expr in queries.items() if not prometheus_query(base, expr)]
        except OSError as e:  # not listening yet
            up, empty = [], [f"the API: {e}"]
        targets_up = sum(1 for s in up if s["value"][1] == "1")
        if targets_up == TRAINERS + 1 and not empty:
            break
        if time.monotonic() - t0 > timeout:
            raise Failed(f"Prometheus after {timeout:.0f}s: {targets_up} of {TRAINERS + 1} nodes up; "
                         f"queries with no data: {empty}")
        time.sleep(5)
    log(f"Prometheus ({base}): {targets_up} nodes up; {len(records)} recording rules and {len(panels)} dashboard "
        f"queries return data after {time.monotonic() - t0:.0f}s")
    return {"prometheus_targets": targets_up, "prometheus_queries": len(queries)}


KILL_DAEMON = ("import os, signal; os.kill(next(int(p) for p in os.listdir('/proc') if p.isdigit() and p != '1' "
               "and open(f'/proc/{p}/cmdline', 'rb').read().startswith(b'/opt/starling/bin/python\\0/opt/starling/bin/starling\\0run')), "
               "signal.SIGKILL)")


def check_restart(swarm: Swarm, timeout: float = 180) -> dict:
    """The restart policy: trainer 1's daemon killed (SIGKILL: a crash, no drain) comes back in the same
    container, with the same identity, resumed from its checkpoint, and healthy again."""
    name, cid = "trainer_1", swarm.containers()["trainer_1"]
    _, before = swarm.status("trainer", 1)
    p = swarm.exec("trainer", 1, "python", "-c", KILL_DAEMON)
    if p.returncode not in (0, 137):  # the exec may die with the container
        raise Failed(f"{name}: could not kill its daemon: {(p.stdout + p.stderr).strip()[-300:]}")
    t0 = time.monotonic()
    while True:
        state = inspect(cid)
        rc, st = swarm.status("trainer", 1) if state["State"]["Running"] else (1, {})
        health = (state["State"].get("Health") or {}).get("Status")
        if state["RestartCount"] >= 1 and rc == 0 and health == "healthy" and \
                (st.get("training") or {}).get("state") == "training":
            break
        if time.monotonic() - t0 > timeout:
            raise Failed(f"{name}: not back {timeout:.0f}s after its daemon was killed: restarts "
                         f"{state['RestartCount']}, status exit {rc}, health {health}, {st.get('training')}")
        time.sleep(3)
    back_s = time.monotonic() - t0
    p = run(["docker", "logs", cid])
    logs = p.stdout + p.stderr
    if st.get("peer_id") != before.get("peer_id"):
        raise Failed(f"{name}: came back as {st.get('peer_id')}, was {before.get('peer_id')}")
    if "resumed from" not in logs:
        raise Failed(f"{name}: came back without resuming from its checkpoint")
    log(f"{name}: daemon killed, restarted by the restart policy, healthy again after {back_s:.0f}s, same "
        f"identity, resumed from its checkpoint")
    return {"restart_s": back_s, "restarted": name}


def check_down(swarm: Swarm, image: str, workdir: Path, restarted: str) -> dict:
    """`down`; every node exits 0 after draining, every trainer with a final checkpoint on its volume."""
    containers = swarm.nodes()
    restarts = {name: inspect(cid)["RestartCount"] for name, cid in swarm.containers().items()}
    if restarts != {name: int(name == restarted) for name in swarm.containers()}:
        raise Failed(f"containers restarted during the run: {restarts}")
    homes = {}
    for name, cid in containers.items():
        mounts = inspect(cid)["Mounts"]
        homes[name] = next(m["Name"] for m in mounts if m["Destination"] == "/var/lib/starling")
    waits = {name: subprocess.Popen(["docker", "wait", cid], stdout=subprocess.PIPE, text=True)
             for name, cid in containers.items()}
    logs = {}
    for name, cid in containers.items():
        out = open(workdir / f"{name}.log", "w")
        logs[name] = (subprocess.Popen(["docker", "logs", "-f", "-t", "--since", "0", cid], stdout=out,
                                       stderr=subprocess.STDOUT), out)
    t0 = time.monotonic()
    swarm("down", timeout=180)  # no -v yet: the checkpoints are checked on the volumes below
    down_s = time.monotonic() - t0
    codes = {name: int(w.communicate(timeout=60)[0].strip() or -1) for name, w in waits.items()}
    for p, out in logs.values():
        p.wait(30)
        out.close()
    problems = []
    checkpoints = {}
    stops: dict[str, float] = {}
    for name in containers:
        text = (workdir / f"{name}.log").read_text(errors="replace")
        if codes[name] != 0:
            problems.append(f"{name} exited {codes[name]}")
        if "received SIGTERM" not in text:
            problems.append(f"{name}: no 'received SIGTERM' in its log")
        if not re.search(r"\bstopped\s*$", text, re.M):
            problems.append(f"{name}: no 'stopped' line in its log")
        drain = [ln for ln in text.splitlines() if "received SIGTERM" in ln or re.search(r"\bstopped\s*$", ln)]
        if len(drain) >= 2:  # docker's own timestamps: SIGTERM received -> stopped
            t = [time.mktime(time.strptime(ln.split(".")[0], "%Y-%m-%dT%H:%M:%S")) + float("0." + ln.split(".")[1][:6])
                 for ln in (drain[0], drain[-1])]
            stops[name] = t[1] - t[0]
        if "took longer than" in text:
            problems.append(f"{name}: the graceful stop overran its budget")
        if name.startswith("trainer_"):
            tail = text[text.rfind("received SIGTERM"):] if "received SIGTERM" in text else ""
            m = list(CHECKPOINT_LINE.finditer(tail))
            if not m:
                problems.append(f"{name}: no final checkpoint after SIGTERM in its log")
                continue
            path, step = m[-1].group(1), int(m[-1].group(2))
            rel = os.path.relpath(path, "/var/lib/starling")
            ls = run(["docker", "run", "--rm", "--network", "none", "-v", f"{homes[name]}:/home:ro",
                      "--entrypoint", "ls", image, "-l", f"/home/{rel}"], check=False)
            if ls.returncode != 0:
                problems.append(f"{name}: final checkpoint {path} not on its volume: {ls.stderr.strip()}")
            checkpoints[name] = f"{path} (step {step})"
    for name in containers:
        log(f"{name}: exit {codes[name]}" + (f", drained in {stops[name]:.1f}s" if name in stops else "")
            + (f", final checkpoint {checkpoints[name]}" if name in checkpoints else ""))
    if problems:
        for name in containers:
            print(f"--- {name} (last lines)\n" + "".join((workdir / f"{name}.log").read_text().splitlines(True)[-15:]))
        raise Failed("; ".join(problems))
    return {"down_s": down_s, "drain_s": stops, "exit_codes": codes, "checkpoints": checkpoints, "volumes": sorted(homes.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--image", default="starling:compose-test", help="tag of the image built and tested")
    ap.add_argument("--keep-image", action="store_true", help="keep the image (and base image, wheelhouse)")
    ap.add_argument("--no-build", action="store_true", help="use --image as it is")
    ap.add_argument("--timeout", type=float, default=900, help="seconds for the swarm to pass its checks")
    args = ap.parse_args()

    t_start = time.monotonic()
    engine = Engine()
    swarm: Swarm | None = None
    made: dict[str, bool] = {}
    result: dict = {}
    workdir = Path(tempfile.mkdtemp(prefix="starling-compose-test."))
    release = "bookworm"
    ok = False
    try:
        engine.ensure()
        compose = compose_command()
        log(f"compose: {' '.join(compose)} ({run([*compose, 'version'], check=False).stdout.splitlines()[0]})")
        release = subprocess.run(["sh", "-c", ". /etc/os-release && echo $VERSION_CODENAME"], capture_output=True,
                                 text=True).stdout.strip() or release
        base = f"starling-base:{release}"
        made["base"] = run(["docker", "image", "inspect", base], check=False, quiet=True).returncode != 0
        made["wheelhouse"] = not any(WHEELHOUSE.glob("*.whl"))
        made["image"] = run(["docker", "image", "inspect", args.image], check=False, quiet=True).returncode != 0
        prometheus_image = f"starling-prometheus:{release}"
        made["prometheus"] = run(["docker", "image", "inspect", prometheus_image], check=False,
                                 quiet=True).returncode != 0
        if not args.no_build:
            ensure_build_tools(base_missing=made["base"])
            log(f"building {args.image} offline (make image OFFLINE=1)")
            t0 = time.monotonic()
            make = ["make", "--no-print-directory", "image", "OFFLINE=1", f"IMAGE={args.image}",
                    f"BASE_IMAGE_OFFLINE={base}"]
            run(make, timeout=3600)
            result["build_s"] = time.monotonic() - t0
        if made["prometheus"]:
            ensure_build_tools(base_missing=True)
            log(f"building {prometheus_image} offline (docker/base-image.sh with Debian's prometheus)")
            t0 = time.monotonic()
            run(["docker/base-image.sh", prometheus_image], env={**os.environ, "DEBIAN_RELEASE": release,
                                                                "BASE_PACKAGES": "prometheus"}, timeout=1800)
            result["prometheus_build_s"] = time.monotonic() - t0
        result["image_bytes"] = int(run(["docker", "image", "inspect", "-f", "{{.Size}}", args.image]).stdout)
        hist = run(["docker", "history", "--no-trunc", "--format", "{{.Size}}\t{{.CreatedBy}}", args.image]).stdout
        layers = [(size, " ".join(by.split())[-70:]) for size, _, by in (ln.partition("\t") for ln in hist.splitlines())
                  if size not in ("0B", "0")]
        log(f"image {args.image}: {result['image_bytes'] / 1e6:.0f} MB" +
            (f", built in {result['build_s']:.0f}s" if "build_s" in result else "") +
            "; layers: " + "; ".join(f"{size} {by}" for size, by in layers))

        swarm = Swarm(compose, args.image, prometheus_image, workdir)
        swarm("down", "-v", check=False)  # leftovers of an interrupted run
        t0 = time.monotonic()
        swarm("up", "-d", "--no-build", "--scale", f"trainer={TRAINERS}")
        log(f"up: bootstrap + {TRAINERS} trainers")
        result.update(check_swarm(swarm, args.timeout))
        result["up_to_checks_s"] = time.monotonic() - t0
        result["metrics"] = check_metrics(swarm)
        result.update(check_monitoring(swarm))
        result.update(check_restart(swarm))
        result.update(check_down(swarm, args.image, workdir, result["restarted"]))
        ok = True
    except Failed as e:
        log(f"FAILED: {e}")
        if swarm is not None:
            p = swarm("logs", "--no-color", "--tail", "20", check=False)
            print(p.stdout[-6000:])
    finally:
        if swarm is not None:
            swarm("down", "-v", "--remove-orphans", check=False, timeout=180)
            for vol in result.get("volumes", []):
                run(["docker", "volume", "rm", vol], check=False, quiet=True)
        if engine.up():
            run(["docker", "image", "prune", "-f", "--filter", "label=org.starling.stage=build"], check=False)
            if not args.keep_image:
                if made.get("image"):
                    run(["docker", "image", "rm", args.image], check=False)
                if made.get("base"):
                    run(["docker", "image", "rm", f"starling-base:{release}"], check=False)
                if made.get("prometheus"):
                    run(["docker", "image", "rm", f"starling-prometheus:{release}"], check=False)
        if made.get("wheelhouse") and not args.keep_image:
            for whl in WHEELHOUSE.glob("*.whl"):
                whl.unlink()
        engine.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    total = time.monotonic() - t_start
    if ok:
        log(f"PASSED in {total:.0f}s (build {result.get('build_s', 0):.0f}s, up to checks passed "
            f"{result['up_to_checks_s']:.0f}s, restart {result['restart_s']:.0f}s, down {result['down_s']:.1f}s); image {result['image_bytes'] / 1e6:.0f} MB; "
            f"partners {result['partners']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
