"""Time to a loss over slow links: real Starling daemons against DDP and DiLoCo, 4 trainers in the network lab.

Every trainer runs in its own network-lab host (starling_testing/netlab.py: one network namespace each, a veth
to the lab's "internet" bridge, no route anywhere else) behind its own link shaped with tc tbf in both
directions (each end of its veth); a network-only bootstrap node sits on an unshaped link. Every worker runs
in its own cgroup v1 cpu group at the same quota (`--cap`, % of one core), so every contender gets the same
compute per node; each worker's actual CPU share is reported. The trainers' PeerIDs (so their data shards) are
made once and shared by every run and by the simulation, as bench/swarm.py pairs them.

Contenders, each on the same namespaces and links:

- **Starling**: real `starling run` daemons with the shipped defaults (the model and its lr schedule set, nothing
  about the link), run to the wall time `--seconds`; `--starling` adds variants (e.g. a `sync.compression` preset:
  a variant whose option this build does not know is skipped with a note). The loss against wall time is the
  mean over the 4 trainers of each one's latest validation loss (`training.val_loss`: the worker's evaluation
  after each outer step, the same function and held-out batches as the simulation's).
- **DDP** and **DiLoCo**, composed as docs/benchmarks.md says (a run to the target would take days at these
  rates): loss against the inner step from bench/convergence.py's simulation (`run_ddp`, `run_outer(diloco)`,
  the same shards, model and settings), times the seconds per step measured in the lab on the same shaped
  links and cpu caps: 4 processes, one per namespace, train the same model and all-reduce its fp32 gradient
  vector with torch.distributed's gloo (TCP rendezvous at the first trainer's address). DDP: a step is one
  inner step plus that all-reduce; DiLoCo: an outer step is H inner steps plus the same all-reduce (of Delta,
  a vector of the same size).
- **hivemind**: real hivemind 1.1.12 peers (bench/hivemind_wan.py in bench/.venv-hivemind, which bench/sync.py
  --parts 3 makes; without it, or with `--hivemind off`, a note says it was left out): a hivemind DHT node on the
  bootstrap host and one `hivemind.Optimizer` peer per trainer host, with the same model, shards, inner optimizer
  (AdamW) and lr schedule, in local-update mode (the closest to local SGD: each peer steps on its own gradients,
  and the collaboration averages parameters in one group each time it has accumulated N x H x batch size
  samples, about every H local steps), no compression, timeouts sized for the slowest link. Only each peer's
  training process is capped (its DHT, averager and p2pd processes are not, as Starling's daemon is not). Its loss
  is the mean over the peers of each one's latest validation loss, evaluated after each averaging result (or
  state download) it applied, for the same wall time as Starling's run; bytes from the same link counters.

First a calibration run: the same Starling daemons on unshaped links, which gives the unshaped inner-step rate
(each contender's "share of wall time computed" is against it), and the bytes per outer step from which the
link rate is derived (`--rate-mbit auto`): the rate at which communication over compute per outer step equals
a 1B-parameter model's on 100 Mbit/s links with a modern GPU. The derivation is printed.

Scenarios (`--scenarios`): `uniform` (4 links at the rate) and `one-slow` (one of the four 5x slower).

With latency (`--rtt-ms`, `--jitter-ms`, `--loss`, or one of issue #50's named links, `--link`: 20mbit-100ms,
2mbit-200ms-loss, 100mbit-300ms-loss, home-20-5-50ms), the shipped defaults also run on the same rates with no
delay line (their zero-latency twin), and each trainer alone (`--alone`: the same daemons, each in a swarm of its
own), in the same run; the verdicts read the swarm against both.

    sudo .venv/bin/python bench/wan.py                       # both scenarios at the derived rate (~30 min)
    sudo .venv/bin/python bench/wan.py --rate-mbit 0.4,2     # the issue's acceptance rates
    sudo .venv/bin/python bench/wan.py --write-docs          # also writes "## Over slow links" + PNGs in docs/
    sudo .venv/bin/python bench/wan.py --quick               # a smoke run (tiny model, 2 Mbit/s, ~4 min)
    sudo .venv/bin/python bench/wan.py --link 2mbit-200ms-loss --scenarios uniform --hivemind off --write-docs

Needs root, the network lab (ip netns), tc tbf and the cgroup v1 cpu controller; without one of them it says
which and exits 2. Every namespace, daemon and cgroup is removed on the way out, also on Ctrl+C and SIGTERM.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import dataclasses
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

# This checkout's modules first, not an installed copy's: the daemons run from `starling_testing`'s tree
# (their working directory), and a run from a second worktree ran the first one's code without it.
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from compression import register_trial_preset, run_method  # noqa: E402  # bench/compression.py: DiLoCo under a preset's Delta codec
from convergence import QUICK as QUICK_BENCH  # noqa: E402  # bench/convergence.py, beside this script
from convergence import BenchConfig, run_ddp, run_outer
from records import RESULTS_DIR, append_record, provenance, tree_id
from swarm import (
    CGROUP_CPU,
    SLOW_PERIOD_US,
    CpuCap,
    cpu_seconds,
    make_identities,
    model_fields,
    seed_home,
    set_args,
    sigterm_as_interrupt,
    sync_of,
    training,
)

from node.config.load import ConfigError, load_config
from node.config.train import TrainConfig
from protocols.compress import EXPERIMENTAL, PRESETS, Compression, get_compression
from starling_testing import netlab
from starling_testing.daemon import PORT, PYTHON, DaemonError, LabDaemon, spawn_daemon, start_daemon
from starling_testing.netlab import Lab, LabError, Proc
from starling_testing.report import replace_section

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
SECTION = "## Over slow links"
# Runs with latency, jitter or loss (`--rtt-ms`, `--jitter-ms`, `--loss`) write their own section, beside the
# zero-latency record above (issue #50).
LATENCY_SECTION = "## Over slow links with latency"
RESULTS = RESULTS_DIR / "wan.jsonl"  # every full run's raw rows (issue #52): what the sections are rendered from
HIVEMIND_VENV = ROOT / "bench" / ".venv-hivemind"
HIVEMIND_SCRIPT = ROOT / "bench" / "hivemind_wan.py"
HIVEMIND_PORT = 31337
N = 4
SCENARIOS = ("uniform", "one-slow")
TWIN_ROW = "Starling defaults, zero-latency twin (same rates, no delay line)"
ALONE_ROW = "each trainer alone (the same daemons, no swarm)"
SLOW_FACTOR = 5.0
GLOO_PORT = 29500
POLL_S = 1.0
DDP_ROW = "DDP (gloo, composed)"  # fp32 all-reduce
DILOCO_ROW = "DiLoCo (gloo, composed)"
DDP_BF16_ROW = "DDP bf16 (gloo, composed)"  # the same, all-reducing bf16 (issue #52: the fair baseline)
DILOCO_BF16_ROW = "DiLoCo bf16 (gloo, composed)"
#: The all-reduce's dtype per composed row pair, and its bytes per element.
ALLREDUCE_DTYPES = {"fp32": 4, "bf16": 2}
#: DiLoCo with a compressed Delta (issue #52: "DiLoCo with the same Delta compressor"): SparseLoCo's setting, top-k
#: of each chunk with low-bit values and error feedback; the compressed Deltas are all-gathered, not all-reduced (a
#: sum of top-k vectors is no top-k vector). The default is the long-run judge's SparseLoCo-like preset.
DILOCO_COMPRESSION = "k64q2"


def diloco_compressed_row(preset: str) -> str:
    """The label of DiLoCo's row under `preset`'s Delta codec."""
    return f"DiLoCo + {preset} (gloo all-gather, composed)"
HIVEMIND_ROW = "hivemind (Optimizer, local updates)"

# The regime to reproduce (docs/benchmarks.md, "Over slow links"): a 1B-parameter model on one modern GPU
# (0.4 s per inner step), H = 50, 100 Mbit/s links; Starling today sends phi and Delta in bf16, 4 bytes per
# parameter each way per outer step.
REF_PARAMS = 1e9
REF_STEP_S = 0.4
REF_RATE_MBIT = 100.0
REF_H = 50
REF_BYTES_PER_PARAM = 4.0
REF_WIRE_S = REF_PARAMS * REF_BYTES_PER_PARAM * 8 / (REF_RATE_MBIT * 1e6)  # 320 s per outer step
REF_RATIO = REF_WIRE_S / (REF_H * REF_STEP_S)  # 16: seconds on the wire per second of compute
# DDP in the same regime: a ring all-reduce of bf16 gradients, 2(N-1)/N x 2 bytes/param per node per step.
REF_DDP_RATIO = 2 * (N - 1) / N * REF_PARAMS * 2 * 8 / (REF_RATE_MBIT * 1e6) / REF_STEP_S


class BenchError(Exception):
    """A part of the benchmark could not run; the message says why (with a log tail)."""


# --- the plan ----------------------------------------------------------------------------------------------


@dataclass
class Plan:
    quick: bool
    bench: BenchConfig  # the model, H and lr schedule of every contender (and the simulated steps)
    model: str  # "bench" (bench/convergence.py's) or "default" (the daemon's default model)
    seconds: float  # each Starling run, timed from when all 4 trainers train
    calib_s: float  # the unshaped calibration run
    startup_s: float
    cap_pct: float  # every worker's (and every gloo rank's) cpu quota, % of one core
    rates: list[str]  # "auto" or Mbit/s
    scenarios: list[str]
    variants: list[tuple[str, dict[str, str]]]  # Starling variants: (label, {"section.option": value})
    sync: dict[str, Any] = field(default_factory=dict)  # sync options of every Starling run (quick: faster joins)
    hivemind: str = "auto"  # auto: run hivemind where bench/.venv-hivemind exists; off: leave it out
    queue_ms: float | None = None  # each shaped link's queue (netlab `limit`); None: tbf's deep default
    path: PathShape = field(default_factory=lambda: PathShape())  # latency, jitter and loss between trainers
    up_factor: float = 1.0  # each shaped link's upload rate over its download rate (a home line: 0.25)
    twin_tolerance: float | None = 0.03  # how far above its zero-latency twin the val loss may end (None: no bound)
    alone: bool = False  # run each trainer alone too (no swarm): "is joining worth it"
    links: list[NamedLink] = field(default_factory=list)  # --link: each its own leg of the run (empty: one leg)
    composed: bool = True  # the composed DDP and DiLoCo rows (their simulation: ~15 min on 2 cores)
    allreduce: tuple[str, ...] = ("fp32", "bf16")  # the composed rows' all-reduce dtypes, each timed in the lab
    diloco_compression: str | None = DILOCO_COMPRESSION  # DiLoCo's compressed row (None: left out)

    def legs(self) -> list[Plan]:
        """One plan per named link (its rate, path, upload and tolerance), sharing everything else, or this
        plan alone: the simulation, the calibration and the trainers-alone row are run once for all legs."""
        return [dataclasses.replace(self, rates=[f"{link.rate_mbit:g}"], path=link.path, up_factor=link.up_factor,
                                    twin_tolerance=link.twin_tolerance, links=[]) for link in self.links] or [self]

    @property
    def quota_us(self) -> int:
        return int(self.cap_pct / 100 * SLOW_PERIOD_US)

    def train(self) -> dict[str, Any]:
        """The daemons' train options: the model and its lr schedule, nothing else (the shipped defaults)."""
        bc = self.bench
        extra = {"inner_steps": bc.inner_steps, "total_steps": bc.total_steps}
        if bc.inner_steps < TrainConfig().max_lag:
            extra["max_lag"] = bc.inner_steps  # must be <= H (quick: H = 5)
        return {"device": "cpu", **model_fields(bc), **extra}


def bench_for(model: str, quick: bool, outer_steps: int | None) -> BenchConfig:
    if quick:
        bc = dataclasses.replace(QUICK_BENCH, outer_steps=24)
    elif model == "default":  # the daemon's default model and lr schedule, at bench/convergence.py's H
        d = TrainConfig()
        names = ("d_model", "n_layers", "n_heads", "seq_len", "batch_size", "lr", "warmup", "data_bytes",
                 "eval_batches")
        bc = BenchConfig(**{name: getattr(d, name) for name in names})
    else:
        bc = BenchConfig()
    return dataclasses.replace(bc, outer_steps=outer_steps) if outer_steps else bc


def parse_variants(text: str) -> list[tuple[str, dict[str, str]]]:
    """`defaults` or `section.option=value[+section.option=value...]`, comma-separated."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if item == "defaults":
            out.append(("defaults", {}))
            continue
        sets = {}
        for part in item.split("+"):
            key, eq, value = part.partition("=")
            if not eq or "." not in key:
                raise ValueError(f"--starling: {part!r} is not section.option=value")
            sets[key.strip()] = value.strip()
        out.append((item, sets))
    return out


def default_variants() -> str:
    """The shipped defaults, plus one variant per other `sync.compression` value once the option exists (the
    default, `auto` now, is the `defaults` row itself)."""
    from node.config import sync as sync_config

    presets = getattr(sync_config, "COMPRESSIONS", ())
    default = sync_config.SyncConfig().compression
    return ",".join(["defaults", *(f"sync.compression={p}" for p in presets if p != default)])


def unknown_option(sets: dict[str, str]) -> str | None:
    """Why this build of the daemon would refuse the variant's options (None: it takes them)."""
    try:
        load_config(None, overrides=dict(sets), environ={})
    except ConfigError as e:
        return str(e)
    return None


# --- the lab -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PathShape:
    """Latency, jitter and loss between two trainers (`--rtt-ms`, `--jitter-ms`, `--loss`), as the lab makes them.

    A packet between two trainers crosses two links (the sender's upload, the receiver's download), each
    with a delay line (netlab `limit`: starling_testing/delayline.py), and a round trip crosses four: each
    line holds `rtt_ms / 4` (+- `jitter_ms / 4`) and loses `1 - sqrt(1 - loss)`, so that trainer to trainer the
    round trip is `rtt_ms` and each way loses `loss`. The bootstrap host's link is not delayed: a trainer's
    round trip to it is half as long."""

    rtt_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0  # each way, trainer to trainer

    def __post_init__(self) -> None:
        if not 0 <= self.rtt_ms <= 2000:
            raise ValueError("--rtt-ms: between 0 and 2000")
        if not 0 <= self.jitter_ms <= self.rtt_ms:
            raise ValueError("--jitter-ms: between 0 and --rtt-ms")
        if not 0 <= self.loss < 0.5:
            raise ValueError("--loss: a share each way, between 0 and 0.5 (0.005 is 0.5%)")

    @property
    def is_flat(self) -> bool:
        return self.rtt_ms == 0 and self.loss == 0

    def line(self) -> dict[str, float]:
        """netlab `limit`'s delay_ms, jitter_ms and loss for each trainer's link."""
        return {"delay_ms": self.rtt_ms / 4, "jitter_ms": self.jitter_ms / 4, "loss": 1 - (1 - self.loss) ** 0.5}

    def tag(self) -> str:
        """What a plot's file name adds for this path ("" without latency, as before)."""
        return "" if self.is_flat else f"-{self.rtt_ms:g}ms" + (f"-loss{self.loss:g}" if self.loss else "")

    def text(self) -> str:
        if self.is_flat:
            return "no added latency"
        return (f"{self.rtt_ms:g} ms of round trip between trainers (+- {self.jitter_ms:g} ms of jitter), "
                f"{self.loss:.2%} loss each way, from the lab's delay line on each link (starling_testing/"
                f"delayline.py: {self.rtt_ms / 4:g} ms each way per link; the kernel has no netem)")


@dataclass(frozen=True)
class NamedLink:
    """One of issue #50's scenarios: a trainer's link (down, and up where a home line's differs) and the path
    between trainers, with how close to its zero-latency twin the swarm's val loss must end."""

    rate_mbit: float
    path: PathShape
    up_factor: float = 1.0  # upload rate / download rate
    twin_tolerance: float | None = None  # issue #50's bound on the twin's distance (None: it sets none)

    def text(self) -> str:
        up = "" if self.up_factor == 1 else f" down / {self.rate_mbit * self.up_factor:g} up"
        loss = f", {self.path.loss:.1%} loss" if self.path.loss else ""
        return f"{self.rate_mbit:g} Mbit/s{up}, {self.path.rtt_ms:g} +-{self.path.jitter_ms:g} ms RTT{loss}"


LINKS = {
    "20mbit-100ms": NamedLink(20.0, PathShape(100.0, 10.0), twin_tolerance=0.03),
    "2mbit-200ms-loss": NamedLink(2.0, PathShape(200.0, 20.0, 0.005), twin_tolerance=0.05),
    "100mbit-300ms-loss": NamedLink(100.0, PathShape(300.0, 50.0, 0.01)),
    "home-20-5-50ms": NamedLink(20.0, PathShape(50.0, 5.0), up_factor=0.25),
}


def queue_text(queue_ms: float | None) -> str:
    """How deep each shaped link's queue is, for the section's text (netlab `limit`)."""
    if queue_ms is None:
        return ("tbf's bucket holds a 64 KiB GSO packet and its queue as much again: seconds of queue on a "
                "slow link, 6.6 s at 0.08 Mbit/s")
    return (f"a shallow queue: {queue_ms:g} ms of traffic at the link rate, GSO capped to one frame "
            "(`--queue-ms`)")


def section_of(plan: Plan) -> str:
    """The heading a run writes: one per link and path, so that each latency scenario keeps its own."""
    if plan.path.is_flat:
        return SECTION
    path = plan.path
    rates = ", ".join(plan.rates) + " Mbit/s" + (f" down, {plan.up_factor:g} of it up" if plan.up_factor != 1 else "")
    loss = f", {path.loss:.1%} loss" if path.loss else ""
    return f"{LATENCY_SECTION}: {rates}, {path.rtt_ms:g} +-{path.jitter_ms:g} ms RTT{loss}"


def lab_unavailable() -> str | None:
    """Why this machine cannot run the bench (root, namespaces, tbf, cgroup v1 cpu), or None."""
    reason = netlab.unavailable_reason()
    if reason is not None:
        return reason
    if not (CGROUP_CPU / "cgroup.procs").exists():
        return f"no cgroup v1 cpu controller at {CGROUP_CPU} (equal compute per node needs cpu.cfs_quota_us)"
    if shutil.which("tc") is None:
        return "`tc` not found (Debian: apt-get install iproute2)"
    return None


def tbf_unavailable() -> str | None:
    """Build a throw-away lab host and shape it: None if the kernel has tbf."""
    try:
        with Lab(prefix="stlw-") as lab:
            lab.limit(lab.public_host("probe1"), 1.0)
    except LabError as e:
        return f"tc tbf unavailable: {e}"
    return None


class WanLab:
    """The lab of every run: a bootstrap host and N trainer hosts on one bridge; links reshaped per phase."""

    def __init__(self, lab: Lab, queue_ms: float | None = None, path: PathShape | None = None,
                 up_factor: float = 1.0) -> None:
        self.lab = lab
        self.up_factor = up_factor  # upload / download of every shaped link (1: symmetric)
        self.queue_ms = queue_ms  # None: tbf's default deep queue (seconds on a slow link); else a shallow one
        self.path = path or PathShape()  # latency and loss of every shaped phase (the calibration has none)
        self.boot = lab.public_host("boot")
        self.hosts = [lab.public_host(f"t{i}") for i in range(N)]

    def shape(self, rates: list[float] | None) -> None:
        """Each trainer's link to its rate (Mbit/s, both ways) with the path's latency and loss, or unshaped
        (None: no rate, no latency)."""
        for i, host in enumerate(self.hosts):
            if rates is None:
                self.lab.unlimit(host)
            else:
                up = None if self.up_factor == 1 else rates[i] * self.up_factor
                self.lab.limit(host, rates[i], up_mbit=up, queue_ms=self.queue_ms, **self.path.line())

    def counters(self) -> dict[str, tuple[int, int]]:
        """{trainer: (bytes it sent, bytes it received)} on its link so far: the bridge-side veth end's rx/tx
        (`ip -s link` in the internet namespace: one call reads every link)."""
        inet = self.lab.internet()
        out = subprocess.run(["ip", "-j", "-s", "-n", inet.netns, "link", "show"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
        by_dev = {e["ifname"]: e["stats64"] for e in json.loads(out) if "stats64" in e}
        return {h.name: (int(by_dev[f"p-{h.name}"]["rx"]["bytes"]), int(by_dev[f"p-{h.name}"]["tx"]["bytes"]))
                for h in self.hosts}


@contextlib.contextmanager
def caps(names: list[str], quota_us: int) -> Iterator[dict[str, CpuCap]]:
    """One cgroup v1 cpu group per name at `quota_us` per SLOW_PERIOD_US, all removed on the way out."""
    made: dict[str, CpuCap] = {}
    try:
        for name in names:
            made[name] = CpuCap(f"starling-wan-{os.getpid()}-{uuid.uuid4().hex[:6]}-{name}", quota_us)
        yield made
    finally:
        for cap in made.values():
            cap.remove()


def sweep_stale_caps() -> None:
    """Remove the cpu groups of earlier runs of this bench whose process is gone (a SIGKILLed run)."""
    for path in CGROUP_CPU.glob("starling-wan-*"):
        pid = path.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            cap = CpuCap.__new__(CpuCap)  # a handle on the existing group (no mkdir)
            cap.path = path
            cap.remove()


# --- Starling --------------------------------------------------------------------------------------------------


@dataclass
class NodeRun:
    """One trainer over the measured window of a Starling run."""

    name: str
    steps: int
    seconds: float
    cpu_share: float | None  # its worker's CPU time / the window, cores (None: the worker restarted)
    averaged: int  # outer steps by outcome (training.exchanges)
    solo: int
    failed: int
    link_sent: int  # bytes on its link, from the interface counters
    avg_sent: int  # averaging payload it sent (sync.bytes_sent)
    quiet_bytes: int  # link bytes sent while it ran no exchange, and for how long
    quiet_s: float
    last_exchange_s: float | None  # sync.last_duration_s at the end
    restarts: int
    catch_ups: int  # snapshots its worker adopted in the window (sync.catch_ups)
    follows: int = 0  # catch-ups that moved the count alone, without a download (sync.catch_up_follows)
    # The preset of the latest exchange (sync.last_compression) at each status poll that saw new bytes
    # averaged: what `auto` chose, sampled (one per poll, every POLL_S; exchanges between polls are not seen).
    presets: dict[str, int] = field(default_factory=dict)
    # The phases of each exchange it asked for (sync.last_asked, node/averaging/phases.py) that a status poll
    # saw: {"phases_s": {...}, "phases_rtt": {...} or None}; exchanges between polls are not seen.
    asked: list[dict[str, Any]] = field(default_factory=list)

    def phase_medians(self) -> tuple[dict[str, float], dict[str, float] | None]:
        """The median seconds of each phase over the asked exchanges seen, and of its round trips (None where
        no exchange had a measured RTT)."""
        names = list(self.asked[0]["phases_s"]) if self.asked else []
        secs = {n: statistics.median(a["phases_s"][n] for a in self.asked) for n in names}
        with_rtt = [a["phases_rtt"] for a in self.asked if a.get("phases_rtt")]
        rtts = {n: statistics.median(r[n] for r in with_rtt) for n in names} if with_rtt else None
        return secs, rtts

    @property
    def rate(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0

    @property
    def per_cpu(self) -> float | None:
        """Inner steps per second of its worker's CPU: what the link cost the worker, apart from how much CPU
        a shared machine gave it (the cap is an upper bound; the reference run may have got less)."""
        if self.cpu_share is None or self.cpu_share <= 0:
            return None
        return self.rate / self.cpu_share


@dataclass
class StarlingRun:
    label: str
    rates: list[float] | None  # the links' Mbit/s (None: unshaped)
    seconds: float
    curve: list[tuple[float, float]]  # (s since all trainers trained, mean of the trainers' latest val loss)
    sent_curve: list[tuple[float, float]]  # (s, mean bytes sent per trainer on its link since the start)
    nodes: list[NodeRun]
    bytes_per_outer: float | None  # averaging bytes each way of its last bf16 exchange (sync.last_bytes / 2)

    def mean(self, attr: str) -> float:
        return statistics.fmean(getattr(n, attr) for n in self.nodes)


def _exchanges(st: dict[str, Any] | None) -> tuple[int, int, int]:
    ex = training(st).get("exchanges") or {}
    return int(ex.get("group", 0)), int(ex.get("solo", 0)), int(ex.get("failed", 0))


def _busy_marks(st: dict[str, Any] | None) -> tuple[Any, ...]:
    """What changes whenever an exchange ends or begins: a node with the same marks at both ends of a poll
    interval, and idle at both, ran no exchange in it."""
    s = sync_of(st)
    return (s.get("state"), s.get("rounds"), s.get("solo_rounds"), s.get("failures"), _exchanges(st))


class QuietMeter:
    """The bytes each trainer sent on its link in the poll intervals of the measured window in which it ran no
    exchange (idle at both ends, nothing begun or ended in between: `_busy_marks`): the swarm's own membership
    and gossip traffic while it trains (plus whatever an exchange left in the socket buffers)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self._prev: tuple[dict[str, dict[str, Any] | None], dict[str, tuple[int, int]], float] | None = None

    def observe(self, statuses: dict[str, dict[str, Any] | None], counters: dict[str, tuple[int, int]],
                t: float) -> None:
        if self._prev is not None:
            before, c0, t0 = self._prev
            for k, st in statuses.items():
                was = before.get(k)
                if (st is not None and was is not None and sync_of(st).get("state") == "idle"
                        and _busy_marks(st) == _busy_marks(was)):
                    self.bytes[k] = self.bytes.get(k, 0) + counters[k][0] - c0[k][0]
                    self.seconds[k] = self.seconds.get(k, 0.0) + t - t0
        self._prev = (statuses, counters, t)


def run_starling(wl: WanLab, root: Path, plan: Plan, label: str, sets: dict[str, str], keys: list[Path],
                 rates: list[float] | None, initial_loss: float, seconds: float, *, alone: bool = False) -> StarlingRun:
    """Bootstrap + N trainers with `sets` on top of the plan's train options; measured for `seconds` from
    when every trainer has taken an inner step. Every daemon stops, every cgroup goes, whatever happens.

    `alone`: each trainer in a swarm of its own (its own swarm name, no bootstrap node): what its model would
    be had it not joined, with the same daemon, worker, cap and outer steps (each one solo)."""
    wl.shape(rates)
    swarm = f"wan-{uuid.uuid4().hex[:8]}"
    extra = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    args = ["--swarm", swarm, *set_args(plan.train(), plan.sync), *extra]
    print(f"  {label}: starting {'' if alone else 'the bootstrap node and '}{N} trainers"
          f" ({'unshaped' if rates is None else ', '.join(f'{r:g}' for r in rates) + ' Mbit/s'})",
          file=sys.stderr, flush=True)
    daemons: list[LabDaemon] = []
    with caps([h.name for h in wl.hosts], plan.quota_us) as cgroups, contextlib.ExitStack() as stop:
        stop.callback(stop_daemons, daemons)
        join: list[str] = []
        if not alone:
            boot = start_daemon(wl.boot, root / "boot", ["--swarm", swarm, "--no-train"], name=f"{label}-boot",
                                timeout=plan.startup_s)
            daemons.append(boot)
            join = ["--bootstrap", f"/ip4/{wl.boot.ip}/tcp/{PORT}/p2p/{boot.peer_id}"]
        trainers = []
        for i, (host, key) in enumerate(zip(wl.hosts, keys, strict=True)):
            home = root / host.name
            seed_home(home, key)
            own = ["--swarm", f"{swarm}-{i}"] if alone else []  # the last --swarm wins
            trainers.append(spawn_daemon(host, home, [*join, *args, *own], name=f"{label}-{host.name}"))
        daemons += trainers

        def poll() -> dict[str, dict[str, Any] | None]:
            out = {}
            for host, d in zip(wl.hosts, trainers, strict=True):
                if d.exited():
                    raise BenchError(f"{d.name} exited ({d.returncode()})\n{d.tail()}")
                st = d.status(timeout=5.0)
                pid = training(st).get("pid")
                if pid:
                    cgroups[host.name].add(int(pid))  # a restarted worker is a new pid
                out[host.name] = st
            return out

        quiet = QuietMeter()
        deadline = time.monotonic() + plan.startup_s
        while True:
            first = poll()
            if all(training(st).get("step", 0) > 0 and training(st).get("pid") for st in first.values()):
                break
            if time.monotonic() > deadline:
                raise BenchError(f"{label}: not every trainer trained within {plan.startup_s:.0f} s: "
                                 + ", ".join(f"{k} step {training(v).get('step')}" for k, v in first.items()))
            time.sleep(POLL_S)
        t0 = time.monotonic()
        c0 = wl.counters()
        pids = {k: int(training(st)["pid"]) for k, st in first.items()}
        cpu0 = {k: cpu_seconds(pid) for k, pid in pids.items()}
        print(f"  {label}: all {N} trainers training; measuring {seconds:.0f} s", file=sys.stderr, flush=True)
        last = dict(first)
        quiet.observe(first, c0, t0)
        # Inner steps computed: the sum of the step counter's rises (a catch-up may move it back).
        computed = dict.fromkeys(first, 0)
        curve = [(0.0, _mean_val(first, initial_loss))]
        sent_curve = [(0.0, 0.0)]
        presets: dict[str, collections.Counter[str]] = {k: collections.Counter() for k in first}
        asked: dict[str, list[dict[str, Any]]] = {k: [] for k in first}
        while (now := time.monotonic()) - t0 < seconds:
            time.sleep(min(POLL_S, max(0.0, seconds - (now - t0))))
            sts = poll()
            c, t = wl.counters(), time.monotonic()
            quiet.observe(sts, c, t)
            for k, st in sts.items():
                if st is not None:
                    computed[k] += max(0, int(training(st).get("step", 0)) - int(training(last[k]).get("step", 0)))
                    if int(sync_of(st).get("bytes_sent") or 0) > int(sync_of(last[k]).get("bytes_sent") or 0):
                        presets[k][str(sync_of(st).get("last_compression"))] += 1
                    seen = sync_of(st).get("last_asked")
                    if isinstance(seen, dict) and seen != sync_of(last[k]).get("last_asked"):
                        asked[k].append(seen)
            last.update({k: st for k, st in sts.items() if st is not None})
            curve.append((t - t0, _mean_val(last, initial_loss)))
            sent_curve.append((t - t0, statistics.fmean(c[k][0] - c0[k][0] for k in c)))
        elapsed = time.monotonic() - t0
        c1 = wl.counters()
        cpu1 = {k: cpu_seconds(pid) if training(last[k]).get("pid") == pid else None for k, pid in pids.items()}
    nodes = []
    for k in first:
        a0, s0, f0 = _exchanges(first[k])
        a1, s1, f1 = _exchanges(last[k])
        sy0, sy1 = sync_of(first[k]), sync_of(last[k])
        before, after = cpu0[k], cpu1[k]
        nodes.append(NodeRun(
            k, computed[k], elapsed,
            None if before is None or after is None else (after - before) / elapsed,
            a1 - a0, s1 - s0, f1 - f0, c1[k][0] - c0[k][0],
            int(sy1.get("bytes_sent") or 0) - int(sy0.get("bytes_sent") or 0), quiet.bytes.get(k, 0),
            quiet.seconds.get(k, 0.0),
            sy1.get("last_duration_s"), int(training(last[k]).get("restarts") or 0),
            int(sy1.get("catch_ups") or 0) - int(sy0.get("catch_ups") or 0),
            int(sy1.get("catch_up_follows") or 0) - int(sy0.get("catch_up_follows") or 0), dict(presets[k]),
            asked[k]))
    # The uncompressed exchange's bytes only: with `auto` a trainer's last exchange may be a compressed one
    # (its first two with each link are), and the derivation is about bf16 phi and Delta.
    exchanged = [int(sync_of(st).get("last_bytes") or 0) for st in last.values()
                 if sync_of(st).get("last_compression") in (None, "none")]
    per_outer = statistics.fmean(b for b in exchanged if b) / 2 if any(exchanged) else None
    run = StarlingRun(label, rates, elapsed, curve, sent_curve, nodes, per_outer)
    print(f"  {label}: {elapsed:.0f} s, val {curve[-1][1]:.4f}, inner steps/s per trainer "
          + ", ".join(f"{n.rate:.2f}" for n in nodes) + ", averaged/solo/failed "
          + ", ".join(f"{n.averaged}/{n.solo}/{n.failed}" for n in nodes), file=sys.stderr, flush=True)
    return run


def stop_daemons(daemons: list[LabDaemon], grace: float = 30.0) -> None:
    """SIGTERM every daemon at once (each worker writes its checkpoint), then wait; SIGKILL the late ones."""
    for d in daemons:
        if d.running():
            d.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for d in daemons:
        d.proc.stop(grace=max(0.1, deadline - time.monotonic()))


def _mean_val(statuses: dict[str, dict[str, Any] | None], initial: float) -> float:
    """The mean over trainers of each one's latest validation loss (the initial loss before its first)."""
    vals = [training(st).get("val_loss") for st in statuses.values()]
    return statistics.fmean(initial if v is None else float(v) for v in vals)


# --- DDP and DiLoCo: the all-reduce measured in the lab ---------------------------------------------------------


@dataclass
class Collective:
    """Seconds per DDP step and per DiLoCo outer step on the scenario's links, from gloo in the lab."""

    compute_s: float  # one inner step of one rank (median over ranks and steps)
    allreduce_s: float  # one all-reduce of the parameter-sized vector (median over steps, slowest rank)
    allreduce_bytes: float  # bytes each rank sent per all-reduce (link counters, mean over ranks)
    steps: int
    cpu_share: list[float]  # each rank's CPU time / its wall time
    dtype: str = "fp32"  # what the all-reduce moves: fp32, or bf16 (the gradient rounded, summed, back to fp32)
    compressed: bool = False  # `dtype` is a sync.compression preset: its encoded Delta all-gathered, then decoded

    def ddp_step_s(self) -> float:
        return self.compute_s + self.allreduce_s

    def diloco_outer_s(self, h: int) -> float:
        return h * self.compute_s + self.allreduce_s


def compression_preset(name: str) -> Compression:
    """A `sync.compression` preset by name, one on trial (`EXPERIMENTAL`) included; the process's `PRESETS` are
    left as they are (a test importing this module must not find a trial preset shipped)."""
    return EXPERIMENTAL[name] if name in EXPERIMENTAL else get_compression(name)



def collective_rank(spec: dict[str, Any]) -> None:
    """One gloo rank (run inside a lab namespace by `time_collective`): `steps` DDP steps of the plan's model,
    each one inner step on this rank's shard and an all-reduce of the flat gradient (fp32, or rounded to bf16 with
    `spec["dtype"]`: gloo sums bf16 as it sends it); with `spec["compressed"]`, `dtype` names a preset whose Delta
    codec encodes the vector, every rank's bytes are all-gathered and their sum decoded (DiLoCo + compression: the
    codec's time counts as communication); prints RESULT json."""
    import torch.distributed as dist

    from node.worker.task import TaskContext, load_task
    from node.worker.trainer import default_optimizer

    torch.set_num_threads(1)
    rank, n = spec["rank"], spec["world"]
    dist.init_process_group("gloo", init_method=f"tcp://{spec['master']}:{GLOO_PORT}", rank=rank, world_size=n,
                            timeout=timedelta(seconds=spec["timeout_s"]))
    cfg = TrainConfig(**spec["train"])
    task = load_task(cfg.task, TaskContext(cfg, spec["peer_id"], torch.device("cpu")))
    model = task.build_model()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = default_optimizer(model, cfg)
    stream = task.train_stream()
    codec, encoded = None, bytearray()
    if spec.get("compressed"):
        codec = compression_preset(spec["dtype"]).delta_codec("bf16")
        numel = sum(p.numel() for p in params)
        encoded = bytearray(codec.encoded_size(numel))
    dist.all_reduce(torch.zeros(1))  # connects every pair before the clock starts
    dist.barrier()
    compute, comm = [], []
    wall0, cpu0 = time.monotonic(), time.process_time()
    for _ in range(spec["steps"]):
        t0 = time.monotonic()
        optimizer.zero_grad(set_to_none=True)
        task.loss(model, stream.next_batch()).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        t1 = time.monotonic()
        if codec is not None:  # DiLoCo + compression: encode, all-gather every rank's bytes, decode their sum
            size = codec.encode_into(flat.numpy(), encoded)
            sent = torch.frombuffer(encoded, dtype=torch.uint8)[:size]
            gathered = [torch.empty_like(sent) for _ in range(n)]
            dist.all_gather(gathered, sent)
            flat.zero_()
            for part in gathered:
                codec.decode_into(memoryview(part.numpy()), flat.numpy(), accumulate=True)
        elif spec.get("dtype") == "bf16":
            wire = flat.to(torch.bfloat16)
            dist.all_reduce(wire)
            flat = wire.float()
        else:
            dist.all_reduce(flat)
        t2 = time.monotonic()
        flat /= n
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        compute.append(t1 - t0 + time.monotonic() - t2)
        comm.append(t2 - t1)
    cpu = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    print("RESULT " + json.dumps({"compute": compute, "comm": comm, "cpu": cpu, "numel": flat.numel()}), flush=True)
    dist.destroy_process_group()


def collective_bytes(numel: int, dtype: str, compressed: bool = False) -> float:
    """Bytes one rank sends per collective: a ring all-reduce moves about 2(N-1)/N of the vector per rank; an
    all-gather of encoded Deltas (N-1)/N of N encodings, one of its own size each."""
    if compressed:
        return (N - 1) * compression_preset(dtype).delta_codec("bf16").encoded_size(numel)
    return 2 * (N - 1) / N * numel * ALLREDUCE_DTYPES[dtype]


def time_collective(wl: WanLab, plan: Plan, peer_ids: list[str], rates: list[float], steps: int,
                    numel: int, dtype: str = "fp32", compressed: bool = False) -> Collective:
    wl.shape(rates)
    # The slowest link sets the pace.
    estimate = steps * collective_bytes(numel, dtype, compressed) * 8 / (min(rates) * 1e6)
    timeout = 120 + 2 * estimate
    what = (f"all-gather of {dtype}-encoded Deltas ({collective_bytes(numel, dtype, True) / (N - 1) / 1e6:.3f} MB each)"
            if compressed else f"{dtype} all-reduce of {numel * ALLREDUCE_DTYPES[dtype] / 1e6:.2f} MB")
    print(f"  gloo {what} on {', '.join(f'{r:g}' for r in rates)} Mbit/s: "
          f"{steps} step(s), about {estimate:.0f} s", file=sys.stderr, flush=True)
    procs: list[Proc] = []
    with caps([h.name for h in wl.hosts], plan.quota_us) as cgroups:
        try:
            c0 = wl.counters()
            for rank, (host, pid) in enumerate(zip(wl.hosts, peer_ids, strict=True)):
                spec = {"rank": rank, "world": N, "master": wl.hosts[0].ip, "train": plan.train(),
                        "peer_id": pid, "steps": steps, "timeout_s": timeout, "dtype": dtype,
                        "compressed": compressed}
                p = host.spawn([PYTHON, str(Path(__file__).resolve()), "--collective-rank", json.dumps(spec)],
                               log=f"gloo-{uuid.uuid4().hex[:6]}-{host.name}.log", env={"GLOO_SOCKET_IFNAME": "eth0"},
                               cwd=ROOT)
                cgroups[host.name].add(p.pid)  # `ip netns exec` execs python: the same pid
                procs.append(p)
            results = [json.loads(p.wait_for(r"^RESULT (.*)$", timeout=timeout).group(1)) for p in procs]
            c1 = wl.counters()
        finally:
            for p in procs:
                p.stop()
    comm = [max(r["comm"][i] for r in results) for i in range(steps)]
    compute = [x for r in results for x in r["compute"]]
    sent = statistics.fmean(c1[h.name][0] - c0[h.name][0] for h in wl.hosts) / steps
    out = Collective(statistics.median(compute), statistics.median(comm), sent, steps, [r["cpu"] for r in results],
                     dtype, compressed)
    print(f"  gloo {dtype}: inner step {out.compute_s:.3f} s, {'all-gather' if compressed else 'all-reduce'} "
          f"{out.allreduce_s:.1f} s, {out.allreduce_bytes / 1e6:.2f} MB sent per rank", file=sys.stderr, flush=True)
    return out


# --- hivemind: its collaborative optimizer, real peers in the lab ---------------------------------------------------


@dataclass
class HivemindSettings:
    """hivemind.Optimizer's options that depend on the links (its defaults assume fast ones), from the slowest."""

    target_batch_size: int  # N x H x batch size: an epoch, and an averaging round, every ~H local steps per peer
    matchmaking_time: float
    request_timeout: float
    averaging_timeout: float
    next_chunk_timeout: float

    @classmethod
    def for_links(cls, bc: BenchConfig, params: int, rates: list[float]) -> HivemindSettings:
        # Butterfly all-reduce in one group of N: each peer sends (N-1)/N of the fp32 vector as its parts and
        # as much again as averaged parts; parts are 512 kB (hivemind's DEFAULT_PART_SIZE_BYTES), and a peer
        # streams them to its N-1 partners at once.
        rate = min(rates) * 1e6 / 8
        allreduce_s = 2 * (N - 1) / N * params * 4 / rate
        chunk_s = (N - 1) * 2**19 / rate
        averaging = max(60.0, 3 * allreduce_s + 30)
        slow = min(rates) < 1.0
        return cls(N * bc.inner_steps * bc.batch_size, 30.0 if slow else 15.0, 6.0 if slow else 3.0, averaging,
                   min(averaging, max(15.0, 3 * chunk_s)))

    def text(self) -> str:
        return (f"target_batch_size {self.target_batch_size}, matchmaking_time {self.matchmaking_time:g} s, "
                f"request_timeout {self.request_timeout:g} s, averaging_timeout {self.averaging_timeout:.0f} s, "
                f"next_chunk_timeout {self.next_chunk_timeout:.0f} s")


@dataclass
class HivemindPeer:
    name: str
    steps: int
    seconds: float
    cpu_share: float
    groups: list[int]  # the group size of each averaging result it applied (0 or 1: the round failed)
    loaded: int  # state downloads from peers (hivemind's catch-up: a peer that fell an epoch behind)
    link_sent: int
    points: list[tuple[float, float]]  # (s since the start, val loss) after each averaging or download

    @property
    def rate(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0

    @property
    def averaged(self) -> int:
        return sum(1 for g in self.groups if g > 1)


@dataclass
class HivemindRun:
    settings: HivemindSettings
    seconds: float
    curve: list[tuple[float, float]]
    sent_curve: list[tuple[float, float]]
    peers: list[HivemindPeer]


def hivemind_python(plan: Plan) -> tuple[Path | None, str | None]:
    """The hivemind venv's python, or None and why hivemind is left out."""
    if plan.hivemind == "off":
        return None, "hivemind left out (--hivemind off)"
    python = HIVEMIND_VENV / "bin" / "python"
    if not python.exists():
        return None, f"hivemind skipped: no {HIVEMIND_VENV.relative_to(ROOT)} (bench/sync.py --parts 3 creates it)"
    check = subprocess.run([str(python), "-c", "import hivemind, torch"], capture_output=True, text=True, timeout=120)
    if check.returncode != 0:
        tail = (check.stderr or check.stdout).strip().splitlines()[-1:]
        return None, f"hivemind skipped: {HIVEMIND_VENV.relative_to(ROOT)} cannot import it ({' '.join(tail)})"
    return python, None


def mean_curve(peers: list[list[tuple[float, float]]], initial: float) -> list[tuple[float, float]]:
    """The mean over peers of each one's latest validation loss (`initial` before its first), at every point of
    any peer: the loss against wall time that Starling's rows show (there sampled at each poll)."""
    events = sorted((t, i, v) for i, pts in enumerate(peers) for t, v in pts)
    latest = [initial] * len(peers)
    out = [(0.0, initial)]
    for t, i, v in events:
        latest[i] = v
        out.append((t, statistics.fmean(latest)))
    return out


def _stop_leftovers(hosts: list[netlab.Host]) -> None:
    """SIGKILL whatever a hivemind run left in these hosts' namespaces (p2pd daemons, averager processes whose
    parent is gone): only the bench's own processes run there, and none of Starling's between runs."""
    for host in hosts:
        for pid in netlab._pids_in(host.netns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def run_hivemind(wl: WanLab, root: Path, python: Path, plan: Plan, peer_ids: list[str], rates: list[float],
                 initial_loss: float, params: int, seconds: float, label: str) -> HivemindRun:
    """A hivemind DHT node on the bootstrap host and N hivemind.Optimizer peers, one per trainer host, each
    (its training process alone, not its DHT, averager and p2pd processes) in its own cpu group; `seconds`
    from a common start. BenchError with the log's tail when a part does not come up."""
    from node.worker.trainer import lr_at

    wl.shape(rates)
    bc = plan.bench
    settings = HivemindSettings.for_links(bc, params, rates)
    cfg = TrainConfig(**plan.train())
    lrs = [lr_at(cfg, step) for step in range(cfg.total_steps + 1)]
    root.mkdir(parents=True)
    go_file = root / "go.json"
    run_id = f"wan-{uuid.uuid4().hex[:8]}"
    print(f"  {label}: hivemind DHT on the bootstrap host and {N} hivemind.Optimizer peers "
          f"({', '.join(f'{r:g}' for r in rates)} Mbit/s; {settings.text()})", file=sys.stderr, flush=True)
    procs: list[Proc] = []
    hosts = [wl.boot, *wl.hosts]
    try:
        with caps([h.name for h in wl.hosts], plan.quota_us) as cgroups:
            boot = wl.boot.spawn([str(python), str(HIVEMIND_SCRIPT), "dht",
                                  json.dumps({"ip": wl.boot.ip, "port": HIVEMIND_PORT})],
                                 log=f"{label}-boot.log", cwd=ROOT)
            procs.append(boot)
            initial_peer = boot.wait_for(r"^MADDR (\S+)$", timeout=plan.startup_s).group(1)
            peers = []
            for host, pid in zip(wl.hosts, peer_ids, strict=True):
                spec = {"ip": host.ip, "port": HIVEMIND_PORT, "initial_peer": initial_peer, "train": plan.train(),
                        "peer_id": pid, "lrs": lrs, "run_id": run_id, "out": str(root / f"{host.name}.jsonl"),
                        "go_file": str(go_file), "go_timeout_s": 2 * plan.startup_s,
                        **dataclasses.asdict(settings)}
                p = host.spawn([str(python), str(HIVEMIND_SCRIPT), "peer", json.dumps(spec)],
                               log=f"{label}-{host.name}.log", cwd=ROOT)
                procs.append(p)
                peers.append(p)
            for host, p in zip(wl.hosts, peers, strict=True):
                ready = int(p.wait_for(r"^READY (\d+)$", timeout=plan.startup_s).group(1))
                cgroups[host.name].add(ready)  # this process only: its hivemind children were forked before
            t0 = time.time() + 1.0
            go_file.write_text(json.dumps({"t0": t0, "seconds": seconds}))
            while time.time() < t0:
                time.sleep(0.05)
            c0 = wl.counters()
            sent_curve = [(0.0, 0.0)]
            print(f"  {label}: all {N} peers started; measuring {seconds:.0f} s", file=sys.stderr, flush=True)
            while (now := time.time()) - t0 < seconds:
                time.sleep(min(POLL_S, max(0.0, seconds - (now - t0))))
                for p in procs:
                    if p.poll() is not None:
                        raise BenchError(f"hivemind: {p.host.name} exited ({p.poll()})\n{p.tail()}")
                c = wl.counters()
                sent_curve.append((time.time() - t0, statistics.fmean(c[k][0] - c0[k][0] for k in c)))
            c1 = wl.counters()
            # A peer finishes its current step first (it may wait for an averaging round to end).
            for p in peers:
                p.wait_for(r"^DONE$", timeout=settings.averaging_timeout + 60)
    finally:
        for p in reversed(procs):
            p.stop(grace=10.0)
        _stop_leftovers(hosts)
    out = []
    for host in wl.hosts:
        lines = [json.loads(ln) for ln in (root / f"{host.name}.jsonl").read_text().splitlines() if ln.strip()]
        summary = next(x for x in lines if x.get("summary"))
        points = [(x["t"] - t0, float(x["val"])) for x in lines if "val" in x and x["t"] - t0 <= seconds]
        out.append(HivemindPeer(host.name, int(summary["steps"]), float(summary["seconds"]), float(summary["cpu"]),
                                [int(g) for g in summary["groups"]], int(summary["loaded"]),
                                c1[host.name][0] - c0[host.name][0], points))
    curve = mean_curve([p.points for p in out], initial_loss)
    curve.append((seconds, curve[-1][1]))  # each peer's latest loss holds to the end, as in Starling's curve
    run = HivemindRun(settings, seconds, curve, sent_curve, out)
    print(f"  {label}: val {run.curve[-1][1]:.4f}, inner steps/s per peer " + ", ".join(f"{p.rate:.2f}" for p in out)
          + ", averaged/other rounds " + ", ".join(f"{p.averaged}/{len(p.groups) - p.averaged}" for p in out)
          + ", state downloads " + ", ".join(str(p.loaded) for p in out), file=sys.stderr, flush=True)
    return run


def hivemind_row(run: HivemindRun, unshaped: StarlingRun) -> Row:
    ref = unshaped.mean("rate")
    shares = [p.rate / ref for p in run.peers] if ref else []
    share = f"{statistics.fmean(shares):.1%} ({min(shares):.0%}-{max(shares):.0%})" if shares else "-"
    rounds = ", ".join(f"{p.averaged}/{len(p.groups) - p.averaged}" for p in run.peers)
    cpu = ", ".join(f"{p.cpu_share:.2f}" for p in run.peers)
    sizes = sorted({g for p in run.peers for g in p.groups if g > 1})
    note = (f"inner steps {', '.join(str(p.steps) for p in run.peers)}; group sizes "
            f"{', '.join(map(str, sizes)) or '-'}; state downloads {', '.join(str(p.loaded) for p in run.peers)}")
    return Row(HIVEMIND_ROW, run.curve, run.sent_curve, share, rounds, cpu, note, rate_shares=shares)


def hivemind_note(run: HivemindRun) -> str:
    sent = sum(p.link_sent for p in run.peers) / len(run.peers)
    return (f"hivemind: {run.settings.text()}; {sent / 1e6:.1f} MB sent per peer on its link in "
            f"{run.seconds:.0f} s; evaluations after each applied averaging result (a failed round's too) or "
            "state download. In local-update mode hivemind 1.1.12 averages with its delta rule, and "
            "TrainingStateAverager.step waits for a pending averaging round before each local optimizer step: a peer "
            "computes nothing from the epoch's end until its matchmaking and all-reduce are over")


# --- composing and reporting ---------------------------------------------------------------------------------------


@dataclass
class Row:
    """One contender of one scenario and rate: its loss and bytes against wall time, and what it did."""

    label: str
    curve: list[tuple[float, float]]  # (wall s, val loss)
    sent: list[tuple[float, float]]  # (wall s, bytes sent per node so far)
    compute_share: str
    rounds: str  # averaged / solo per trainer
    cpu: str  # each worker's actual CPU share (cores)
    note: str = ""
    reference: bool = False  # shown, not a contender (the unshaped run)
    averaged_shares: list[float] = field(default_factory=list)  # Starling: per trainer, averaged / outer steps
    rate_shares: list[float] = field(default_factory=list)  # Starling: per trainer, of the unshaped rate
    cpu_rate_shares: list[float] = field(default_factory=list)  # the same per worker CPU-second


def interp(points: list[tuple[float, float]], x: float) -> float:
    """Linear interpolation of y at x (clamped to the ends)."""
    xs = [p[0] for p in points]
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return points[0][1]
    if i >= len(points):
        return points[-1][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """The first wall time at which the loss reaches `target` (linear between points), None if never."""
    for i, (t, loss) in enumerate(curve):
        if loss <= target:
            if i == 0:
                return t
            t0, l0 = curve[i - 1]
            return t0 + (t - t0) * (l0 - target) / (l0 - loss) if l0 != loss else t
    return None


def composed_rows(ddp: list[tuple[int, float]], diloco: list[tuple[int, float]], col: Collective,
                  h: int) -> list[Row]:
    """DDP's and DiLoCo's rows: the simulation's loss per inner step at `col`'s seconds per step. With a bf16
    all-reduce the loss is still the fp32 simulation's: bf16 rounding of an averaged update costs within 0.005
    of fp32 here (docs/benchmarks.md, "Compression": bf16 NoLoCo against the Convergence section's fp32). A
    compressed collective gives DiLoCo's row only, with `diloco` the simulation under that preset (`ddp` unused)."""
    step_s, outer_s = col.ddp_step_s(), col.diloco_outer_s(h)
    cpu = ", ".join(f"{c:.2f}" for c in col.cpu_share)
    if col.compressed:  # DiLoCo alone: its curve is the simulation under the preset (`diloco` is that one)
        return [Row(diloco_compressed_row(col.dtype), [(s / h * outer_s, v) for s, v in diloco],
                    [(s / h * outer_s, s / h * col.allreduce_bytes) for s, v in diloco],
                    f"{h * col.compute_s / outer_s:.1%}", "every outer step all-gathered", cpu,
                    f"{outer_s:.1f} s per outer step ({h} x {col.compute_s:.3f} + {col.allreduce_s:.1f} encode, "
                    "all-gather, decode)")]
    ddp_label, dil_label = (DDP_BF16_ROW, DILOCO_BF16_ROW) if col.dtype == "bf16" else (DDP_ROW, DILOCO_ROW)
    return [
        Row(ddp_label, [(s * step_s, v) for s, v in ddp], [(s * step_s, s * col.allreduce_bytes) for s, v in ddp],
            f"{col.compute_s / step_s:.1%}", "every step all-reduced", cpu,
            f"{step_s:.1f} s per step ({col.compute_s:.3f} compute + {col.allreduce_s:.1f} all-reduce)"),
        Row(dil_label, [(s / h * outer_s, v) for s, v in diloco],
            [(s / h * outer_s, s / h * col.allreduce_bytes) for s, v in diloco],
            f"{h * col.compute_s / outer_s:.1%}", "every outer step all-reduced", cpu,
            f"{outer_s:.1f} s per outer step ({h} x {col.compute_s:.3f} + {col.allreduce_s:.1f})"),
    ]


def starling_row(run: StarlingRun, unshaped: StarlingRun | None, label: str, reference: bool = False) -> Row:
    # Every worker has the same cap, so the reference is the unshaped run's mean rate over its trainers.
    ref = unshaped.mean("rate") if unshaped else 0.0
    shares = [n.rate / ref for n in run.nodes] if ref else []
    share = (f"{statistics.fmean(shares):.1%} ({min(shares):.0%}-{max(shares):.0%})" if shares else "-")
    rounds = ", ".join(f"{n.averaged}/{n.solo + n.failed}" for n in run.nodes)
    cpu = ", ".join("?" if n.cpu_share is None else f"{n.cpu_share:.2f}" for n in run.nodes)
    restarts = sum(n.restarts for n in run.nodes)
    steps = ", ".join(str(n.steps) for n in run.nodes)
    last = ", ".join("-" if n.last_exchange_s is None else f"{n.last_exchange_s:.1f}" for n in run.nodes)
    catch_ups = ", ".join(str(n.catch_ups) for n in run.nodes)
    follows = ", ".join(str(n.follows) for n in run.nodes)
    seen = collections.Counter[str]()
    for n in run.nodes:
        seen.update(n.presets)
    chosen = ", ".join(f"{p} {c}" for p, c in seen.most_common())
    note = (f"inner steps {steps}; last exchange (s) {last}" + (f"; presets at status polls {chosen}" if chosen else "")
            + (f"; worker restarts {restarts}" if restarts else "")
            + (f"; catch-ups {catch_ups}" if any(n.catch_ups for n in run.nodes) else "")
            + (f"; counts followed without a download {follows}" if any(n.follows for n in run.nodes) else ""))
    averaged = [n.averaged / max(1, n.averaged + n.solo + n.failed) for n in run.nodes]
    ref_cpu = [x for x in (n.per_cpu for n in unshaped.nodes) if x is not None] if unshaped else []
    per_cpu = ([x / statistics.fmean(ref_cpu) for x in (n.per_cpu for n in run.nodes) if x is not None]
               if ref_cpu else [])
    return Row(label, run.curve, run.sent_curve, share, rounds, cpu, note, reference, averaged, shares, per_cpu)


def verdicts(sc_name: str, rows: list[Row], target: float, twin_tolerance: float | None = 0.03) -> list[str]:
    """Issue #23's acceptance lines for the shipped defaults (met / NOT met, with the figures), and issue #50's
    where the run has a zero-latency twin (a latency scenario) or a row of trainers alone."""
    by = {r.label: r for r in rows}
    star = by.get("Starling defaults")
    ddp = strongest([by[k] for k in (DDP_ROW, DDP_BF16_ROW) if k in by], target)
    dil = strongest([r for r in rows if r.label in (DILOCO_ROW, DILOCO_BF16_ROW) or r.label.startswith("DiLoCo + ")],
                    target)
    if star is None:
        return []

    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    out = [f"- {sc_name}: every trainer averages in >= 80% of its outer steps: {met(min(star.averaged_shares) >= 0.8)} "
           f"({', '.join(f'{x:.0%}' for x in star.averaged_shares)})"]
    if star.rate_shares:
        out.append(f"- {sc_name}: every trainer makes >= 90% of its unshaped inner-step rate: "
                   f"{met(min(star.rate_shares) >= 0.9)} ({', '.join(f'{x:.0%}' for x in star.rate_shares)})"
                   + (f"; per worker CPU-second, which a shared machine's load does not move: "
                      f"{', '.join(f'{x:.0%}' for x in star.cpu_rate_shares)}" if star.cpu_rate_shares else ""))
    if ddp is not None and dil is not None:
        out += _baseline_verdicts(sc_name, star, ddp, dil, target)
    return out + _latency_verdicts(sc_name, by, star, twin_tolerance)


def strongest(rows: list[Row], target: float) -> Row | None:
    """Of a baseline's rows (fp32 and bf16 all-reduce), the one that reaches `target` first (issue #52: the
    targets read against the strongest baseline); one that never reaches it only where none does."""
    def when(row: Row) -> float:
        t = time_to(row.curve, target)
        return math.inf if t is None else t

    return min(rows, key=when) if rows else None


def _baseline_verdicts(sc_name: str, star: Row, ddp: Row, dil: Row, target: float) -> list[str]:
    """Issue #23's: the target loss sooner than DDP (5x) and DiLoCo, each the strongest of its rows."""
    t_star, t_ddp, t_dil = (time_to(r.curve, target) for r in (star, ddp, dil))

    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    def ratio(other: float | None) -> float | None:
        return None if t_star is None or other is None or t_star <= 0 else other / t_star

    out: list[str] = []
    r_ddp, r_dil = ratio(t_ddp), ratio(t_dil)
    text = "n/a (not reached)" if r_ddp is None else f"{r_ddp:.1f}x"
    out.append(f"- {sc_name}: Starling reaches {target:.3f} >= 5x sooner than {_baseline_name(ddp)}: "
               f"{met(r_ddp is not None and r_ddp >= 5)} ({_s(t_star)} vs {_s(t_ddp)}: {text})")
    need = 2.0 if sc_name == "one-slow" else 1.0
    text = "n/a (not reached)" if r_dil is None else f"{r_dil:.2f}x"
    out.append(f"- {sc_name}: Starling reaches it {'>= 2x sooner than' if need > 1 else 'no later than'} "
               f"{_baseline_name(dil)}: "
               f"{met(r_dil is not None and r_dil >= need)} ({_s(t_star)} vs {_s(t_dil)}: {text})")
    return out


def _baseline_name(row: Row) -> str:
    """'DDP (fp32 all-reduce)', 'DiLoCo (bf16 all-reduce)' or 'DiLoCo + k64q2 (all-gather)': which of a
    baseline's rows a verdict reads."""
    if row.label.startswith("DiLoCo + "):
        return row.label.split(" (")[0] + " (all-gather)"
    kind = "DDP" if row.label in (DDP_ROW, DDP_BF16_ROW) else "DiLoCo"
    return f"{kind} ({'bf16' if row.label in (DDP_BF16_ROW, DILOCO_BF16_ROW) else 'fp32'} all-reduce)"


def _latency_verdicts(sc_name: str, by: dict[str, Row], star: Row, twin_tolerance: float | None) -> list[str]:
    """Issue #50's, where the run has a zero-latency twin or a row of the trainers alone."""

    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    out: list[str] = []
    end = star.curve[-1][1]
    twin = by.get(TWIN_ROW)
    if twin is not None:  # issue #50: latency must not cost the swarm its model
        end_twin = twin.curve[-1][1]
        if twin_tolerance is None:
            out.append(f"- {sc_name}: val loss at the end against the zero-latency twin: {end:.3f} against "
                       f"{end_twin:.3f} ({end - end_twin:+.3f}; issue #50 sets no bound for this link)")
        else:
            out.append(f"- {sc_name}: val loss at the end within {twin_tolerance:g} of the zero-latency twin: "
                       f"{met(end <= end_twin + twin_tolerance)} ({end:.3f} against {end_twin:.3f})")
        out.append(f"- {sc_name}, with latency: every trainer averages >= 90% of its outer steps: "
                   f"{met(min(star.averaged_shares) >= 0.9)} ({', '.join(f'{x:.0%}' for x in star.averaged_shares)})")
        if star.rate_shares:
            out.append(f"- {sc_name}, with latency: every trainer keeps >= 95% of its unshaped inner-step rate: "
                       f"{met(min(star.rate_shares) >= 0.95)} ({', '.join(f'{x:.0%}' for x in star.rate_shares)})")
    alone = by.get(ALONE_ROW)
    if alone is not None:  # issue #50: joining never makes a trainer's model worse
        end_alone = alone.curve[-1][1]
        out.append(f"- {sc_name}: val loss at the end below that of the trainers alone: "
                   f"{met(end < end_alone)} ({end:.3f} against {end_alone:.3f})")
    return out


def choose_target(rows: list[Row]) -> float:
    """The lowest loss that every contender reaches: the highest of their best losses."""
    return max(min(v for _, v in r.curve) for r in rows if not r.reference)


def _mb(b: float | None) -> str:
    return "-" if b is None else f"{b / 1e6:.1f} MB"


def _s(t: float | None) -> str:
    if t is None:
        return "not reached"
    return f"{t:.0f} s" if t < 3600 else f"{t / 3600:.1f} h"


def scenario_table(rows: list[Row], target: float, wall: float) -> str:
    lines = [f"| contender | time to val loss {target:.3f} | val loss at {wall:.0f} s | bytes sent per node to "
             f"the target | bytes sent per node in {wall:.0f} s | share of the unshaped inner-step rate | "
             "averaged / solo outer steps per trainer | worker CPU (cores) | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = time_to(r.curve, target)
        ends = r.curve[-1][0]
        at = interp(r.curve, wall)
        at_text = f"{at:.3f}" + (f" (curve ends at {_s(ends)})" if ends < wall * 0.98 else "")
        lines.append(f"| {r.label} | {_s(t)} | {at_text} | {_mb(None if t is None else interp(r.sent, t))} | "
                     f"{_mb(interp(r.sent, wall))} | {r.compute_share} | {r.rounds} | {r.cpu} | {r.note} |")
    return "\n".join(lines)


def plot(rows: list[Row], target: float, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.4), dpi=110)
    for r in rows:
        pts = [(t, v) for t, v in r.curve if t > 0]
        style = (":" if r.reference else "--" if "DDP" in r.label else "-." if "DiLoCo" in r.label
                 else (0, (5, 1, 1, 1, 1, 1)) if r.label == HIVEMIND_ROW else "-")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle=style, label=r.label)
    ax.axhline(target, color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("wall time (s, log scale)")
    ax.set_ylabel("validation loss (nats per byte)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --- the run -------------------------------------------------------------------------------------------------------


@dataclass
class Derivation:
    params: int
    step_s: float
    bytes_each_way: float
    measured_bytes: bool
    h: int

    @property
    def rate_mbit(self) -> float:
        return self.bytes_each_way * 8 / (REF_RATIO * self.h * self.step_s) / 1e6

    def text(self) -> str:
        r = self.rate_mbit
        wire = self.bytes_each_way * 8 / (r * 1e6)
        ddp = 2 * (N - 1) / N * self.params * 4 * 8 / (r * 1e6)
        return (
            f"Link rate: the reference is a {REF_PARAMS / 1e9:.0f}B-parameter model on one modern GPU "
            f"({REF_STEP_S} s per inner step), H = {REF_H}, {REF_RATE_MBIT:g} Mbit/s links; Starling sends "
            f"{REF_BYTES_PER_PARAM:g} bytes per parameter each way per outer step (phi and Delta in bf16): "
            f"{REF_WIRE_S:.0f} s on the wire per {REF_H} x {REF_STEP_S} = {REF_H * REF_STEP_S:.0f} s of compute, "
            f"a ratio of {REF_RATIO:.1f} (DDP, a ring all-reduce of bf16 gradients: {REF_DDP_RATIO:.0f}). Here: "
            f"{self.params / 1e6:.2f}M parameters, an unshaped inner step of {self.step_s:.3f} s (the "
            f"{N} capped workers' mean rate in the calibration run), {self.bytes_each_way / 1e6:.2f} MB each way per outer "
            f"step ({'measured: sync.last_bytes / 2 of the trainers whose last exchange was bf16 `none`' if self.measured_bytes else 'computed: 4 bytes/param'}), "
            f"H = {self.h}: the same ratio needs {self.bytes_each_way / 1e6:.2f} MB x 8 / ({REF_RATIO:.1f} x "
            f"{self.h} x {self.step_s:.3f} s) = {r:.3g} Mbit/s ({wire:.0f} s on the wire per "
            f"{self.h * self.step_s:.1f} s of compute; DDP's fp32 all-reduce, {ddp:.0f} s per {self.step_s:.3f} s "
            f"step: a ratio of {ddp / self.step_s:.0f})."
        )


@dataclass
class Scenario:
    name: str
    rates: list[float]
    rows: list[Row]
    target: float
    wall: float
    png: Path | None
    notes: list[str]
    leg: Plan | None = None  # the leg of the run (Plan.legs) it belongs to


def initial_model(bc: BenchConfig, peer_id: str) -> tuple[float, int]:
    """The validation loss of the freshly built model and its parameter count, without the simulation: the
    curves' starting point where the composed rows are left out (`run_ddp` gives both otherwise)."""
    from node.worker.task import TaskContext, load_task

    cfg = bc.train_config("noloco")
    task = load_task(cfg.task, TaskContext(cfg, peer_id, torch.device("cpu")))
    model = task.build_model()
    return float(task.evaluate(model)), sum(p.numel() for p in model.parameters() if p.requires_grad)


def run_scenarios(plan: Plan, root: Path, out_dir: Path) -> tuple[Derivation, StarlingRun, list[Scenario], list[str]]:
    notes: list[str] = []
    keys, peer_ids = make_identities(root / "keys", N)
    bc = plan.bench
    diloco_c: list[tuple[int, float]] | None = None  # DiLoCo under plan.diloco_compression: loss per inner step
    if plan.composed:
        print(f"simulation: DDP and DiLoCo, {N} replicas on the trainers' shards, {bc.total_steps} inner steps...",
              file=sys.stderr, flush=True)
        ddp = run_ddp(bc, N, ids=peer_ids, curve_every=max(1, bc.inner_steps // 5))
        diloco = run_outer(bc, N, "diloco", root / "sim-diloco", ids=peer_ids, curve=True)
        initial_val, params = ddp.initial_val, ddp.params
        print(f"  DDP val {ddp.val_mean:.4f}, DiLoCo val {diloco.val_mean:.4f} ({params / 1e6:.2f}M parameters)",
              file=sys.stderr, flush=True)
        if plan.diloco_compression:
            register_trial_preset(plan.diloco_compression)
            sim = run_method(bc, N, "diloco", plan.diloco_compression, root / "sim-diloco-c", curve_every=1,
                             ids=peer_ids)
            diloco_c = [(0, initial_val), *sim.curve]
            print(f"  DiLoCo + {plan.diloco_compression} val {sim.val_mean:.4f} ({sim.bytes_per_param:.3f} B/param "
                  "per outer step)", file=sys.stderr, flush=True)
    else:
        initial_val, params = initial_model(bc, peer_ids[0])
        notes.append("DDP and DiLoCo left out (--composed off): this run judges Starling against itself (its "
                     "zero-latency twin, its trainers alone), not against the baselines")
    variants = []
    for label, sets in plan.variants:
        why = unknown_option(sets)
        if why is None:
            variants.append((label, sets))
        else:
            notes.append(f"Starling variant `{label}` skipped: this build refuses it ({why})")
    hm_python, why = hivemind_python(plan)
    if why is not None:
        notes.append(why)
    scenarios = []
    with Lab(log_dir=root / "lab-logs", env={"PYTHONPATH": str(ROOT)}) as lab:
        wl = WanLab(lab, plan.queue_ms, plan.path, plan.up_factor)
        print("membership: network-only daemons on the same hosts", file=sys.stderr, flush=True)
        members = membership_only(wl, root / "members", plan, 15.0 if plan.quick else 30.0)
        print(f"  {statistics.fmean(members.values()):.0f} B/s sent per host", file=sys.stderr, flush=True)
        print("calibration: Starling on unshaped links", file=sys.stderr, flush=True)
        unshaped = run_starling(wl, root / "calib", plan, "unshaped", {}, keys, None, initial_val, plan.calib_s)
        step_s = 1 / unshaped.mean("rate")
        measured = unshaped.bytes_per_outer is not None
        derivation = Derivation(params, step_s, unshaped.bytes_per_outer if measured else 4.0 * params,
                                measured, bc.inner_steps)
        print(derivation.text(), file=sys.stderr, flush=True)
        notes.append(membership_note(unshaped))
        rate = statistics.fmean(members.values())
        notes.append(f"The swarm's membership and gossip traffic alone ({N} network-only daemons and the bootstrap "
                     f"node on the same hosts, no exchange): {rate:.0f} B/s sent per host ({rate * 8 / 1e6:.3f} Mbit/s; "
                     f"{rate * 8 / 1e6 / derivation.rate_mbit:.0%} of the derived link rate). It does not shrink "
                     "with the model: on the scaled links it takes a share that it would not take on real ones "
                     f"({rate * 8 / 1e6 / REF_RATE_MBIT:.2%} of {REF_RATE_MBIT:g} Mbit/s).")
        alone = None
        if plan.alone:
            print("alone: each trainer in a swarm of its own", file=sys.stderr, flush=True)
            alone = run_starling(wl, root / "alone", plan, "alone", {}, keys, None, initial_val, plan.seconds,
                                 alone=True)
        for leg in plan.legs():
            wl.path, wl.up_factor = leg.path, leg.up_factor
            leg_tag = leg.path.tag() + ("-home" if leg.up_factor != 1 else "")
            for rate_text in leg.rates:
                rate = round(derivation.rate_mbit, 3) if rate_text == "auto" else float(rate_text)
                for name in plan.scenarios:
                    rates = [rate] * N if name == "uniform" else [rate] * (N - 1) + [rate / SLOW_FACTOR]
                    tag = f"{name}-{rate:g}mbit{leg_tag}"
                    print(f"{tag}:" + (f" (queues of {plan.queue_ms:g} ms)" if plan.queue_ms is not None else ""),
                          file=sys.stderr, flush=True)
                    rows = [starling_row(unshaped, None, "Starling defaults, unshaped links (reference)", True)]
                    hm_notes: list[str] = []
                    runs = []
                    twins: list[StarlingRun] = []
                    for label, sets in variants:
                        run = run_starling(wl, root / f"{tag}-{len(runs)}", plan, f"{tag}-{label}", sets, keys, rates,
                                           initial_val, plan.seconds)
                        runs.append(run)
                        rows.append(starling_row(run, unshaped, f"Starling {label}"))
                        if label == "defaults" and not leg.path.is_flat:
                            # Its zero-latency twin: the same rates, no delay line, in the same run (issue #50).
                            wl.path = PathShape()
                            try:
                                twin = run_starling(wl, root / f"{tag}-twin", plan, f"{tag}-{label}-twin", sets, keys,
                                                    rates, initial_val, plan.seconds)
                            finally:
                                wl.path = leg.path
                            twins.append(twin)
                            rows.append(starling_row(twin, unshaped, TWIN_ROW))
                    if alone is not None:
                        rows.append(starling_row(alone, unshaped, ALONE_ROW))
                    if hm_python is not None:
                        try:
                            hm = run_hivemind(wl, root / f"{tag}-hivemind", hm_python, plan, peer_ids, rates,
                                              initial_val, params, runs[0].seconds if runs else plan.seconds,
                                              f"{tag}-hivemind")
                        except (BenchError, LabError, OSError, ValueError, KeyError, StopIteration,
                                subprocess.SubprocessError) as e:
                            lines = str(e).strip().splitlines() or [type(e).__name__]
                            print(f"  hivemind could not run: {str(e).strip()}", file=sys.stderr, flush=True)
                            hm_notes.append(f"hivemind could not run ({tag}): {lines[0]}"
                                            + (f" (last log line: {lines[-1].strip()})" if len(lines) > 1 else ""))
                        else:
                            rows.append(hivemind_row(hm, unshaped))
                            hm_notes.append(hivemind_note(hm))
                    cols: list[Collective] = []
                    kinds = [(dtype, False) for dtype in plan.allreduce] if plan.composed else []
                    kinds += [(plan.diloco_compression, True)] if diloco_c is not None and plan.diloco_compression else []
                    for dtype, compressed in kinds:
                        estimate = collective_bytes(params, dtype, compressed) * 8 / (min(rates) * 1e6)
                        steps = 1 if plan.quick or estimate > 150 else 2
                        cols.append(time_collective(wl, plan, peer_ids, rates, steps, params, dtype, compressed))
                        rows += composed_rows(ddp.curve, diloco_c if compressed else diloco.curve, cols[-1],
                                              bc.inner_steps)
                    target = choose_target(rows)
                    wall = runs[0].seconds if runs else plan.seconds
                    png = out_dir / f"wan-{tag}.png"
                    title = (f"{N} trainers, links {', '.join(f'{r:g}' for r in rates)} Mbit/s ({name}); "
                             f"{params / 1e6:.2f}M params, H = {bc.inner_steps}")
                    try:
                        plot(rows, target, title, png)
                    except ImportError as e:
                        notes.append(f"no plot: {e}")
                        png = None
                    sc_notes = [
                        (f"DiLoCo + {col.dtype}, all-gather of the encoded Deltas" if col.compressed
                         else f"DDP and DiLoCo, {col.dtype} all-reduce")
                        + f": timed over {col.steps} step(s) and extrapolated "
                        f"to the run, {col.allreduce_bytes / 1e6:.2f} MB sent per rank per "
                        f"{'all-gather' if col.compressed else 'all-reduce'}; an inner "
                        f"step of the gloo ranks took {col.compute_s:.3f} s of compute, the Starling workers' "
                        f"unshaped {derivation.step_s:.3f} s (the worker also evaluates after each outer step and "
                        "shares the machine with its daemon)" for col in cols]
                    sc_notes += [membership_note(run) for run in runs] + hm_notes
                    sc_notes += [note for note in (phases_note(run) for run in (*runs, *twins)) if note]
                    scenarios.append(Scenario(name, rates, rows, target, wall, png, sc_notes, leg))
                    print(scenario_table(rows, target, wall), file=sys.stderr, flush=True)
    return derivation, unshaped, scenarios, notes


def membership_only(wl: WanLab, root: Path, plan: Plan, seconds: float) -> dict[str, float]:
    """Bytes per second each trainer host sends when its daemon is a network-only member (`--no-train`) of a
    swarm of the bootstrap node and the N hosts: the membership and gossip traffic alone, no exchange at all
    (timed after a settling period; unshaped links)."""
    wl.shape(None)
    swarm = f"wan-{uuid.uuid4().hex[:8]}"
    daemons: list[LabDaemon] = []
    with contextlib.ExitStack() as stop:
        stop.callback(stop_daemons, daemons)
        daemons.append(start_daemon(wl.boot, root / "boot", ["--swarm", swarm, "--no-train"], name="members-boot",
                                    timeout=plan.startup_s))
        join = ["--bootstrap", f"/ip4/{wl.boot.ip}/tcp/{PORT}/p2p/{daemons[0].peer_id}"]
        daemons += [spawn_daemon(h, root / h.name, ["--swarm", swarm, "--no-train", *join], name=f"members-{h.name}")
                    for h in wl.hosts]
        for d in daemons[1:]:
            d.wait(lambda s: bool(s.get("addrs")), plan.startup_s, "start-up")
        time.sleep(min(15.0, seconds))  # connections, DHT bootstrap, the first state exchange
        c0, t0 = wl.counters(), time.monotonic()
        time.sleep(seconds)
        c1, t1 = wl.counters(), time.monotonic()
    return {k: (c1[k][0] - c0[k][0]) / (t1 - t0) for k in c1}


def phases_note(run: StarlingRun) -> str | None:
    """Where each trainer's asked exchanges spent their time (median per phase, seconds and round trips):
    issue #50's split of an exchange, from `sync.last_asked` at the status polls."""
    parts = []
    for n in run.nodes:
        if not n.asked:
            continue
        secs, rtts = n.phase_medians()
        fixed = sum(v for k, v in secs.items() if k != "transfer")
        fixed_rtt = sum(v for k, v in rtts.items() if k != "transfer") if rtts else None
        parts.append(f"{n.name} ({len(n.asked)} seen): "
                     + ", ".join(f"{k} {v:.2f}" + (f" ({rtts[k]:.1f})" if rtts else "") for k, v in secs.items())
                     + f"; all but the transfer {fixed:.2f} s" + (f" ({fixed_rtt:.1f} RTT)" if fixed_rtt is not None else ""))
    if not parts:
        return None
    return (f"{run.label}: the phases of each trainer's asked exchanges, median s (RTT), from `sync.last_asked` at "
            "the status polls (node/averaging/phases.py): " + "; ".join(parts))


def membership_note(run: StarlingRun) -> str:
    """How much of the link the swarm's own traffic took: bytes sent while a node ran no exchange, and the
    link bytes beyond the averaging payload (headers, ACKs, membership, gossip, pairing)."""
    quiet_s = sum(n.quiet_s for n in run.nodes)
    quiet_rate = sum(n.quiet_bytes for n in run.nodes) / quiet_s if quiet_s else None
    sent = sum(n.link_sent for n in run.nodes)
    payload = sum(n.avg_sent for n in run.nodes)
    shares = [n.quiet_bytes / n.quiet_s / (rate * 1e6 / 8)
              for n, rate in zip(run.nodes, run.rates or [], strict=False) if n.quiet_s]
    quiet_text = ("no poll interval without an exchange" if quiet_rate is None else
                  f"{quiet_rate:.0f} B/s per node while it ran no exchange ({quiet_s:.0f} node-seconds sampled"
                  + (f"; up to {max(shares):.0%} of a node's own link" if shares else "") + ")")
    other = f"{1 - payload / sent:.1%}" if sent else "-"
    return (f"{run.label}: the swarm's own traffic: {quiet_text}; link bytes sent beyond the averaging payload "
            f"(sync.bytes_sent): {other} of {sent / 1e6:.1f} MB")


def render(plan: Plan, derivation: Derivation, scenarios: list[Scenario], notes: list[str], command: str,
           wall: float, png_prefix: str) -> str:
    bc = plan.bench
    cfg = ", ".join(f"{k}={v}" for k, v in plan.train().items())
    parts = [
        section_of(plan),
        f"Command: `{command}` ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {wall / 60:.1f} min wall, on a "
        f"{os.cpu_count()}-core {platform.machine()} machine shared with other jobs, {platform.system()} "
        f"{platform.release()}; torch {torch.__version__}).",
        f"{N} trainers, each in its own network-lab namespace behind its own link shaped with tc tbf both ways "
        f"(each end of its veth; {queue_text(plan.queue_ms)}), a network-only bootstrap node on an unshaped link; "
        + (f"each upload at {plan.up_factor:g} of the download rate (a home line); " if plan.up_factor != 1 else "")
        + f"{plan.path.text()} (the gloo all-reduces of the baselines are timed on the same links). Task stdlib-lm with "
        f"{'the daemon default model' if plan.model == 'default' else 'bench/convergence.py model'} "
        f"({'quick: a tiny one; ' if plan.quick else ''}train options {cfg}; everything else the shipped "
        f"defaults, nothing about the link). Every worker and every gloo rank runs in its own cgroup v1 cpu "
        f"group at {plan.cap_pct:g}% of one core; the CPU column says what each got. Data shards: the same "
        "4 PeerIDs in every run and in the simulation.",
        derivation.text(),
        f"How each contender is timed. Starling: real daemons, {plan.seconds:.0f} s from when all 4 trainers train; its "
        "loss is the mean over the trainers of each one's latest validation loss (the worker's evaluation after "
        "each outer step). DDP and DiLoCo are composed: their loss against the inner step comes from "
        f"bench/convergence.py's simulation (same shards, model, schedule, H; {bc.total_steps} inner steps), their "
        "seconds per step from 4 gloo ranks in the same namespaces, links and caps, each training the model "
        f"and all-reducing its gradient vector in {' and in '.join(plan.allreduce)} (a row pair each; the bf16 rows "
        "take the fp32 simulation's loss, which bf16 rounding moves by less than 0.005 here; DDP: one inner step "
        "+ one all-reduce per step; DiLoCo: H inner steps + one all-reduce of the same size per outer step), "
        "timed over 1-2 steps and extrapolated to the whole run"
        + (f"; DiLoCo + {plan.diloco_compression}: DiLoCo under that preset's Delta codec with error feedback "
           "(SparseLoCo's setting; bench/compression.py's simulation, same shards and schedule), each rank's encoded "
           "Delta all-gathered by gloo and the sum decoded, the codec's time counted with the all-gather"
           if plan.composed and plan.diloco_compression else "")
        + ". Bytes: each host's link counters "
        "(Starling), bytes per all-reduce x all-reduces (the others). Target loss: the lowest loss every "
        "contender reaches (the highest of their best losses), so that each has a time to it; the loss at "
        "equal wall time is the other view (both interpolated linearly between evaluations: DDP's every "
        f"{max(1, bc.inner_steps // 5)} steps, DiLoCo's and Starling's after each outer step). Share of the unshaped inner-step rate: Starling's trainers' "
        "inner steps per second against the unshaped run's mean over its trainers (mean, range); DDP/DiLoCo: compute "
        "over step time." + (" hivemind: real peers for the same wall time as Starling, from a common start; "
                             "its loss and bytes measured as Starling's, its share of the unshaped rate as "
                             "Starling's (local steps per second against the unshaped Starling run's)."
                             if any(r.label == HIVEMIND_ROW for sc in scenarios for r in sc.rows) else "")
        + (f" {ALONE_ROW}: the same {N} daemons and workers for the same time, each in a swarm of its own (no "
           "bootstrap node, so every outer step solo), on unshaped links: what each trainer's model would be had "
           "it not joined." if plan.alone else ""),
    ]
    for sc in scenarios:
        head = (f"### {sc.name}: links {', '.join(f'{r:g}' for r in sc.rates)} Mbit/s"
                + (f" (one link {SLOW_FACTOR:g}x slower)" if sc.name == "one-slow" else "")
                + (f", queues of {plan.queue_ms:g} ms" if plan.queue_ms is not None else ""))
        body = [head, "", scenario_table(sc.rows, sc.target, sc.wall), ""]
        body += [f"- {n}" for n in sc.notes]
        body += ["", "Targets (issues #23 and #50), shipped defaults:", "",
                 *verdicts(sc.name, sc.rows, sc.target, plan.twin_tolerance)]
        if sc.png is not None:
            body += ["", f"![loss against wall time, {sc.name}]({png_prefix}{sc.png.name})"]
        parts.append("\n".join(body))
    if notes:
        parts.append("Notes:\n\n" + "\n".join(f"- {n}" for n in notes))
    return "\n\n".join(parts) + "\n"


def scenario_record(sc: Scenario, plan: Plan, derivation: Derivation, command: str, tree: str) -> dict[str, Any]:
    """One scenario's raw results as a JSON record: every row whole (curves, bytes, shares), the link and path it
    ran on, the target, and where it came from."""
    leg = sc.leg or plan
    return {
        "bench": "wan", "section": section_of(leg), "scenario": sc.name, "rates_mbit": sc.rates,
        "path": dataclasses.asdict(leg.path), "up_factor": leg.up_factor, "seconds": plan.seconds,
        "cap_pct": plan.cap_pct, "model": plan.model, "config": dataclasses.asdict(plan.bench),
        "target": sc.target, "wall": sc.wall, "notes": sc.notes, "rows": [dataclasses.asdict(r) for r in sc.rows],
        "derivation": dataclasses.asdict(derivation), **provenance(command, tree),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--collective-rank"]:
        collective_rank(json.loads(argv[1]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (tiny model, uniform 2 Mbit/s, short); "
                        "never writes docs")
    parser.add_argument("--rate-mbit", default=None, help="comma-separated link rates: Mbit/s or 'auto' (derived; "
                        "default auto; quick 2)")
    parser.add_argument("--scenarios", default=None, help=f"comma-separated: {', '.join(SCENARIOS)} (default both; "
                        "quick uniform)")
    parser.add_argument("--starling", default=None, help="Starling variants, comma-separated: 'defaults' or "
                        "'section.option=value[+...]' (default: defaults, plus each sync.compression preset once "
                        "the option exists)")
    parser.add_argument("--seconds", type=float, default=None, help="each Starling run (default 240; quick 40)")
    parser.add_argument("--calib-seconds", type=float, default=None, help="the unshaped run (default 90; quick 20)")
    parser.add_argument("--cap", type=float, default=35.0, help="every worker's cpu quota, %% of one core (35)")
    parser.add_argument("--model", choices=("bench", "default"), default="bench",
                        help="bench: bench/convergence.py's model (0.47M params, the issue's trial); default: the "
                        "daemon's default model (slower)")
    parser.add_argument("--outer-steps", type=int, default=None, help="simulated outer steps (default 20)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the simulation (1: on a loaded machine a second one spins)")
    parser.add_argument("--hivemind", choices=("auto", "off"), default="auto",
                        help="auto: hivemind's collaborative optimizer as a contender where bench/.venv-hivemind "
                        "exists (bench/sync.py --parts 3 creates it), otherwise a note; off: leave it out")
    parser.add_argument("--out", type=Path, default=None, help="where PNGs go without --write-docs (default a temp dir)")
    parser.add_argument("--queue-ms", type=float, default=None,
                        help="a shallow queue on each shaped link: this many ms of traffic at the link rate (GSO "
                        "capped to one frame so the bucket can be small); default tbf's deep queue, which holds "
                        "a 64 KiB GSO packet (6.6 s at 0.08 Mbit/s)")
    parser.add_argument("--rtt-ms", type=float, default=0.0,
                        help="round trip between trainers, added by the lab's delay line on every shaped link (0)")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="jitter of that round trip, +- ms (0)")
    parser.add_argument("--loss", type=float, default=0.0, help="packet loss each way between trainers, 0.005 = 0.5%% (0)")
    parser.add_argument("--link", default=None,
                        help="issue #50's scenarios, comma-separated (each a section of its own; the simulation, "
                             "calibration and trainers-alone row are shared): each sets the rate and the path in "
                             "place of --rate-mbit, --rtt-ms, --jitter-ms, --loss (and a home line's slower upload); "
                             + "; ".join(f"{k}: {v.text()}" for k, v in LINKS.items()).replace("%", "%%"))
    parser.add_argument("--composed", choices=("on", "off"), default="on",
                        help="the composed DDP and DiLoCo rows (their simulation takes ~15 min on 2 cores); off: "
                             "Starling against its twin and its trainers alone only")
    parser.add_argument("--allreduce", default="fp32,bf16",
                        help="the composed rows' all-reduce dtypes, comma-separated (fp32, bf16): a DDP and a DiLoCo "
                             "row for each, each timed in the lab; the verdicts read the strongest")
    parser.add_argument("--diloco-compression", default=DILOCO_COMPRESSION, metavar="PRESET",
                        help="DiLoCo's compressed row: a lossy sync.compression preset (one on trial included) whose "
                             "Delta codec DiLoCo all-gathers, simulated and timed in the lab as the others "
                             f"(default {DILOCO_COMPRESSION}, SparseLoCo-like); off: left out")
    parser.add_argument("--alone", choices=("auto", "on", "off"), default="auto",
                        help="also run each trainer alone (no swarm) for the same time: auto = with latency")
    parser.add_argument("--write-docs", action="store_true", help=f"write `{SECTION}` of {DOCS.name} and its PNGs")
    parser.add_argument("--jsonl", type=Path, default=None,
                        help=f"append each scenario's raw rows here (default {RESULTS.relative_to(ROOT)}; a --quick "
                             "run writes none unless given)")
    args = parser.parse_args(argv)
    names = [x.strip() for x in (args.link or "").split(",") if x.strip()]
    unknown = [x for x in names if x not in LINKS]
    if unknown:
        parser.error(f"--link: unknown {', '.join(unknown)}; choose from {', '.join(sorted(LINKS))}")
    links = [LINKS[x] for x in dict.fromkeys(names)]
    if links:
        if args.rate_mbit or args.rtt_ms or args.jitter_ms or args.loss:
            parser.error("--link sets the rate and the path: leave out --rate-mbit, --rtt-ms, --jitter-ms and --loss")
        named = links[0]  # the plan's own fields; each leg takes its link's (Plan.legs)
        args.rate_mbit = f"{named.rate_mbit:g}"
        args.rtt_ms, args.jitter_ms, args.loss = named.path.rtt_ms, named.path.jitter_ms, named.path.loss
    try:
        path = PathShape(args.rtt_ms, args.jitter_ms, args.loss)
        scenarios = [s.strip() for s in (args.scenarios or ("uniform" if args.quick else ",".join(SCENARIOS))).split(",")]
        if not scenarios or any(s not in SCENARIOS for s in scenarios):
            raise ValueError(f"--scenarios: choose from {', '.join(SCENARIOS)}")
        rates = [r.strip() for r in (args.rate_mbit or ("2" if args.quick else "auto")).split(",") if r.strip()]
        if not rates or any(r != "auto" and not 0.01 <= float(r) <= 10000 for r in rates):
            raise ValueError("--rate-mbit: 'auto' or numbers between 0.01 and 10000")
        variants = parse_variants(args.starling or default_variants())
        if not variants:
            raise ValueError("--starling: no variant")
        allreduce = tuple(dict.fromkeys(x.strip() for x in args.allreduce.split(",") if x.strip()))
        if not allreduce or any(x not in ALLREDUCE_DTYPES for x in allreduce):
            raise ValueError(f"--allreduce: one or more of {', '.join(ALLREDUCE_DTYPES)}")
        diloco_compression = None if args.diloco_compression == "off" else args.diloco_compression
        if diloco_compression is not None:
            known = [*PRESETS, *EXPERIMENTAL]
            if diloco_compression not in known or not compression_preset(diloco_compression).lossy:
                raise ValueError(f"--diloco-compression: a lossy preset ({', '.join(k for k in known if k != 'none')}) "
                                 "or off")
    except ValueError as e:
        parser.error(str(e))
    if not 1 <= args.cap <= 100:
        parser.error("--cap: between 1 and 100 (% of one core)")
    if args.queue_ms is not None and not 1 <= args.queue_ms <= 60_000:
        parser.error("--queue-ms: between 1 and 60000")
    plan = Plan(args.quick, bench_for(args.model, args.quick, args.outer_steps), args.model,
                args.seconds or (40.0 if args.quick else 240.0), args.calib_seconds or (20.0 if args.quick else 90.0),
                240.0 if args.quick else 300.0, args.cap, rates, scenarios, variants,
                {"join_wait_s": 2} if args.quick else {}, args.hivemind, args.queue_ms, path,
                links[0].up_factor if links else 1.0, links[0].twin_tolerance if links else 0.03,
                args.alone == "on" or (args.alone == "auto" and not path.is_flat), links, args.composed == "on",
                allreduce, diloco_compression)
    reason = lab_unavailable() or tbf_unavailable()
    if reason is not None:
        print(f"bench/wan.py skipped: {reason}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    sweep_stale_caps()
    started = time.monotonic()
    tree = tree_id()  # the code that runs: read before the half hour the run takes, in which HEAD may move
    root = Path(tempfile.mkdtemp(prefix="starling-wan-"))
    writing = args.write_docs and not args.quick
    out_dir = DOCS.parent if writing else (args.out or Path(tempfile.mkdtemp(prefix="starling-wan-plots-")))
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        with sigterm_as_interrupt():
            derivation, _, results, notes = run_scenarios(plan, root, out_dir)
    except (BenchError, DaemonError, LabError) as e:
        print(f"error: {e}\n(logs kept in {root})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: every namespace, daemon and cgroup was removed (logs in {root})", file=sys.stderr)
        return 130
    command = ("python bench/wan.py " + " ".join(argv)).strip()
    jsonl = args.jsonl or (None if args.quick else RESULTS)
    if jsonl is not None:
        for sc in results:
            append_record(jsonl, scenario_record(sc, plan, derivation, command, tree))
        print(f"raw rows appended to {jsonl}", file=sys.stderr)
    for leg in plan.legs():  # a section per leg (named link), each with the scenarios run on it
        mine = [sc for sc in results if sc.leg == leg]
        text = render(leg, derivation, mine, notes, command, time.monotonic() - started,
                      "" if writing else str(out_dir) + "/")
        print(text)
        if writing:
            replace_section(DOCS, section_of(leg), text)
            print(f"written to {DOCS}: {section_of(leg)}", file=sys.stderr)
    print(f"plots: {', '.join(str(s.png) for s in results if s.png)}", file=sys.stderr)
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
