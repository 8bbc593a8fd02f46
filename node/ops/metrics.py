"""Prometheus metrics for a Starling node, and a tiny trio HTTP server that exposes them.

Two sources feed the registry:

- **The status snapshot.** The daemon already keeps everything ``starling status`` shows (training
  progress, sync counters, per-peer bytes, connection paths, membership, what it refused to peers). :meth:`Metrics.update_from_status`
  turns that dict into metric families at once; a scrape returns the latest snapshot. Counters the daemon
  keeps (rounds, bytes) are exported as Prometheus counters, so ``rate()`` works; a daemon restart resets
  them, which Prometheus handles. Peers and states that vanish from the status vanish from the metrics,
  so label sets never outgrow what the daemon itself tracks.
- **Events.** :meth:`Metrics.observe_round` records each averaging round as it ends, which a snapshot
  cannot: the distribution of round durations and sizes (histograms), and per-partner outcomes.

Everything lives on the node's own ``CollectorRegistry`` (not the process-global one that libp2p and
other libraries may also write to), so a scrape shows exactly Starling's metrics and tests can build as
many independent instances as they like.

The server answers ``GET /metrics`` and nothing else; it uses no threads, reads at most
:data:`MAX_REQUEST_HEAD` bytes of a request, gives each connection :data:`REQUEST_TIMEOUT_S` in total
and serves at most ``max_connections`` at once, so a slow or hostile client costs a bounded amount.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, get_args

import trio
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from node.ops.islands import pairing_graph
from node.status_schema import (
    ConnectionPath,
    MemberStatus,
    MixingStatus,
    MuxerStatus,
    NodeStatus,
    PeerPathStatus,
    SittingOutStatus,
    SwarmTotals,
    SwimStatus,
    SyncStatus,
    TrainingStatus,
)
from protocols.hlc import MAX_LEAD_S

log = logging.getLogger(__name__)

PREFIX = "starling"

# Path and member states the daemon reports; always exported (as 0 when absent) so dashboards and
# alerts see a series drop to zero instead of disappearing.
CONNECTION_PATHS = tuple(p for p in get_args(ConnectionPath) if p != "none")
MEMBER_STATES = ("alive", "suspect", "gone", "left")

# Round durations span a LAN exchange of a small model to a WAN exchange of a large one.
ROUND_DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
ROUND_BYTES_BUCKETS = (1e4, 1e5, 1e6, 1e7, 3e7, 1e8, 3e8, 1e9, 3e9, 1e10, 3e10)

# Label values come from the network (peer ids) or the daemon; cap their length so one odd value
# cannot bloat every scrape.
MAX_LABEL_CHARS = 128
DEFAULT_MAX_PEER_LABELS = 256

MAX_REQUEST_HEAD = 8192
REQUEST_TIMEOUT_S = 5.0
DEFAULT_MAX_CONNECTIONS = 16


def _gauge_value(value: Any) -> float | None:
    """A number for a gauge (NaN and infinities pass: a diverged loss is worth seeing), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _counter_value(value: Any) -> float | None:
    """A number for a counter: finite and non-negative, else None."""
    number = _gauge_value(value)
    if number is None or not math.isfinite(number) or number < 0:
        return None
    return number


def _label(value: Any) -> str | None:
    """A label value: a non-empty string, truncated; anything else is skipped."""
    if not isinstance(value, str) or not value:
        return None
    return value[:MAX_LABEL_CHARS]


def _gauge(name: str, doc: str, value: Any) -> Iterator[Metric]:
    number = _gauge_value(value)
    if number is not None:
        family = GaugeMetricFamily(f"{PREFIX}_{name}", doc)
        family.add_metric([], number)
        yield family


def _counter(name: str, doc: str, value: Any) -> Iterator[Metric]:
    number = _counter_value(value)
    if number is not None:
        family = CounterMetricFamily(f"{PREFIX}_{name}", doc)
        family.add_metric([], number)
        yield family


def _status_families(status: NodeStatus, max_peer_labels: int) -> list[Metric]:
    """Every metric family the status dict supports; unknown, missing or mistyped fields are skipped."""
    families: list[Metric] = []
    families.extend(_node_families(status))
    training = status.get("training")
    if isinstance(training, Mapping):
        families.extend(_training_families(training))
    sync = status.get("sync")
    if isinstance(sync, Mapping):
        families.extend(_sync_families(sync, max_peer_labels))
    peers = status.get("peers")
    if isinstance(peers, list):
        families.extend(_peer_families(peers, max_peer_labels))
    members = status.get("members")
    if isinstance(members, list):
        families.extend(_member_families(members))
        families.extend(_pairing_families(members))
    families.extend(_refusal_families(status))
    swim = status.get("swim")
    if isinstance(swim, Mapping):
        families.extend(_swim_families(swim))
    reachability = _reachability_label(status.get("reachability"))
    if reachability is not None:
        family = GaugeMetricFamily(
            f"{PREFIX}_reachability", "1 for this node's current NAT reachability verdict", labels=["state"]
        )
        family.add_metric([reachability], 1.0)
        families.append(family)
    return families


def _node_families(status: NodeStatus) -> Iterator[Metric]:
    labels = {key: _label(status.get(key)) or "" for key in ("peer_id", "swarm", "version")}
    if any(labels.values()):
        info = GaugeMetricFamily(
            f"{PREFIX}_node_info", "Constant 1, labelled with the node's identity", labels=list(labels)
        )
        info.add_metric(list(labels.values()), 1.0)
        yield info
    yield from _gauge("uptime_seconds", "Seconds since the daemon started", status.get("uptime_s"))
    connected = status.get("connected_peers")
    if isinstance(connected, list):
        yield from _gauge("connected_peers", "Peers with an open libp2p connection", len(connected))


def _training_families(training: TrainingStatus) -> Iterator[Metric]:
    yield from _gauge("training_step", "Inner optimizer steps taken", training.get("step"))
    yield from _gauge("training_outer_step", "Outer (averaging) steps taken", training.get("outer_step"))
    yield from _gauge("training_loss", "Latest training loss", training.get("loss"))
    yield from _gauge("training_val_loss", "Latest validation loss", training.get("val_loss"))
    yield from _gauge(
        "training_samples_per_second",
        "Training speed of the local worker: sequences per second over whole outer steps (the swarm's pace uses it)",
        training.get("samples_per_s"),
    )
    yield from _gauge(
        "training_pace_seconds",
        "The swarm's pace: seconds between two outer steps (absent when pacing by this machine's inner steps)",
        training.get("period_s"),
    )
    yield from _gauge(
        "training_last_inner_steps",
        "Inner steps in the latest outer step (fewer than the swarm's on a slower machine)",
        training.get("last_inner_steps"),
    )
    yield from _counter("worker_restarts", "Times the supervisor restarted the torch worker", training.get("restarts"))
    yield from _gauge(
        "training_checkpoint_failures",
        "Checkpoints that failed in a row since the last one written (a full or failing disk); 0 when they work",
        training.get("checkpoint_failures"),
    )
    device, task = _label(training.get("device")), _label(training.get("task"))
    if device or task:
        info = GaugeMetricFamily(
            f"{PREFIX}_training_info", "Constant 1, labelled with the worker's device and task", labels=["device", "task"]
        )
        info.add_metric([device or "", task or ""], 1.0)
        yield info


def _reason_counter(name: str, doc: str, counts: Any, label: str = "reason") -> Iterator[Metric]:
    """A counter labelled by reason (or `label`), from a {reason: count} status dict (absent or malformed:
    nothing)."""
    if not isinstance(counts, Mapping):
        return
    family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=[label])
    for reason, count in sorted(counts.items()):
        if isinstance(count, int) and not isinstance(count, bool):
            family.add_metric([_label(reason) or "unknown"], float(count))
    yield family


def _refusal_families(status: NodeStatus) -> Iterator[Metric]:
    """What this node refused to peers (node/ops/refusals.py), the muxer's offences and the remote clocks it did
    not follow: an alert on a rising ``rate()`` of these is how an operator learns that someone is hitting
    the limits, without reading every node's status."""
    yield from _reason_counter(
        "refusals", "Requests, connections and records refused to peers, by kind and why (node/ops/refusals.py)",
        status.get("refusals"), label="kind",
    )
    muxer = status.get("muxer")
    if isinstance(muxer, Mapping):
        yield from _muxer_families(muxer)
    totals = status.get("swarm_totals")
    if isinstance(totals, Mapping):
        yield from _swarm_totals_families(totals)


def _muxer_families(muxer: MuxerStatus) -> Iterator[Metric]:
    yield from _counter("muxer_window_overruns", "Connections closed because the peer sent past a stream's receive "
                        "window", muxer.get("window_overruns"))
    yield from _counter("muxer_dropped_bytes", "Bytes not buffered: past a receive window, or for streams no longer "
                        "read", muxer.get("dropped_bytes"))
    yield from _gauge("muxer_offenders", "Distinct peers that overran a receive window (the most recent 1024)",
                      muxer.get("offenders"))


def _swarm_totals_families(totals: SwarmTotals) -> Iterator[Metric]:
    yield from _counter("swarm_clock_capped", f"Others' records dated over {MAX_LEAD_S:g} s ahead of our clock: kept, "
                        "but our clock not moved past the bound (protocols/hlc.py)", totals.get("clock_capped"))


#: SWIM's counters (status ``swim``, node.membership = swim): key -> (metric name, help).
SWIM_COUNTERS = {
    "probes": ("swim_probes", "SWIM probes this node started (round-robin, and on a dropped connection)"),
    "indirect_probes": ("swim_indirect_probes", "SWIM probes that asked helpers (no direct ack in time)"),
    "acks": ("swim_acks", "SWIM probes answered, directly or through helpers"),
    "alive_by_traffic": ("swim_alive_by_traffic", "SWIM probes unanswered in time that ended anyway: the member's "
                         "connection delivered other data since the ping"),
    "waits_stretched": ("swim_waits_stretched", "SWIM pings that waited past the ack timeout for slow answers"),
    "suspects_raised": ("swim_suspects_raised", "SWIM probes that ended unanswered and made the member suspect"),
    "suspects_seen": ("swim_suspects_seen", "Members turned suspect in this node's view (raised here or heard)"),
    "no_evidence": ("swim_probes_no_evidence", "SWIM probes nobody could carry (no connection, no helper): no suspicion"),
    "refutations": ("swim_refutations", "Suspicions of this node it refuted (each raises its local health score)"),
    "declared_dead": ("swim_declared_dead", "Suspects this node declared dead after the suspicion timeout"),
    "messages_sent": ("swim_messages_sent", "SWIM messages written"),
    "messages_received": ("swim_messages_received", "SWIM messages read"),
    "messages_dropped": ("swim_messages_dropped", "SWIM messages not sent (peer not connected, no stream, full outbox, "
                         "too large)"),
    "bytes_sent": ("swim_sent_bytes", "SWIM message bytes written (frame payloads)"),
    "bytes_received": ("swim_received_bytes", "SWIM message bytes read (frame payloads)"),
}
SWIM_GAUGES = {
    "names": ("swim_names", "Peer names the SWIM service holds (bounded; dead members' names are reclaimed)"),
    "slow_members": ("swim_slow_members", "Members whose answers came slowly: their acks are waited for longer"),
    "answer_wait_s": ("swim_answer_wait_seconds", "How long a ping of a member never timed waits now for its ack "
                      "(0: the configured ack timeout; longer while the swarm answers slowly)"),
    "local_health": ("swim_local_health", "Lifeguard's local health score: 0 healthy; timeouts are x (1 + it)"),
    "loop_lag_max_s": ("swim_loop_lag_max_seconds", "The most the SWIM timer loop woke late (a starved event loop)"),
}


def _swim_families(swim: SwimStatus) -> Iterator[Metric]:
    for key, (name, doc) in SWIM_COUNTERS.items():
        yield from _counter(name, doc, swim.get(key))
    for key, (name, doc) in SWIM_GAUGES.items():
        yield from _gauge(name, doc, swim.get(key))
    members = swim.get("members")
    if isinstance(members, Mapping):
        family = GaugeMetricFamily(f"{PREFIX}_swim_members", "Members the SWIM core holds, by state", labels=["state"])
        for state, count in sorted(members.items()):
            if isinstance(count, int) and not isinstance(count, bool):
                family.add_metric([_label(state) or "unknown"], float(count))
        yield family
    yield from _reason_counter("swim_dropped", "SWIM messages not sent, by reason", swim.get("dropped"))


def _sitting_out_families(sitting_out: SittingOutStatus) -> Iterator[Metric]:
    """Trainers not waited for as partners after missed rounds (node/averaging/partner_misses.py): a count that stays
    up means fake or broken trainers in the member table."""
    yield from _gauge("sync_partners_sitting_out", "Trainers sitting out a back-off after missed averaging rounds",
                      sitting_out.get("count"))
    yield from _counter("sync_partner_exclusions", "Times a trainer was made to sit out after missed averaging rounds",
                        sitting_out.get("exclusions"))


def _sync_families(sync: SyncStatus, max_peer_labels: int) -> Iterator[Metric]:
    yield from _counter("sync_rounds", "Averaging rounds completed with a partner", sync.get("rounds"))
    yield from _counter("sync_solo_rounds", "Outer steps taken without a partner", sync.get("solo_rounds"))
    yield from _counter("sync_failures", "Averaging rounds that failed", sync.get("failures"))
    yield from _reason_counter("sync_refused_updates", "Partner updates refused as invalid, by reason (node/averaging/robust.py)",
                               sync.get("rejections"))
    yield from _reason_counter("sync_clipped_updates", "Partner updates clipped to the bounds, by part (delta | phi)",
                               sync.get("clipped"))
    yield from _gauge("sync_distinct_partners", "Distinct peers averaged with so far", sync.get("distinct_partners"))
    yield from _gauge("sync_last_duration_seconds", "Duration of the latest round", sync.get("last_duration_s"))
    yield from _gauge("sync_last_bytes", "Bytes moved by the latest round", sync.get("last_bytes"))
    yield from _gauge("sync_last_bytes_per_param", "Payload bytes sent per parameter per outer step, in the latest round "
                      "(phi + Delta; with streaming fragments, the latest sync of each fragment)",
                      sync.get("last_bytes_per_param"))
    yield from _counter("sync_sent_bytes", "Bytes sent in averaging rounds", sync.get("bytes_sent"))
    yield from _counter("sync_received_bytes", "Bytes received in averaging rounds", sync.get("bytes_received"))
    mixing = sync.get("mixing")
    if isinstance(mixing, Mapping):
        yield from _mixing_families(mixing)
    sitting_out = sync.get("sitting_out")
    if isinstance(sitting_out, Mapping):
        yield from _sitting_out_families(sitting_out)
    wire_dtype = _label(sync.get("wire_dtype"))
    if wire_dtype is not None:
        info = GaugeMetricFamily(
            f"{PREFIX}_sync_wire_dtype_info", "Constant 1, labelled with the tensor wire dtype", labels=["dtype"]
        )
        info.add_metric([wire_dtype], 1.0)
        yield info
    compression = _label(sync.get("compression"))
    if compression is not None:
        preset = GaugeMetricFamily(f"{PREFIX}_sync_compression_info",
                                   "Constant 1, labelled with the sync.compression preset", labels=["preset"])
        preset.add_metric([compression], 1.0)
        yield preset
    last = _label(sync.get("last_compression"))
    if last is not None:
        used = GaugeMetricFamily(f"{PREFIX}_sync_last_compression_info", "Constant 1, labelled with the preset the "
                                 "latest round's wire used (sync.compression = auto chooses per round)",
                                 labels=["preset"])
        used.add_metric([last], 1.0)
        yield used
    asked = sync.get("last_asked")
    phases = asked.get("phases_s") if isinstance(asked, Mapping) else None
    if isinstance(phases, Mapping):
        phase = GaugeMetricFamily(f"{PREFIX}_sync_last_asked_phase_seconds", "Seconds of each phase of the latest "
                                  "exchange this node asked for (open, answer, connect, transfer, result: "
                                  "node/averaging/phases.py)", labels=["phase"])
        for name, seconds in phases.items():
            if isinstance(seconds, (int, float)) and isinstance(name, str):
                phase.add_metric([name], float(seconds))
        yield phase
    per_peer = sync.get("per_peer")
    if isinstance(per_peer, Mapping):
        sent = CounterMetricFamily(
            f"{PREFIX}_sync_peer_sent_bytes", "Averaging bytes sent to each peer", labels=["peer_id"]
        )
        received = CounterMetricFamily(
            f"{PREFIX}_sync_peer_received_bytes", "Averaging bytes received from each peer", labels=["peer_id"]
        )
        for peer_id, counts in _capped(per_peer.items(), max_peer_labels):
            label = _label(peer_id)
            if label is None or not isinstance(counts, Mapping):
                continue
            for family, key in ((sent, "bytes_sent"), (received, "bytes_received")):
                value = _counter_value(counts.get(key))
                if value is not None:
                    family.add_metric([label], value)
        yield sent
        yield received


def _peer_families(peers: list[PeerPathStatus], max_peer_labels: int) -> Iterator[Metric]:
    by_path: dict[str, int] = dict.fromkeys(CONNECTION_PATHS, 0)
    rtt = GaugeMetricFamily(
        f"{PREFIX}_peer_rtt_seconds", "Round-trip time to each connected peer", labels=["peer_id", "path"]
    )
    for index, peer in enumerate(peers):
        if not isinstance(peer, Mapping):
            continue
        path = _label(peer.get("path"))
        if path is None:
            continue
        by_path[path] = by_path.get(path, 0) + 1
        peer_id = _label(peer.get("peer_id"))
        rtt_ms = _counter_value(peer.get("rtt_ms"))
        if index < max_peer_labels and peer_id is not None and rtt_ms is not None:
            rtt.add_metric([peer_id, path], rtt_ms / 1000.0)
    connections = GaugeMetricFamily(
        f"{PREFIX}_connections", "Connected peers by network path", labels=["path"]
    )
    for path, count in by_path.items():
        connections.add_metric([path], float(count))
    yield connections
    yield rtt


def _member_families(members: list[MemberStatus]) -> Iterator[Metric]:
    by_state: dict[str, int] = dict.fromkeys(MEMBER_STATES, 0)
    for member in members:
        if isinstance(member, Mapping):
            state = _label(member.get("state"))
            if state is not None:
                by_state[state] = by_state.get(state, 0) + 1
    family = GaugeMetricFamily(
        f"{PREFIX}_members", "Swarm members known to this node, by membership state", labels=["state"]
    )
    for state, count in by_state.items():
        family.add_metric([state], float(count))
    yield family


def _mixing_families(mixing: MixingStatus) -> Iterator[Metric]:
    """This node's recent mixing: the totals above never forget, so a node that paired well at first and
    steps solo now only shows here."""
    yield from _gauge(
        "sync_recent_outer_steps", "Outer steps in the recent window the recent_* gauges cover", mixing.get("outer_steps")
    )
    yield from _gauge(
        "sync_recent_solo_share", "Share of the recent outer steps taken without a partner (0-1)", mixing.get("solo_share")
    )
    yield from _gauge(
        "sync_recent_distinct_partners",
        "Distinct peers averaged with over the recent outer steps",
        mixing.get("distinct_partners"),
    )


def _pairing_families(members: list[MemberStatus]) -> Iterator[Metric]:
    """The pairing graph over alive trainers (node/ops/islands.py): more than one island means a split swarm."""
    graph = pairing_graph(members)
    yield from _gauge(
        "swarm_pairing_islands",
        "Groups of alive trainers that average among themselves, as seen from this node (>1: the swarm split)",
        len(graph.islands),
    )
    yield from _gauge(
        "swarm_unpaired_trainers",
        "Alive trainers that averaged with no other alive trainer over their recent outer steps",
        len(graph.unpaired),
    )


def _reachability_label(value: Any) -> str | None:
    """The reachability verdict as a label: a plain string, or a dict's ``state`` / ``status`` field."""
    if isinstance(value, Mapping):
        value = value.get("state", value.get("status"))
    return _label(value)


def _capped(items: Iterable[tuple[Any, Any]], limit: int) -> Iterator[tuple[Any, Any]]:
    for index, item in enumerate(items):
        if index >= limit:
            return
        yield item


class _StatusCollector(Collector):
    """Hands the registry the families built from the latest status snapshot."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def collect(self) -> Iterable[Metric]:
        return list(self.families)


class Metrics:
    """A node's Prometheus metrics on a private ``CollectorRegistry``.

    The daemon calls :meth:`update_from_status` whenever it has a fresh status (e.g. once a second, or
    just before rendering) and :meth:`observe_round` at the end of every averaging attempt.
    """

    def __init__(self, *, max_peer_labels: int = DEFAULT_MAX_PEER_LABELS) -> None:
        if max_peer_labels < 1:
            raise ValueError(f"max_peer_labels must be >= 1, got {max_peer_labels}")
        self.max_peer_labels = max_peer_labels
        self.registry = CollectorRegistry(auto_describe=True)
        self._status = _StatusCollector()
        self.registry.register(self._status)
        self.round_duration = Histogram(
            f"{PREFIX}_sync_round_duration_seconds",
            "Wall time of each averaging round, from handshake to result",
            ["result"],
            buckets=ROUND_DURATION_BUCKETS,
            registry=self.registry,
        )
        self.round_bytes = Histogram(
            f"{PREFIX}_sync_round_bytes",
            "Bytes sent plus received in each averaging round",
            ["result"],
            buckets=ROUND_BYTES_BUCKETS,
            registry=self.registry,
        )
        self.partner_rounds = Counter(
            f"{PREFIX}_sync_partner_rounds",
            "Averaging rounds with each partner, by result (most recent partners only)",
            ["peer_id", "result"],
            registry=self.registry,
        )
        # Create both outcomes' series up front, so a scrape shows zeros before the first round and
        # `rate()` over the first failure sees a change from 0 rather than a new series.
        for result in ("ok", "failed"):
            self.round_duration.labels(result)
            self.round_bytes.labels(result)
        # Partners in least-recently-used order: the oldest one's series are dropped past the cap.
        self._partners: OrderedDict[str, None] = OrderedDict()

    def update_from_status(self, status: NodeStatus) -> None:
        """Replace the snapshot metrics with those of ``status`` (the ``starling status --json`` dict).

        Sections may be absent (a network-only node has no ``training``); fields that are missing or
        of the wrong type are skipped rather than raising, because a metrics glitch must never take the
        node down.
        """
        if not isinstance(status, Mapping):
            log.warning("metrics: ignoring a status that is not a mapping: %r", type(status).__name__)
            return
        self._status.families = _status_families(status, self.max_peer_labels)

    def observe_round(self, duration_s: float, nbytes: int, peer_id: str | None, ok: bool) -> None:
        """Record one averaging round: its duration, bytes moved (sent + received), partner and outcome.

        ``peer_id`` may be None for a round that failed before a partner was chosen. Nonsense values
        (negative, NaN) are logged and dropped.
        """
        duration = _counter_value(duration_s)
        size = _counter_value(nbytes)
        if duration is None or size is None:
            log.warning("metrics: dropping a round with duration=%r bytes=%r", duration_s, nbytes)
            return
        result = "ok" if ok else "failed"
        self.round_duration.labels(result).observe(duration)
        self.round_bytes.labels(result).observe(size)
        partner = _label(peer_id)
        if partner is not None:
            self._touch_partner(partner)
            self.partner_rounds.labels(partner, result).inc()

    def _touch_partner(self, peer_id: str) -> None:
        self._partners[peer_id] = None
        self._partners.move_to_end(peer_id)
        while len(self._partners) > self.max_peer_labels:
            oldest, _ = self._partners.popitem(last=False)
            for result in ("ok", "failed"):
                try:
                    self.partner_rounds.remove(oldest, result)
                except KeyError:
                    pass

    def render(self, accept_header: str = "") -> tuple[bytes, str]:
        """The exposition body and its content type, in the format the scraper's Accept header asks for."""
        encoder, content_type = choose_encoder(accept_header)
        return encoder(self.registry), content_type


class _HttpError(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


async def _read_request_head(stream: trio.abc.ReceiveStream) -> bytes:
    """Bytes up to the blank line ending the request head; bounded by MAX_REQUEST_HEAD."""
    buffer = bytearray()
    while True:
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            end = buffer.find(b"\n\n")
        if end >= 0:
            return bytes(buffer[:end])
        if len(buffer) > MAX_REQUEST_HEAD:
            raise _HttpError(431, "Request Header Fields Too Large")
        chunk = await stream.receive_some(4096)
        if not chunk:
            raise _HttpError(400, "Bad Request")
        buffer += chunk


def _parse_request_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    """Method, path (without query) and lower-cased headers of an HTTP/1.x request head."""
    text = head.decode("latin-1")  # HTTP heads are bytes; latin-1 maps each one to a character
    lines = text.replace("\r\n", "\n").split("\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _HttpError(400, "Bad Request")
    method, target, _version = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return method, target.split("?", 1)[0], headers


def _response(status: int, reason: str, body: bytes, content_type: str, *, head_only: bool = False) -> bytes:
    header = (
        f"HTTP/1.1 {status} {reason}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n"
    )
    if status == 405:
        header += "Allow: GET, HEAD\r\n"
    return (header + "\r\n").encode("latin-1") + (b"" if head_only else body)


async def _handle_connection(metrics: Metrics, stream: trio.SocketStream) -> None:
    """Answer one request on ``stream``, then close it (no keep-alive: scrapes are seconds apart)."""
    try:
        head = await _read_request_head(stream)
        method, path, headers = _parse_request_head(head)
        if method not in ("GET", "HEAD"):
            raise _HttpError(405, "Method Not Allowed")
        if path != "/metrics":
            raise _HttpError(404, "Not Found")
        try:
            body, content_type = metrics.render(headers.get("accept", ""))
        except Exception as exc:
            log.exception("rendering metrics failed")
            raise _HttpError(500, "Internal Server Error") from exc
        reply = _response(200, "OK", body, content_type, head_only=method == "HEAD")
    except _HttpError as exc:
        reply = _response(exc.status, exc.reason, f"{exc.reason}\n".encode(), "text/plain; charset=utf-8")
    await stream.send_all(reply)


async def serve_metrics(
    metrics: Metrics,
    host: str,
    port: int,
    *,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``GET /metrics`` on ``host:port`` until cancelled.

    Start it with ``port = await nursery.start(serve_metrics, metrics, host, port)``: the value is the
    bound port (useful with port 0). Binding errors (port in use, bad host) raise ``OSError`` from
    ``nursery.start`` before anything is served, so the daemon can report them at startup.
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound_port = listeners[0].socket.getsockname()[1]
    active = 0

    async def handler(stream: trio.SocketStream) -> None:
        nonlocal active
        async with stream:
            if active >= max_connections:
                return  # closing at once is the cheapest answer to a flood
            active += 1
            try:
                with trio.move_on_after(REQUEST_TIMEOUT_S):
                    await _handle_connection(metrics, stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                log.debug("metrics connection ended early: %s", exc)
            finally:
                active -= 1

    log.info("serving Prometheus metrics on %s:%d/metrics", host, bound_port)
    task_status.started(bound_port)
    await trio.serve_listeners(handler, listeners)
