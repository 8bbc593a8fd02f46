"""Membership at scale with real daemons: how N network-only daemons on this machine find each other, what
an idle member costs once they have, and how the views recover under churn (issue #24, part 3).

For each N in ``--sizes``: one bootstrap daemon and N-1 others, all `starling run --no-train` processes on
127.0.0.1 with default settings (bench/membership.py's :class:`LoopbackSwarm`, traffic probe loaded). How
the others join (``--join``):

* ``bootstrap``: each is given only the bootstrap node's address. This is how Starling is deployed (the
  compose swarm, `make run`, the README: one or a few well-known bootstrap nodes in every config) and the
  hardest case for discovery: everything a node learns first comes through one node, which may be full.
* ``random``: each is given the bootstrap address and those of ``--few`` random earlier nodes, as when a
  swarm's operators hand out the addresses of nodes they already run, or members pass on invites.

Measured, in this order:

1. **Join**: from the moment the last daemon listens until every daemon holds every other as an alive member
   (polled with ``status`` every ``--poll`` seconds, one daemon after another: status calls cost CPU too),
   within ``--timeout``; meanwhile, which members any daemon ever showed as suspect.
2. **Settled window** (``--settle`` s after the join, then ``--window`` s, no status calls in it): CPU
   seconds per minute of each daemon (/proc/PID/stat), bytes per minute it sends (the traffic probe: TCP
   bytes after Noise and Yamux, and per protocol), the machine's CPU busy share (/proc/stat: on this shared
   2-core machine, what says the daemons were starved), RSS, and connections per daemon at the end; and, read
   once at its end from each daemon's ``swim.recent_suspects``, the members turned suspect anywhere since the
   last start, the join's polls having missed them (refuted between two polls) or after the join.
3. **Churn** (``--churn-rounds``, one a minute): a tenth of the daemons (never the bootstrap node) are
   SIGKILLed and restarted at once, same HOME, identity and port; the time until the views agree again:
   every daemon holds every other as alive, with a record the other signed since its last start, and each
   restarted daemon has heard every other since its restart (its state file alone does not count).

``--profile DIR`` also profiles (cProfile, the main thread, on CPU time) the bootstrap daemon and three others (at most half the daemons)
over the settled window (bench/traffic_probe/sitecustomize.py), prints where their seconds went, by component,
and keeps their stats files in DIR. The profiler costs those daemons much of their CPU: the CPU figures leave
them out, and their profile's absolute seconds are inflated (shares are what to read).

``--trace`` keeps every status round of the join in the JSON: per daemon when it answered, the members it
held alive, why the others were missing (no record of them at all, record held but shown gone: in swim
mode SWIM never heard of them or holds them dead, or suspect), its connections, state sessions (ok,
failures by reason, refused as busy) and SWIM counters; with it the join's ``last_view_complete_s`` says when
the last daemon's view completed by its own status call (a round of 64 calls takes seconds on a busy
machine). ``--log-level info --keep-logs DIR`` keeps the daemons' logs (SWIM logs each suspicion's reason).

Usage: python bench/scale.py [--sizes 16 32 64] [--join bootstrap|random] [--churn-rounds 3] [--profile]
                             [--trace] [--log-level LEVEL] [--keep-logs DIR]
                             [--json PATH] [--set SECTION.OPTION=VALUE ...] [--write-docs]
       python bench/scale.py --from A.json B.json ... --write-docs   (render saved runs)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import pstats
import random
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import membership  # noqa: E402  (bench/membership.py, beside this script)
from membership import LoopbackSwarm  # noqa: E402
from records import RESULTS_DIR, keep_results, tree_id  # noqa: E402

from starling_testing.report import publish  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
SECTION = "## Scale: real daemons"
CLK_TCK = os.sysconf("SC_CLK_TCK")
#: Where a profiled daemon's seconds go: (component, what identifies its functions), first match wins, on
#: the cumulative time of these entry points (so nested work is counted once, in the outermost).
COMPONENTS = [
    ("control socket (status calls)", ("node/ops/control.py", "serve_control")),
    ("gossipsub heartbeat (mesh upkeep)", ("libp2p/pubsub/gossipsub.py", "heartbeat")),
    ("gossip: validate + merge records", ("node/swarm/replicator.py", "_validate_gossip")),
    ("gossip: receive, dedupe, forward", ("libp2p/pubsub/pubsub.py", "continuously_read_stream")),
    ("gossip: publish own heartbeat", ("node/swarm/replicator.py", "_publisher")),
    ("heartbeat: re-sign own record", ("node/swarm/replicator.py", "_heartbeat_loop")),
    ("anti-entropy sessions", ("node/swarm/replicator.py", "_session")),
    ("anti-entropy loop (probes, rounds)", ("node/swarm/replicator.py", "_anti_entropy_loop")),
    ("DHT: our lookups and announcements", ("p2p/discovery.py", "run")),
    ("DHT: our GET_PROVIDERS queries", ("p2p/discovery.py", "ask")),
    ("DHT: closest-peer walks", ("libp2p/kad_dht/peer_routing.py", "_query_single_peer_for_closest")),
    ("DHT: ADD_PROVIDER sent", ("libp2p/kad_dht/provider_store.py", "send_one")),
    ("DHT: answering others' queries", ("libp2p/kad_dht/kad_dht.py", "handle_stream")),
    ("DHT (other kad code)", ("libp2p/kad_dht/", "")),
    ("SWIM: receive and handle", ("node/swarm/swim_service.py", "_handle_stream")),
    ("SWIM: write", ("node/swarm/swim_service.py", "_writer")),
    ("SWIM: timers (probes)", ("node/swarm/swim_service.py", "_timers")),
    ("SWIM: watch connections", ("node/swarm/swim_service.py", "_watch_connections")),
    ("connection manager", ("p2p/connmgr.py", "run")),
    ("NAT service", ("node/swarm/nat.py", "run")),
    ("DCUtR auto-drive loop", ("libp2p/relay/circuit_v2/dcutr.py", "_auto_drive_loop")),
    ("learn member addresses", ("node/daemon.py", "_learn_member_addrs")),
    ("loss history (every member, every second)", ("node/daemon.py", "_keep_history")),
    ("ping, identify", ("libp2p/host/ping.py", "")),
    ("yamux (muxer)", ("libp2p/stream_muxer/yamux/yamux.py", "handle_incoming")),
    ("save state", ("node/swarm/replicator.py", "_save_loop")),
]


# --- reading the daemons -------------------------------------------------------------------------------------


def proc_cpu(pid: int | None) -> float | None:
    """User + system CPU seconds of a process so far (None if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, TypeError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_rss_mib(pid: int | None) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, TypeError):
        return None
    return None


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores so far (/proc/stat), for the machine's busy share over a window."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


_HANDED_OUT: set[int] = set()


def listen_port() -> int:
    """A free port below the kernel's ephemeral range, never one handed out before in this run. Ports are
    chosen when a daemon's address is made, before it starts: from the ephemeral range (the OS's free port),
    the outbound connections of 60 daemons already running took one before its daemon listened ("port
    already in use") in two runs of 64; and drawn at random below it, two of 64 daemons got the same port
    about one run in ten (two runs of 2026-11-27 failed so), since the port checked is free again until its
    daemon listens."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(1000):
        port = random.randrange(10000, max(10001, low))
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    return membership.free_port()


def peer_id(addr: str) -> str:
    return addr.rsplit("/p2p/", 1)[1]


class Views:
    """One round of ``status`` calls, one daemon after another, and what they say about membership."""

    def __init__(self, swarm: LoopbackSwarm, running: list[int], t0: float | None = None) -> None:
        self.ids = {i: peer_id(swarm.addr(i)) for i in running}
        self.status: dict[int, dict[str, Any] | None] = {}
        #: When each daemon answered, in seconds since ``t0`` (the last daemon listening): a round of 64
        #: status calls on a saturated machine takes seconds, so the round's end is not when a view was read.
        self.at: dict[int, float] = {}
        for i in running:
            self.status[i] = swarm.daemons[i].status(timeout=10)
            self.at[i] = time.monotonic() - (t0 or 0.0)

    def members(self, i: int) -> dict[str, dict[str, Any]]:
        return {m["peer_id"]: m for m in (self.status[i] or {}).get("members", [])}

    def alive_known(self, i: int) -> int:
        """Other daemons that daemon ``i`` holds as alive."""
        mine = self.members(i)
        return sum(1 for j, p in self.ids.items() if j != i and mine.get(p, {}).get("state") == "alive")

    def suspects(self, i: int) -> set[str]:
        return {p for p, m in self.members(i).items() if m["state"] == "suspect" and p in self.ids.values()}

    def recent_suspects(self, i: int) -> dict[str, float]:
        """The daemons that daemon ``i`` last turned suspect (swim mode), with when (Unix time): its status keeps
        the last 16, so a suspicion refuted before a poll, or in the settled window, still counts."""
        recent = ((self.status[i] or {}).get("swim") or {}).get("recent_suspects") or {}
        return {p: t for p, t in recent.items() if p in self.ids.values() and isinstance(t, (int, float))}

    def complete(self, i: int) -> bool:
        """Daemon ``i`` answered and holds every other daemon as alive."""
        return self.status[i] is not None and self.alive_known(i) == len(self.ids) - 1

    def missing(self, i: int) -> dict[str, list[str]]:
        """The other daemons daemon ``i`` does not hold as alive, by why: no record of it at all, its record
        held but the member shown gone (swim mode: SWIM never heard of it, or holds it dead), or suspect."""
        mine = self.members(i)
        out: dict[str, list[str]] = {"no_record": [], "gone": [], "suspect": [], "other": []}
        for j, p in self.ids.items():
            if j == i:
                continue
            m = mine.get(p)
            if m is None:
                out["no_record"].append(p)
            elif m["state"] != "alive":
                out[m["state"] if m["state"] in out else "other"].append(p)
        return out

    def trace_row(self, i: int) -> dict[str, Any]:
        """What daemon ``i`` said, for ``--trace``: its view, connections, state sessions and SWIM counters."""
        st = self.status[i]
        if st is None:
            return {"at": round(self.at.get(i, 0.0), 2), "answered": False}
        rep = (st.get("swarm_totals") or {}).get("replication") or {}
        swim_status = st.get("swim") or {}
        return {
            "at": round(self.at.get(i, 0.0), 2),
            "alive": self.alive_known(i),
            "missing": {k: len(v) for k, v in self.missing(i).items()},
            "connections": self.connections(i),
            "sessions_ok": rep.get("sessions_ok"),
            "session_failures": rep.get("session_failures"),
            "busy_refusals": rep.get("busy_refusals"),
            "records_received": rep.get("records_received"),
            "swim_members": swim_status.get("members"),
            "swim_suspects_raised": swim_status.get("suspects_raised"),
            "swim_dropped": swim_status.get("dropped"),
            "swim_loop_lag_max_s": swim_status.get("loop_lag_max_s"),
        }

    def connections(self, i: int) -> int | None:
        st = self.status[i]
        return None if st is None else len(st.get("connected_peers", []))

    def agree(self, since: dict[int, float]) -> bool:
        """Every daemon answered and holds every other as alive, with a record the other signed since its
        last start (``since``, wall time), heard since its own last start."""
        for i, st in self.status.items():
            if st is None:
                return False
            mine = self.members(i)
            for j, p in self.ids.items():
                m = mine.get(p)
                if j == i:
                    continue
                if m is None or m["state"] != "alive" or m["heartbeat"] < since[j] or m["last_seen"] < since[i]:
                    return False
        return True


def streams_over(before: dict[int, dict | None], after: dict[int, dict | None]) -> dict[str, int]:
    """Streams opened and accepted between two readings of the daemons' traffic probes, per protocol and
    summed over the daemons, most first (the probe's ``streams ...`` counters; a daemon not read at both ends
    is left out). Why: at 64 daemons what slowed the join was the streams queued at its busiest nodes."""
    total: dict[str, int] = {}
    for i, end in after.items():
        start = before.get(i)
        if start is None or end is None:
            continue
        for key, value in end.get("counts", {}).items():
            if key.startswith("streams "):
                name = key[len("streams "):]
                total[name] = total.get(name, 0) + value - start.get("counts", {}).get(key, 0)
    return dict(sorted(((k, v) for k, v in total.items() if v), key=lambda kv: (-kv[1], kv[0])))


def read_traffic(swarm: LoopbackSwarm, i: int) -> dict | None:
    """Daemon ``i``'s probe counters, or None where it has written none yet (it writes them every second)."""
    try:
        return swarm.traffic(i)
    except (OSError, ValueError):
        return None


def traffic_since(swarm: LoopbackSwarm, running: list[int], since: float, wait_s: float = 3.0) -> dict[int, dict | None]:
    """Each daemon's probe counters as written after ``since`` (monotonic: one clock for every process here),
    waiting up to ``wait_s`` for them. Why: the probe writes once a second, so counters read at once missed
    the last second's streams (a 3-daemon join, over in a second, showed none of its state streams opened)."""
    out: dict[int, dict | None] = {}
    deadline = time.monotonic() + wait_s
    for i in running:
        while True:
            out[i] = read_traffic(swarm, i)
            if (out[i] is not None and out[i].get("t", -math.inf) >= since) or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
    return out


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)} if values else {}


# --- one swarm ------------------------------------------------------------------------------------------------


def run_size(n: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Start N daemons, measure join, the settled window and churn; stop them."""
    # At most half of the daemons, so that some are left for the CPU figures.
    profiled = sorted({0, 1, n // 2, n - 1})[: max(1, n // 2)] if args.profile else []
    membership.free_port = listen_port  # type: ignore[attr-defined]
    swarm = LoopbackSwarm(root, f"scale{n}{args.join}", args.set)
    rng = random.Random(n)
    out: dict[str, Any] = {"n": n, "join_mode": args.join, "few": args.few, "cores": os.cpu_count(),
                           "timeout_s": args.timeout, "window_s": args.window, "command": args.command,
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        started_at: dict[int, float] = {}  # wall time of each daemon's (last) start

        def spawn(i: int, bootstrap: list[str]) -> None:
            started_at[i] = time.time()
            if i in profiled:
                swarm.env["STARLING_PROFILE_OUT"] = str(root / f"n{i}.prof")
                if args.profile_join:
                    swarm.env["STARLING_PROFILE_FROM_START"] = "1"
            swarm.spawn(i, bootstrap, log_level=args.log_level)
            swarm.env.pop("STARLING_PROFILE_OUT", None)
            swarm.env.pop("STARLING_PROFILE_FROM_START", None)

        spawn(0, [])
        swarm.wait_listening([0], 60)
        for i in range(1, n):
            earlier = rng.sample(range(1, i), min(args.few, i - 1)) if args.join == "random" else []
            spawn(i, [swarm.addr(0), *(swarm.addr(j) for j in earlier)])
        everyone = list(range(n))
        swarm.wait_listening(everyone, 60 + 3 * n)
        t_last = time.monotonic()
        wall_last = time.time()
        # CPU the daemons used to start (to listening), and then to join: on a machine of two cores, what
        # 64 daemons starting at once cost decides how long the join can take, whatever the protocols do.
        pids_start = {i: swarm.daemons[i].pid for i in everyone}
        cpu_listening = {i: proc_cpu(pids_start[i]) for i in everyone}
        busy_listening = machine_busy()
        traffic_listening = {i: read_traffic(swarm, i) for i in everyone}
        # Nobody's record signed before its start counts. Each daemon's own start, not the last one's: in swim
        # mode a record is signed again only when it changes, so the bootstrap node's (started half a minute
        # before the last) was never newer than the last start, and no churn round could ever agree.
        since = dict(started_at)
        log(f"{n} daemons listening; waiting until every one knows every other")

        # 1. join
        suspect_pairs: set[tuple[int, str]] = set()
        joined_s = None
        views = None
        trace: list[dict[str, Any]] = []
        # Per daemon: when (s after the last start) it was last seen incomplete, and first seen complete
        # after that. Their maxima say when the last view completed, without the poll round's own length.
        complete_since: dict[int, float | None] = {i: None for i in everyone}
        names = {peer_id(swarm.addr(i)): i for i in everyone}
        while time.monotonic() - t_last < args.timeout:
            t_round = time.monotonic() - t_last
            views = Views(swarm, everyone, t_last)
            for i in everyone:
                suspect_pairs |= {(i, p) for p in views.suspects(i)}
                if not views.complete(i):
                    complete_since[i] = None
                elif complete_since[i] is None:
                    complete_since[i] = views.at[i]
            if args.trace:
                trace.append({"t": round(t_round, 2), "took_s": round(time.monotonic() - t_last - t_round, 2),
                              "daemons": {i: views.trace_row(i) for i in everyone}})
            if views.agree({i: 0.0 for i in everyone}):
                joined_s = time.monotonic() - t_last
                break
            known = [views.alive_known(i) for i in everyone]
            log(f"  {time.monotonic() - t_last:5.0f} s: alive members known min/mean {min(known)}/"
                f"{statistics.mean(known):.1f} of {n - 1}; connections {conn_spread(views, everyone)}; "
                f"round took {time.monotonic() - t_last - t_round:.1f} s")
            if args.trace:
                lagging = {i: views.missing(i) for i in everyone if not views.complete(i)}
                trace[-1]["missing"] = {i: {k: [names.get(p, p) for p in v] for k, v in m.items() if v}
                                        for i, m in lagging.items()}
            time.sleep(args.poll)
        assert views is not None
        cpu_joined = {i: proc_cpu(pids_start[i]) for i in everyone}
        busy_joined = machine_busy()
        streams_join = streams_over(traffic_listening, traffic_since(swarm, everyone, time.monotonic()))
        join_wall = time.monotonic() - t_last
        wall_joined = time.time()
        known = [views.alive_known(i) for i in everyone]
        out["join"] = {
            # CPU seconds per daemon to start (to listening) and over the join (from the last daemon
            # listening to the end of the join's polls); the machine's busy share over the join.
            "cpu_s_to_listen": spread([v for v in cpu_listening.values() if v is not None]),
            "cpu_s_join": spread([cpu_joined[i] - cpu_listening[i] for i in everyone
                                  if cpu_joined[i] is not None and cpu_listening[i] is not None]),
            "cpu_s_join_bootstrap": (None if cpu_joined[0] is None or cpu_listening[0] is None
                                     else cpu_joined[0] - cpu_listening[0]),
            "join_wall_s": join_wall,
            "machine_busy_join": (busy_joined[0] - busy_listening[0]) / max(1, busy_joined[1] - busy_listening[1]),
            "all_known_s": joined_s,
            "known_at_end": spread([float(k) for k in known]),
            "known_mean_at_end": statistics.mean(known),
            "connections_at_end": spread([float(c) for c in (views.connections(i) for i in everyone) if c is not None]),
            # When the last daemon's view became complete (and stayed so until the join ended), read from
            # each daemon's own status call rather than the end of the round of calls.
            "last_view_complete_s": (max(v for v in complete_since.values() if v is not None)
                                     if all(v is not None for v in complete_since.values()) else None),
            # Streams opened ("<protocol>", "<protocol> failed") and accepted ("accepted <protocol>",
            # "accepted failed": negotiations that failed) over the join, all daemons together.
            "streams": streams_join,
        }
        if args.trace:
            out["trace"] = trace
        if profiled and args.profile_join:
            for i in profiled:
                swarm.daemons[i].signal(signal.SIGUSR2)
            time.sleep(2)
            out["profile_join"] = write_profile(args, root, n, profiled, join_wall / 60, "join")
            print_profile(out["profile_join"])
        j = out["join"]
        log(f"  all members known: {fmt_s(joined_s)}; CPU s per daemon to listen {fmt_spread(j['cpu_s_to_listen'])}, "
            f"over the join's {join_wall:.0f} s {fmt_spread(j['cpu_s_join'])} (bootstrap "
            f"{j['cpu_s_join_bootstrap'] or 0:.1f}), machine busy {100 * j['machine_busy_join']:.0f}%")
        log("  streams over the join (all daemons): "
            + (", ".join(f"{k} {v}" for k, v in list(j["streams"].items())[:12]) or "none counted"))

        # 2. settled window (no status calls in it)
        time.sleep(args.settle)
        pids = {i: swarm.daemons[i].pid for i in everyone}
        cpu0 = {i: proc_cpu(pids[i]) for i in everyone}
        traffic0 = {i: swarm.traffic(i) for i in everyone}
        busy0 = machine_busy()
        window_profiled = [] if args.profile_join else profiled
        for i in window_profiled:
            swarm.daemons[i].signal(signal.SIGUSR1)
        t0 = time.monotonic()
        time.sleep(args.window)
        for i in window_profiled:
            swarm.daemons[i].signal(signal.SIGUSR2)
        minutes = (time.monotonic() - t0) / 60
        cpu1 = {i: proc_cpu(pids[i]) for i in everyone}
        traffic1 = {i: swarm.traffic(i) for i in everyone}
        busy1 = machine_busy()
        rss = [r for r in (proc_rss_mib(pids[i]) for i in everyone) if r is not None]
        views = Views(swarm, everyone)
        # The profiler costs its daemons a good part of their CPU: their figures are left out.
        cpu = {i: (cpu1[i] - cpu0[i]) / minutes for i in everyone
               if cpu0[i] is not None and cpu1[i] is not None and i not in profiled}
        sent = {}
        protocols: dict[str, float] = {}
        for i in everyone:
            a, b = traffic1[i], traffic0[i]
            per_min = 60 / max(1e-9, a["t"] - b["t"])
            sent[i] = (a["counts"].get("tcp bytes", 0) - b["counts"].get("tcp bytes", 0)) * per_min
            for key, value in a["counts"].items():
                if key.startswith("bytes "):
                    protocols[key[6:]] = protocols.get(key[6:], 0.0) + (value - b["counts"].get(key, 0)) * per_min / n
        suspects_end = [len(views.suspects(i)) for i in everyone]
        out["settled"] = {
            "cpu_s_per_min": spread(list(cpu.values())),
            "cpu_s_per_min_bootstrap": cpu.get(0),
            "cpu_s_per_min_others_median": statistics.median([v for i, v in cpu.items() if i] or [0.0]),
            "daemons_cores": sum((cpu1[i] or 0) - (cpu0[i] or 0) for i in everyone) / minutes / 60,
            "profiled": profiled,
            "machine_busy": (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]),
            "sent_bytes_per_min": spread(list(sent.values())),
            "sent_bytes_per_min_bootstrap": sent.get(0),
            "protocol_bytes_per_min_mean": dict(sorted(protocols.items(), key=lambda kv: -kv[1])),
            "rss_mib": spread(rss),
            "connections": conn_values(views, everyone),
            "alive_known_min": min(views.alive_known(i) for i in everyone),
            "suspect_at_end_max": max(suspects_end),
        }
        # Suspicions the polls can miss (raised and refuted between two reads, or in the settled window, which
        # has no status calls): each daemon's status keeps the members it last turned suspect, with when.
        recent = {(i, p, t) for i in everyone for p, t in views.recent_suspects(i).items() if t >= wall_last}
        after_join = {p for _, p, t in recent if t >= wall_joined}
        out["settled"]["suspect_after_join_members"] = len(after_join)
        out["settled"]["suspect_after_join_views"] = len({(i, p) for i, p, t in recent if t >= wall_joined})
        out["ever_suspect_members"] = len({p for _, p in suspect_pairs} | {p for _, p, _ in recent})
        out["join"]["ever_suspect_members"] = len({p for _, p in suspect_pairs})
        out["join"]["ever_suspect_max_one_view"] = max(
            [sum(1 for o, _ in suspect_pairs if o == i) for i in everyone] or [0])
        s = out["settled"]
        boot = s["cpu_s_per_min_bootstrap"]
        log(f"  settled: CPU s/min per daemon {fmt_spread(s['cpu_s_per_min'])} (bootstrap "
            f"{'profiled' if boot is None else f'{boot:.1f}'}); daemons {s['daemons_cores']:.2f} cores, machine busy "
            f"{100 * s['machine_busy']:.0f}%; sent kB/min {fmt_spread(s['sent_bytes_per_min'], 1e-3)}; "
            f"RSS MiB {fmt_spread(s['rss_mib'])}; connections {fmt_spread(s['connections'])}")
        log(f"  members shown suspect since the last start: {out['ever_suspect_members']} "
            f"({out['join']['ever_suspect_members']} seen by the join's polls, {s['suspect_after_join_members']} "
            f"turned suspect after the join, in {s['suspect_after_join_views']} views)")
        if window_profiled:
            out["profile"] = write_profile(args, root, n, window_profiled, minutes, "window")
            print_profile(out["profile"])

        # 3. churn
        rounds = []
        for r in range(args.churn_rounds):
            victims = rng.sample(range(1, n), max(1, n // 10)) if n > 1 else []
            t_kill = time.monotonic()
            for i in victims:
                swarm.daemons[i].kill()
            for i in victims:
                since[i] = time.time()
                swarm.restart(i)
            agreed = None
            while time.monotonic() - t_kill < args.churn_every:
                time.sleep(args.poll)
                if Views(swarm, everyone).agree(since):
                    agreed = time.monotonic() - t_kill
                    break
            rounds.append({"killed": len(victims), "agreed_s": agreed})
            log(f"  churn round {r + 1}: {len(victims)} killed and restarted; views agree: {fmt_s(agreed)}")
            time.sleep(max(0.0, args.churn_every - (time.monotonic() - t_kill)))
        out["churn"] = rounds
    finally:
        swarm.stop()
        if args.keep_logs:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            for i in swarm.daemons:
                if (root / f"n{i}.log").exists():
                    (args.keep_logs / f"scale{n}-n{i}.log").write_bytes((root / f"n{i}.log").read_bytes())
            (args.keep_logs / f"scale{n}-ids.json").write_text(
                json.dumps({i: peer_id(swarm.addr(i)) for i in swarm.daemons}))
    return out


def write_profile(args: argparse.Namespace, root: Path, n: int, profiled: list[int], minutes: float,
                  what: str) -> dict[str, Any]:
    """Keep the profiled daemons' stats files in ``--profile`` DIR and summarize them."""
    args.profile.mkdir(parents=True, exist_ok=True)
    kept = []
    for i in profiled:
        if (root / f"n{i}.prof").exists():
            kept.append(args.profile / f"scale{n}-{what}-n{i}.prof")
            kept[-1].write_bytes((root / f"n{i}.prof").read_bytes())
    return profile_summary(kept, minutes)


def conn_values(views: Views, indices: list[int]) -> dict[str, float]:
    return spread([float(c) for c in (views.connections(i) for i in indices) if c is not None])


def conn_spread(views: Views, indices: list[int]) -> str:
    return fmt_spread(conn_values(views, indices))


# --- the profile ----------------------------------------------------------------------------------------------


def profile_summary(files: list[Path], minutes: float) -> dict[str, Any]:
    """CPU seconds per minute per profiled daemon, by component (cumulative time of each component's entry
    points; a function below two entry points counts in the first listed), and the top functions by own time."""
    present = [str(f) for f in files if f.exists()]
    if not present:
        return {}
    stats = pstats.Stats(*present)
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    # The profiler's clock is CPU time, so waiting in epoll costs (almost) nothing; dropped all the same.
    total = sum(v[2] for k, v in raw.items() if "epoll" not in k[2])
    per_min = 1 / (len(present) * minutes)
    components: dict[str, float] = {}
    for name, (path_part, func) in COMPONENTS:
        ct = sum(v[3] for (filename, _line, fn), v in raw.items()
                 if path_part in filename and (not func or fn == func))
        if not func:  # a whole module: own time only (its functions call each other)
            ct = sum(v[2] for (filename, _line, _fn), v in raw.items() if path_part in filename)
        components[name] = ct * per_min
    top = sorted(raw.items(), key=lambda kv: -kv[1][2])[:25]
    packages: dict[str, float] = {}
    for (filename, _line, fn), v in raw.items():
        if "epoll" not in fn:
            packages[package_of(filename)] = packages.get(package_of(filename), 0.0) + v[2] * per_min
    return {
        "daemons": len(present),
        "total_s_per_min": total * per_min,
        "components_s_per_min": components,
        "own_time_by_package_s_per_min": dict(sorted(packages.items(), key=lambda kv: -kv[1])[:15]),
        "top_own_time": [(f"{Path(k[0]).name}:{k[1]}:{k[2]}", v[2] * per_min, v[1]) for k, v in top],
    }


def package_of(filename: str) -> str:
    """Where a profiled function lives, coarsely: the site-packages package (libp2p's subpackage), or this
    repository's module; built-ins as '~'."""
    parts = Path(filename).parts
    if "site-packages" in parts:
        rest = parts[parts.index("site-packages") + 1:]
        return "/".join(rest[:2]) if rest[0] == "libp2p" and len(rest) > 2 else rest[0]
    for top in ("p2p", "protocols", "node"):
        if top in parts:
            return "/".join(parts[parts.index(top):])
    return "~" if filename == "~" else Path(filename).name


def print_profile(p: dict[str, Any]) -> None:
    if not p:
        log("  (no profile written)")
        return
    log(f"  profile ({p['daemons']} daemons, main thread, CPU time): {p['total_s_per_min']:.2f} s/min each")
    for name, v in sorted(p["components_s_per_min"].items(), key=lambda kv: -kv[1]):
        log(f"    {v:6.2f} s/min  {100 * v / max(1e-9, p['total_s_per_min']):5.1f}%  {name}")
    log("  own time by package (s/min):")
    for name, v in p["own_time_by_package_s_per_min"].items():
        log(f"    {v:6.2f}  {name}")
    log("  top functions by own time (s/min, calls):")
    for name, v, calls in p["top_own_time"]:
        log(f"    {v:6.3f}  {calls:>9}  {name}")


# --- output ---------------------------------------------------------------------------------------------------


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def fmt_s(value: float | None) -> str:
    return "not within the timeout" if value is None else f"{value:.1f} s"


def fmt_spread(s: dict[str, float], scale: float = 1.0) -> str:
    if not s:
        return "-"
    return "/".join(f"{s[k] * scale:.1f}".removesuffix(".0") for k in ("min", "median", "max"))


def render(results: list[dict[str, Any]], command: str) -> str:
    modes = sorted({r["join_mode"] for r in results})
    lines = [
        SECTION, "",
        "Commands: " + "; ".join(sorted({f"`{r.get('command', command)}` ({r.get('date', '?')})" for r in results}))
        + f" ({os.cpu_count()} cores, {platform.machine()}). N network-only daemons (`--no-train`) on 127.0.0.1, default settings, one "
        "bootstrap node; " + ("the others given only its address" if modes == ["bootstrap"] else
                              "joins: `bootstrap` = the others given only its address, `random` = also a few "
                              "random earlier nodes' addresses") +
        ". *All known*: from the last daemon listening until every daemon holds every other as an alive "
        "member (status polled one daemon after another). *Ever suspect*: members any daemon showed as "
        "suspect from the last start to the end of the settled window (the polls, and each daemon's list of the "
        "members it last turned suspect, read at the end), of which *after the join*: after the polls ended. Then a settled window with no status calls: CPU seconds per minute per daemon "
        "(/proc/PID/stat; min/median/max), what the daemons used of the machine's cores, bytes each sends per "
        "minute (TCP, after Noise and Yamux), RSS, connections per daemon (min/median/max). *Churn*: each "
        "minute a tenth of the daemons SIGKILLed and restarted at once; seconds until every view agrees again "
        "(every daemon alive in every other's table with a record signed since its restart). Where the machine "
        "is busy near 100%, the daemons shared its cores: CPU per daemon is then a share, not what a daemon "
        "would use on a machine of its own.", "",
        "| daemons | join | all known | ever suspect | CPU s/min per daemon | daemons' cores (machine busy) "
        "| sent kB/min per daemon | RSS MiB | connections | churn: views agree after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        j, s = r["join"], r.get("settled", {})
        known = fmt_s(j["all_known_s"]) if j["all_known_s"] is not None else (
            f"not within {r['timeout_s']:.0f} s (alive known: mean {j['known_mean_at_end']:.1f} of {r['n'] - 1})")
        churn = ", ".join(fmt_s(c["agreed_s"]).replace("not within the timeout", "no") for c in r.get("churn", []))
        lines.append(
            f"| {r['n']} | {r['join_mode']} | {known} | {r.get('ever_suspect_members', j.get('ever_suspect_members', 0))} "
            f"({s.get('suspect_after_join_members', '-')} after the join) | "
            f"{fmt_spread(s.get('cpu_s_per_min', {}))} | {s.get('daemons_cores', 0):.2f} "
            f"({100 * s.get('machine_busy', 0):.0f}%) | {fmt_spread(s.get('sent_bytes_per_min', {}), 1e-3)} | "
            f"{fmt_spread(s.get('rss_mib', {}))} | {fmt_spread(s.get('connections', {}))} | {churn or '-'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64], help="daemons per run (default 16 32 64)")
    p.add_argument("--join", choices=["bootstrap", "random"], default="bootstrap",
                   help="what the non-bootstrap daemons are given (default: the bootstrap address only)")
    p.add_argument("--few", type=int, default=3, help="random earlier nodes' addresses with --join random")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for every daemon to know all")
    p.add_argument("--poll", type=float, default=3.0, help="seconds between rounds of status calls")
    p.add_argument("--settle", type=float, default=20.0, help="seconds between the join and the window")
    p.add_argument("--window", type=float, default=60.0, help="seconds of the settled window")
    p.add_argument("--churn-rounds", type=int, default=3, help="churn rounds, one a minute (0: none)")
    p.add_argument("--churn-every", type=float, default=60.0, help="seconds per churn round")
    p.add_argument("--profile", type=Path, metavar="DIR",
                   help="cProfile up to 4 daemons (the bootstrap node first) over the settled window; their stats files are kept in DIR")
    p.add_argument("--profile-join", action="store_true",
                   help="with --profile: profile the daemons from their start to the join's end, not the window")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.OPTION=VALUE",
                   help="a config option for every daemon, as `starling run --set`")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--jsonl", type=Path, default=None,
                   help="append the raw results, one record per run, here (default bench/results/scale.jsonl)")
    p.add_argument("--trace", action="store_true",
                   help="keep every status round of the join in the JSON (per daemon: view, why members are missing, "
                        "connections, state sessions, SWIM counters)")
    p.add_argument("--log-level", default="warning", help="the daemons' log level (default warning)")
    p.add_argument("--keep-logs", type=Path, metavar="DIR", help="copy the daemons' logs here at the end")
    p.add_argument("--from", dest="from_", type=Path, nargs="+", help="render these saved results, run nothing")
    p.add_argument("--write-docs", action="store_true", help=f"write `{SECTION}` of docs/benchmarks.md")
    args = p.parse_args()
    argv, skip = [], False  # the command as the docs show it: without where its files went
    for a in sys.argv[1:]:
        if skip or a == "--write-docs":
            skip = False
            continue
        skip = a in ("--json", "--jsonl", "--profile", "--keep-logs")
        if not skip:
            argv.append(a)
    args.command = " ".join(["python bench/scale.py", *argv])
    if args.from_:
        results = [r for f in args.from_ for r in json.loads(f.read_text())]
    else:
        if min(args.sizes) < 2 or args.window <= 0:
            p.error("need sizes >= 2 and --window > 0")
        results = []
        tree = tree_id()  # read at the start: HEAD may move during a long run
        for n in args.sizes:
            with tempfile.TemporaryDirectory(prefix=f"starling-scale{n}-") as tmp:
                results.append(run_size(n, args, Path(tmp)))
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
        keep_results(args.jsonl or RESULTS_DIR / "scale.jsonl", "scale", results, args.command, tree,
                     sizes=args.sizes, join=args.join, settings=args.set)
    text = render(results, ("python bench/scale.py " + " ".join(sys.argv[1:])).strip())
    publish(text, DOCS, SECTION, write=args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
