# Starling — entry points. `make run` and `make test` each do the whole install first.
SHELL := /bin/bash
PY_SYS ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.starling-installed
APT_PKGS := libgmp-dev libnetfilter-queue-dev nftables iproute2 iptables systemd docker-compose
RUN_SECONDS ?= 0
PYTEST_ARGS ?=

.PHONY: install sysdeps run test test-fast test-long test-bench-smokes lint bench bench-convergence bench-compression-long bench-phi-schemes bench-sync bench-hivemind bench-nat bench-nat-latency bench-swarm bench-wan bench-wan-latency bench-delayline bench-congestion bench-exchange-rtt bench-swim-wan bench-membership bench-scale-sim bench-scale bench-swim-transport bench-adversary bench-memory bench-gpu test-gpu chaos fuzz swarm-up swarm-down image test-compose clean

install: $(STAMP)

# Debian packages: libgmp-dev for libp2p's fastecdsa build, nftables/iproute2/iptables for the network lab,
# libnetfilter-queue-dev for its delay line (the netfilterqueue package builds against it).
sysdeps:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian packages:$$missing"; \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else echo "warning: missing Debian packages:$$missing (run as root, or install them yourself)"; fi; \
	fi

$(STAMP): pyproject.toml | sysdeps
	@test -x $(PY) || $(PY_SYS) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: the local CPU wheel; an unpinned torch would pull GBs of CUDA packages.
	$(PIP) install -q torch==2.13.0
	# hf: transformers for the Hugging Face task (node/tasks/hf_causal_lm.py); wandb: the offline W&B run
	# (node/ops/wandb_log.py). Both optional extras for users, installed here so that their tests run.
	$(PIP) install -q -e '.[dev,hf,wandb]'
	$(PIP) check
	@touch $(STAMP)

# The embedded default: a local swarm (bootstrap + 3 peers) on 127.0.0.1 with a live status view.
run: install
	$(PY) -m node.ops.localswarm --peers 3 --seconds $(RUN_SECONDS)

test: install
	$(PY) -m pytest -q -rfEs -m "not long" --durations=20 $(PYTEST_ARGS)

# Unit and property tests only (no multi-process, no lab): a quick loop while editing.
test-fast: install
	$(PY) -m pytest -q -m "not slow and not lab and not long" $(PYTEST_ARGS)

# The long runs (chaos run, benchmark smoke tests), kept out of `make test`.
test-long: install
	$(PY) -m pytest -q -m long $(PYTEST_ARGS)

# The smoke runs of the benches that write docs sections and are too long for `make test` (issue #52, item 4:
# CI runs the code that writes the figures): sync, scale, membership, swarm and wan, each `--quick` or tiny,
# about 12 minutes on 2 cores; `.ci/run` runs them after `make test`. (The other benches' smokes are in
# `make test`; the chaos run and the compose test stay in `make test-long`.)
BENCH_SMOKES = tests/test_bench_sync.py tests/test_bench_scale.py tests/test_bench_membership.py \
	tests/test_bench_swarm.py tests/test_bench_wan.py
test-bench-smokes: install
	$(PY) -m pytest -q -rfEs -m long --durations=10 $(BENCH_SMOKES) $(PYTEST_ARGS)

# On a GPU host (issue #28): GPU_PY is a Python whose torch is a CUDA build with the project's dependencies
# (the venv's pinned torch is the CPU wheel). The `gpu` tests, then every GPU check of bench/gpu.py, each under
# its own time limit, into bench-gpu-out/ (then: $(PY) bench/gpu.py --write-docs --from bench-gpu-out).
GPU_PY ?= $(PY)
test-gpu:
	$(GPU_PY) -m pytest -q -m gpu -rfEs tests/test_gpu.py

bench-gpu:
	$(GPU_PY) bench/gpu.py --out bench-gpu-out

# ruff, then the import layers (pyproject.toml's [tool.importlinter] contracts:
# p2p <- protocols <- node <- starling_testing, and node/'s rooms), then mypy on the status schema and the
# modules that build or read the status ([tool.mypy]).
lint: install
	$(VENV)/bin/ruff check p2p protocols node starling_testing tests bench tools
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# Benchmarks print ratios measured in one run and write their sections of docs/benchmarks.md.
bench: install
	$(PY) bench/discovery.py --write-docs
	$(PY) bench/datapath.py
	$(PY) bench/sync.py --write-docs
	$(PY) bench/convergence.py --write-docs

bench-convergence: install
	$(PY) bench/convergence.py --write-docs

bench-sync: install
	$(PY) bench/sync.py --write-docs

# Compression over the long run (issue #51; section "Compression over the long run"): each preset against bf16
# NoLoCo, DiLoCo in bf16 and DiLoCo with the same Delta compressor, 200 outer steps x 3 seeds, two runs at a
# time; about 25 min per run on a core, so hours: it resumes from bench/results/compression_long.jsonl, which
# keeps every finished run. COMPRESSION_ARGS="--variants noloco:none,noloco:high --seeds 0" narrows it.
COMPRESSION_ARGS ?=
bench-compression-long: install
	$(PY) bench/compression_long.py $(COMPRESSION_ARGS) --write-docs

# Ways to send phi for compressed NoLoCo, screened over the first 40 outer steps of the long run's schedule
# (issue #51, item 3): about 15 min of a core per scheme; PHI_ARGS="--schemes ..." picks them.
PHI_ARGS ?=
bench-phi-schemes: install
	$(PY) bench/phi_schemes.py $(PHI_ARGS) --write-docs

# Real daemons on 127.0.0.1 (mixing, a throttled half via cgroup v1, convergence beside the simulation);
# about 30 min on 2 cores. Throttling needs root. --fast-cap 50 caps the hetero scenario's fast workers at half
# a core too: on one shared machine the slow nodes' daemons would otherwise take compute from the fast workers,
# which separate machines never do, and "adding hardware never hurts" would be measured with less hardware.
bench-swarm: install
	$(PY) bench/swarm.py --fast-cap 50 --write-docs

# Time to a loss over slow links (section "Over slow links" of docs/benchmarks.md): 4 trainers in the network
# lab behind tbf-shaped links, real daemons against DDP and DiLoCo (composed: the simulation's loss per step x
# gloo all-reduces timed in the lab); both scenarios at the derived link rate, about 30 min on 2 cores. Needs
# root, tc tbf and cgroup v1 cpu. The issue's acceptance rates: make bench-wan WAN_ARGS="--rate-mbit 0.4,2".
WAN_ARGS ?=
bench-wan: install
	$(PY) bench/wan.py $(WAN_ARGS) --write-docs

# Issue #50's latency scenarios (sections "Over slow links with latency: ..."): each named link beside its
# zero-latency twin, and each trainer alone, in one run (the calibration and the alone row shared; no DDP or
# DiLoCo rows: `make bench-wan WAN_ARGS="--link ..."` has them); about 10 min per link after 7 min of shared
# work on 2 cores, root. One link: WAN_LINKS=2mbit-200ms-loss.
WAN_LINKS ?= 20mbit-100ms,2mbit-200ms-loss,100mbit-300ms-loss,home-20-5-50ms
bench-wan-latency: install
	$(PY) bench/wan.py --link $(WAN_LINKS) --scenarios uniform --starling defaults --hivemind off --composed off --write-docs

# The lab's delay line against its settings (section "The lab's delay line"): ping RTT from 10 to 300 ms, loss,
# TCP through a 20 Mbit/s link with 50 and 100 ms of RTT against tbf alone, the line's CPU; about 2 min, root.
bench-delayline: install
	$(PY) bench/delayline.py --write-docs

# An averaging exchange's fixed cost in round trips at 0, 100 and 300 ms of RTT (and 300 +- 50 ms with 1% loss),
# against the tree before the cut in the same run (section "An exchange's round trips"); about 4 min, root.
bench-exchange-rtt: install
	$(PY) bench/exchange_rtt.py --before 407b0ea --write-docs

# SWIM membership with 16 network-only daemons in lab hosts, 300 ms of RTT between members, 50 ms of jitter and
# 1% loss each way, for 10 minutes (section "Membership over long, lossy links"); about 13 min, root.
bench-swim-wan: install
	$(PY) bench/swim_wan.py --write-docs

# The swarm's own traffic: what 5 network-only daemons on loopback send per second, by protocol (section
# "The swarm's own traffic"); about 2 min.
bench-membership: install
	$(PY) bench/membership.py --write-docs

# Membership and pairing at 1,000 and 10,000 nodes, in-process (issue #24; section "Scale: simulation"): the
# SWIM core of node/swarm/membership.py on a simulated network with churn; about 8 min on one core, ~4.5 GB of RAM.
bench-scale-sim: install
	$(PY) bench/scale_sim.py --write-docs

# Membership at scale (section "Scale: real daemons"): 16, 32 and 64 network-only daemons on 127.0.0.1, one
# bootstrap node; time until every node knows every member, idle CPU, traffic and RSS per daemon, connections,
# and 3 minutes of churn each; about 20 min on 2 cores. SCALE_ARGS="--sizes 128" for more (RAM: ~120 MB each).
SCALE_ARGS ?=
bench-scale: install
	$(PY) bench/scale.py $(SCALE_ARGS) --write-docs

# What a SWIM ping/ack round trip costs on py-libp2p (a new stream, a long-lived stream, a new connection) and
# on UDP, priced per node per minute at the simulated rate (issue #24; section "Scale: SWIM's transport");
# under a minute.
bench-swim-transport: install
	$(PY) bench/swim_transport.py --write-docs

# Hostile averaging partners against a real victim, then 1 GiB pushed past a stream's receive window into a
# real daemon (docs/reliability.md); about 3 min.
bench-adversary: install
	$(PY) bench/adversary.py --write-docs

# Peak RSS of daemon + worker at 10M and 100M parameters, two daemons averaging (section Memory of
# docs/benchmarks.md; 1B extrapolated), then the same with one node's worker a 2-process group (section
# Memory of a worker group); about 8 min on 2 cores, ~16 GB of RAM at its peak.
bench-memory: install
	$(PY) bench/memory.py --before bench/memory_before.json --write-docs
	$(PY) bench/memory.py --group --before bench/memory_group_before.json --write-docs
	$(PY) bench/donor_memory.py --write-docs

bench-hivemind: install
	$(PY) bench/sync.py --parts 3

bench-nat: install
	$(PY) bench/nat.py --write-docs

# One TCP flow over 100 ms (no loss, 0.5%) and 300 ms (1%) paths, its sender on CUBIC then on BBR, which the side
# channel asks for (section "Congestion control over long, lossy paths"); about 3 min, root.
bench-congestion: install
	$(PY) bench/congestion.py --write-docs

# Hole punching with 100 and 300 ms of round trip between the two NATed daemons (section "NAT with latency");
# about 5 min, root.
bench-nat-latency: install
	$(PY) bench/nat.py --parts 1 --rtt-ms 100,300 --jitter-ms 10 --write-docs

# Long runs, outside `make test`. The chaos run ends by starting a trainer with a fresh identity that must join
# the churned swarm (check (f)). Issue #26's acceptance run: make chaos CHAOS_ARGS="--daemons 8 --minutes 30".
CHAOS_ARGS ?=
chaos: install
	$(PY) bench/chaos.py $(CHAOS_ARGS) --write-docs

fuzz: install
	$(PY) bench/fuzz.py --n 100000

# The node image (docker/Dockerfile). OFFLINE=1 needs no registry and no torch index: a base image made from
# Debian packages (docker/base-image.sh: debootstrap + docker import, root; built once, kept as BASE_IMAGE_OFFLINE)
# and every Python package from a local wheelhouse (docker/wheelhouse.sh: this machine's pip, its CPU torch).
# Plain `make image` is the internet build (python:3.11-slim from Docker Hub, torch from download.pytorch.org).
IMAGE ?= starling:latest
OFFLINE ?= 0
DEBIAN_RELEASE ?= $(or $(shell . /etc/os-release 2>/dev/null && echo $$VERSION_CODENAME),bookworm)
BASE_IMAGE_OFFLINE ?= starling-base:$(DEBIAN_RELEASE)
WHEEL_PY ?=
image:
ifeq ($(OFFLINE),1)
	@docker image inspect $(BASE_IMAGE_OFFLINE) >/dev/null 2>&1 || DEBIAN_RELEASE=$(DEBIAN_RELEASE) docker/base-image.sh $(BASE_IMAGE_OFFLINE)
	PY="$(WHEEL_PY)" docker/wheelhouse.sh
	docker build -f docker/Dockerfile --build-arg OFFLINE=1 --build-arg BASE_IMAGE=$(BASE_IMAGE_OFFLINE) -t $(IMAGE) .
else
	docker build -f docker/Dockerfile -t $(IMAGE) .
endif

# The compose swarm for real (docker/compose_test.py; outside `make test`; its time is in docs/benchmarks.md):
# starts dockerd if none runs (as root; installs docker.io first if missing; stops it after), builds the image
# offline, brings up bootstrap + 3 trainers, checks in the containers that every trainer averaged with >= 2
# partners, that health checks pass and the metrics answer, that a killed trainer is restarted and resumes,
# then `down`: every node exits 0 after draining, each trainer after its final checkpoint. Removes the
# containers, volumes, network and images it made; KEEP_IMAGE=1 keeps the images and the wheelhouse.
test-compose:
	$(PY_SYS) docker/compose_test.py $(if $(filter 1,$(KEEP_IMAGE)),--keep-image)

# docker-compose swarm (needs a Docker engine): one bootstrap/relay service and scalable trainers.
# COMPOSE is the `docker compose` v2 plugin when Docker has it, else the standalone `docker-compose`
# (what `make install` gets from Debian); evaluated only by these targets. Override: make swarm-up COMPOSE=...
TRAINERS ?= 3
COMPOSE ?= $(shell if docker compose version >/dev/null 2>&1; then echo "docker compose"; \
	elif command -v docker-compose >/dev/null 2>&1; then echo docker-compose; fi)
NO_COMPOSE := echo "error: neither 'docker compose' nor 'docker-compose' is installed (Debian: apt-get install docker-compose)" >&2; exit 2
# OFFLINE=1: the image from `make image OFFLINE=1`, and compose builds nothing (its build would need Docker Hub).
swarm-up:
	@[ -n "$(COMPOSE)" ] || { $(NO_COMPOSE); }
ifeq ($(OFFLINE),1)
	$(MAKE) --no-print-directory image OFFLINE=1 IMAGE=$(IMAGE)
	STARLING_IMAGE=$(IMAGE) $(COMPOSE) -f docker/docker-compose.yml up -d --no-build --scale trainer=$(TRAINERS)
else
	STARLING_IMAGE=$(IMAGE) $(COMPOSE) -f docker/docker-compose.yml up -d --build --scale trainer=$(TRAINERS)
endif

swarm-down:
	@[ -n "$(COMPOSE)" ] || { $(NO_COMPOSE); }
	STARLING_IMAGE=$(IMAGE) $(COMPOSE) -f docker/docker-compose.yml down

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .import_linter_cache .mypy_cache .hypothesis
