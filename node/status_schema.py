"""The schema of a daemon's status: the dict `starling status --json` prints and the control socket returns.

The daemon builds it (node/daemon.py `Daemon.status`, which takes sections from node/bridge/supervisor.py,
node/averaging/averager.py, node/swarm/replicator.py, node/swarm/nat.py, node/averaging/latejoin.py and the p2p layer's managers), and
metrics (node/ops/metrics.py), `starling doctor` (node/ops/doctor.py), the status view (node/ops/status_view.py),
sd_notify's summary (node/ops/sdnotify.py), `make run` (node/ops/localswarm.py), benches and tests read it by
key. These TypedDicts are that contract: mypy (`make lint`) checks the builders' dict literals against
them, and the readers' subscripts (``st["training"]``) and the types of what their ``.get`` returns.

The JSON shape is the operators' API (their scripts read it): these types describe it, they do not change
it. ``NotRequired`` marks a key that only some nodes have (a network-only node has no ``training``,
``sync`` or ``join``); ``total=False`` marks a section whose keys come and go with its state (a late
join's progress). A ``None`` value means "not known yet" (no loss before the first report). The readers
still treat every key as possibly absent or mistyped, since an older daemon may answer: the schema says
what this version writes.

The p2p layer's own sections (``connections``, ``discovery``, ``authorization``, ``stream_limits``) are
declared in p2p/status.py, since p2p/ cannot import node/, and re-exported here. Like that module, this one
imports nothing heavy: `starling status` renders with it.
"""

# No `from __future__ import annotations`: Python 3.11's TypedDict reads NotRequired only from evaluated
# annotations, and tests read __required_keys__.
from typing import Literal, NotRequired, TypedDict

from p2p.status import (
    AuthorizationStatus,
    BootstrapPeerStatus,
    ConnectionsStatus,
    DiscoveryStatus,
    MuxerStatus,
    StreamLimitsStatus,
)

__all__ = [
    "AuthorizationStatus", "BootstrapPeerStatus", "BootstrapStatus", "ConnectionsStatus", "DiscoveryStatus", "DownloadStatus",
    "ExchangeCounts", "IncompatiblePeerStatus", "JoinStatus", "MemberStatus", "MixingStatus", "NatStatus", "NodeStatus", "PeerLinkStatus",
    "PeerPathStatus", "ProgressStatus", "RefusalStatus", "RefusalsStatus", "ReplicaStatus", "ReplicationStatus", "SittingOutStatus",
    "StreamLimitsStatus", "TransferStatus",
    "SwarmTotals", "SwimStatus", "SyncStatus", "TrainingStatus",
]  # fmt: skip


# --- training: the local torch worker, as its supervisor sees it (node/bridge/supervisor.py) -------------------------


class ExchangeCounts(TypedDict):
    """Outer steps by how their exchange ended."""

    group: int  # averaged with one or more partners
    solo: int  # no partner: a local outer step
    failed: int  # the exchange failed (the worker stepped solo)


class TrainingStatus(TypedDict):
    """``training``: the worker's progress and health (trainers only)."""

    state: str  # idle | starting | training | restarting | stopping | stopped | failed
    task: str
    device: str | None  # None until the worker has said hello
    step: int  # inner optimizer steps
    outer_step: int  # averaging steps (partners are chosen by it)
    loss: float | None
    val_loss: float | None
    samples_per_s: float
    lr: float | None
    restarts: int
    pid: int | None
    group_pids: list[int] | None  # with train.local_ranks > 1: the worker group's pids, rank 0 first
    resumed_step: int | None
    checkpoint_step: int | None
    checkpoint_rejected: list[str]  # "path: reason" for each corrupt checkpoint set aside
    checkpoint_error: str | None  # while checkpoints fail (a full disk): "at step N: [Errno 28] ..."
    checkpoint_failures: int  # failed checkpoints in a row, since the last one written
    exchanges: ExchangeCounts
    last_group_size: int | None
    last_inner_steps: int | None  # inner steps in the latest outer step (fewer on slower machines)
    period_s: float | None  # the swarm's pace: seconds between two outer steps (None: every H steps)
    error: str | None


# --- sync: the averager (node/averaging/averager.py) and the catch-up (node/averaging/latejoin.py) ------------------------------


class MixingStatus(TypedDict):
    """``sync.mixing``: whom this node averaged with over its last ``window`` outer steps."""

    window: int
    outer_steps: int
    averaged: int
    solo: int
    solo_share: float | None  # None before the first outer step
    scheduled: int  # averaged with the partner the schedule chose first
    partners: dict[str, int]  # partner peer id -> outer steps averaged with it
    distinct_partners: int


class PeerLinkStatus(TypedDict):
    """``sync.per_peer[peer_id]``: the averaging link to one partner."""

    rounds: int
    bytes_sent: int
    bytes_received: int
    rate_mbps: float | None  # each way: recent transfers' bytes over the seconds they flowed; None before any was measured
    failures: int
    path: str  # datapath (side channel) or stream (libp2p); "" before the first transfer
    clipped: int


class DownloadStatus(TypedDict):
    """One donor's download in a late join or catch-up."""

    have_chunks: int
    done: bool
    bytes: int
    error: str  # "" while it goes well


class ProgressStatus(TypedDict, total=False):
    """A late join's or catch-up's progress (node/averaging/latejoin.py); its keys follow its state."""

    state: str
    error: str
    donors: list[str]
    from_outer_step: int
    swarm_outer_step: int
    snapshot_outer_step: int
    outer_step: int
    step: int
    downloads: dict[str, DownloadStatus]
    refused: list[str]  # donors whose snapshot was not our model: dropped before a byte was written
    attempt: int  # a late join's download attempt (a failed one looks for donors again, up to 3)


class JoinStatus(ProgressStatus, total=False):
    """``join``: this node's late join, and the snapshots it serves to joiners."""

    serving: int  # downloads being served now
    served: int
    served_live: int  # of those, the worker's current weights (node/bridge/livephi.py), not a checkpoint's
    results_held_s: float  # seconds this worker's outer results waited for such downloads to end
    live_cut: int  # live downloads cut because the weights changed first (the joiner then gets a checkpoint)


class TransferStatus(TypedDict):
    """``sync.transfer``: the exchange whose transfer is running now (a slow link's can take minutes)."""

    partner: str
    bytes: int  # both ways so far
    seconds: float  # since the pairing
    rate_mbps: float | None  # each way while bytes flowed (None: too early to say)


class SittingOutStatus(TypedDict):
    """``sync.sitting_out``: trainers that missed averaging rounds in a row and are not waited for as partners
    until their back-off ends (node/averaging/partner_misses.py)."""

    count: int  # peers sitting out now
    exclusions: int  # times a peer was made to sit out, since start
    peers: dict[str, float]  # peer id -> seconds left, the most first; at most 16 named (count has them all)


class RefusalStatus(TypedDict):
    """``sync.last_refusal``: the latest averaging request refused, either way (node/averaging/averager.py)."""

    peer: str
    by: str  # partner (it refused our request) | us (we refused its request)
    reason: str  # the refuser's words, e.g. "outer steps too far apart: yours 30, ours 35"
    hint: str  # what it means here ("this node is 5 outer steps behind ...: it catches up"), or ""
    seconds_ago: float
    averaged_since: bool  # an exchange completed after it (status's `not averaging:` line is then left out)


class OutOfReachStatus(TypedDict):
    """``sync.out_of_reach``: alive trainers of this run exist, and every one is further than the allowed
    gap of outer steps away (node/daemon.py): nobody this node can average with, and why."""

    trainers: int  # the possible partners, all out of reach
    nearest_steps: int  # outer steps between this node and the nearest of them
    behind: bool  # this node is behind the nearest of them; else ahead
    catches_up: bool  # this node is off the swarm's position (node/averaging/latejoin.py CatchUp): it re-syncs, not them
    catch_up_off: bool  # sync.catch_up_after = 0: nobody catches up
    max_step_gap: int


class AskedExchangeStatus(TypedDict):
    """Where the time of our latest asked exchange went (node/averaging/phases.py)."""

    partner: str
    phases_s: dict[str, float]  # open, answer, connect, transfer, result
    rtt_ms: float | None  # the connection's round trip then (None: not measured yet)
    phases_rtt: dict[str, float] | None  # each phase in round trips


class SyncStatus(TypedDict):
    """``sync``: averaging rounds with partners (trainers only)."""

    rounds: int
    solo_rounds: int
    unpaired_rounds: int  # solo at once: no eligible partner when the outer step began
    failures: int
    declined: int
    last_partner: str | None
    last_duration_s: float | None
    last_bytes: int | None
    # payload bytes sent per parameter in the latest exchange (phi + Delta); with streaming fragments, in the
    # latest sync of each fragment, over their parameters: per outer step either way (node/averaging/report.py)
    last_bytes_per_param: float | None
    last_path: str | None
    bytes_sent: int
    bytes_received: int
    last_error: str | None
    distinct_partners: int  # since the daemon started (mixing.distinct_partners: the recent window)
    wire_dtype: str
    compression: str  # sync.compression as configured: auto, or the fixed preset (protocols/compress.py)
    last_compression: str | None  # the preset the latest exchange's wire used (auto chooses per exchange)
    last_asked: AskedExchangeStatus | None  # the phases of our latest exchange that we asked for (node/averaging/phases.py)
    datapath_port: int | None
    per_peer: dict[str, PeerLinkStatus]
    mixing: MixingStatus
    state: str  # idle | pairing | exchanging | solo (the window closed without a partner: a solo step)
    transfer: NotRequired[TransferStatus]  # while exchanging
    # Streaming fragments (sync.fragments > 1 only): the count, and the fragment the round in progress syncs
    # (None while idle); `last_*` and `rounds` count fragment syncs then.
    fragments: NotRequired[int]
    fragment: NotRequired[int | None]
    rejections: dict[str, int]  # partner updates refused, by reason (node/averaging/robust.py)
    clipped: dict[str, int]  # partner updates clipped, by part: delta | phi
    banned: list[str]
    sitting_out: SittingOutStatus  # partners that missed rounds in a row, sitting out a back-off
    last_refusal: RefusalStatus | None  # why the latest refused request was refused (None: none yet)
    catch_ups: NotRequired[int]  # snapshots the worker adopted
    catch_up_follows: NotRequired[int]  # catch-ups that moved the outer-step count alone, without a download
    catch_up: NotRequired[ProgressStatus]
    out_of_reach: NotRequired[OutOfReachStatus | None]  # set while every possible partner is beyond the gap


# --- membership: the swarm-state replica (node/swarm/replicator.py) -----------------------------------------------


class MemberStatus(TypedDict):
    """``members[i]``: one member record as this node holds it."""

    peer_id: str
    self: bool
    state: str  # alive | suspect | gone | left
    role: str  # trainer | network-only
    version: str
    outer_step: int
    step: int
    loss: float | None
    val_loss: float | None
    samples_per_s: float
    partners: list[str]  # whom it averaged with over its recent outer steps
    reachability: str
    addrs: list[str]
    manifest_hash: str
    incompatible: bool
    last_seen: float  # this node's clock when it last heard from the member: its newest record (gossip mode), or
    # SWIM's last evidence that it lives (swim mode: a message or an ack from it; its record is re-signed rarely)
    last_seen_s: float  # seconds since then
    heartbeat: float  # the author's wall time when it wrote the record
    received_at: float  # our wall time when it arrived


class ReplicationStatus(TypedDict):
    """``swarm_totals.replication``: the replica's anti-entropy and gossip counters."""

    sessions_ok: int
    session_failures: dict[str, int]  # by reason: timeout, malformed, ...
    records_sent: int
    records_received: int
    records_changed: int
    gossip_published: int
    gossip_received: int
    gossip_refused: int
    gossip_dropped: int
    manifest_mismatches: int
    busy_refusals: int  # inbound sessions answered "busy" (all slots, or the peer's share, taken)
    peer_share_refusals: int  # of those, refused for the peer's share while slots were left
    referred_records: int  # member records sent in the referrals of those refusals (state 2.0.0 and later)
    referrals_received: int  # records received in busy refusals' referrals (any outcome)
    referrals_changed: int  # of those, new to this node
    newcomers_handed_on: int  # of the busy refusals, newcomers referred on while this node was crowded (over its cap)
    introductions: int  # of records_changed: initiators' own member records taken from their hellos (state 2.1.0)
    saves: int
    save_errors: int
    last_save: float | None  # wall time


class IncompatiblePeerStatus(TypedDict):
    """``swarm_totals.incompatible[i]``: a peer refused as incompatible, and what differs.

    ``field`` is ``swarm`` (the swarm names differ) or ``manifest`` (the run manifests differ: task, model
    config, optimizer config or protocol version; the state protocol's hello carries only the manifest's hash,
    so which of them is named in ``differs`` only when the peer runs the swarm's manifest, which this node
    holds: ``our_manifest`` lists this node's)."""

    peer_id: str
    field: str  # swarm | manifest
    theirs: str  # its swarm name, or its manifest hash
    ours: str
    version: str  # the Starling version it runs ("" if it did not say)
    differs: list[str]  # manifest fields that differ, where both manifests are known here (else [])


class SwarmTotals(TypedDict):
    """``swarm_totals``: the swarm as this node's replica sees it."""

    members: dict[str, int]  # member state -> count (every state present, 0 included)
    samples: int
    tokens: int
    rejected: dict[str, int]  # records refused, by reason
    manifest_hash: str | None
    manifest_founder: str | None
    manifest_authority: str
    manifest_error: str | None
    member_groups: dict[str, int]  # peers held per network group, the largest few
    crowd_evictions: int
    clock_capped: int  # others' records dated over MAX_LEAD_S ahead: kept, our clock not moved past the bound
    incompatible_peers: list[str]
    incompatible: list[IncompatiblePeerStatus]  # the same peers, with what differs
    our_manifest: dict[str, str | int] | None  # task, model_hash, optimizer_hash, protocol_version
    replication: ReplicationStatus


class ReplicaStatus(TypedDict):
    """The replica's part of the status (node/swarm/replicator.py), merged into its top level."""

    members: list[MemberStatus]
    swarm_totals: SwarmTotals


class SwimStatus(TypedDict):
    """``swim``: the SWIM membership service's counters since start (node/swarm/swim_service.py; swim mode only).

    ``probes`` are this node's own (round-robin and on a dropped connection), ``acks`` those answered
    (directly or through helpers), ``suspects_raised`` the probes that ended with no ack and made the member
    suspect here; ``refutations`` suspicions of this node it answered with a higher incarnation. A message is
    dropped (``dropped``, by reason) when its peer is not connected, has no stream, has a full outbox, or it is
    too large. Bytes are frame payloads on ``/starling/swim/1.0.0``."""

    probes: int
    indirect_probes: int  # probes that asked helpers (no direct ack in time)
    acks: int
    alive_by_traffic: int  # probes with no ack in time that ended anyway: the member's connection delivered data since
    #: Pings (our probes', and those run for others) that waited longer than the ack timeout for answers that
    #: came slowly (node/swarm/membership.py, "Slow answers are waited for"); members held slow one by one; and
    #: the wait a member never timed gets now (0: the configured timeout).
    waits_stretched: int
    slow_members: int
    answer_wait_s: float
    suspects_raised: int
    suspects_seen: int  # members turned suspect in this node's view, whoever raised it (a suspicion heard counts)
    #: The members last turned suspect here (at most 16): peer ID -> when (Unix time), so that a suspicion refuted
    #: before anyone looked still shows.
    recent_suspects: dict[str, float]
    no_evidence: int  # probes that ended with nobody asked (no connection to the member, no helper): no suspicion
    refutations: int
    declared_dead: int
    messages_sent: int
    messages_received: int
    messages_dropped: int
    dropped: dict[str, int]  # by reason: not_connected, no_stream, outbox_full, too_large
    #: Dropped connections taken as a close (closed_here: this node's, or at the peer's closing notice) or probed
    #: as news (disconnect_probes); closing notices sent and received (node/swarm/swim_service.py).
    closes: dict[str, int]
    bytes_sent: int
    bytes_received: int
    members: dict[str, int]  # held by the SWIM core: alive, suspect, dead (this node included in alive)
    names: int  # peer names interned (bounded; dead members' reclaimed)
    local_health: int  # Lifeguard's local health score: 0 healthy; timeouts are stretched by (1 + it)
    loop_lag_max_s: float  # the most this node's timer loop woke late (a starved or busy event loop)


# --- the network: NAT traversal (node/swarm/nat.py) ------------------------------------------------------------


class NatStatus(TypedDict):
    """``nat``: reachability verdict, relay service and relay slots, dial-back counts."""

    reachability: str  # public | private | unknown
    reason: str
    reachability_reason: str
    relay_service: str  # serving | off
    relay_clients: int  # peers holding a reservation on us
    relay_circuits: int  # circuits we relay now
    relays: list[str]  # relays we hold a slot on
    relay_addrs: list[str]
    dialback_helpers: int
    dialbacks_served: int


#: How we reach a peer (node/swarm/nat.py, `NatService.path_of`).
ConnectionPath = Literal["direct", "hole-punched", "relayed", "none"]
#: The paths bulk tensors may take (the side channel, an exchange's bytes): a connection of our own, never a
#: relay's circuit, unless `sync.allow_relay_bulk`. The daemon, the averager and NAT traversal all ask this.
DIRECT_PATHS: frozenset[ConnectionPath] = frozenset({"direct", "hole-punched"})


class PeerPathStatus(TypedDict):
    """``peers[i]``: one connected peer's network path."""

    peer_id: str
    path: ConnectionPath
    rtt_ms: float | None
    throughput_mbps: NotRequired[float]  # once a bulk transfer measured it
    note: NotRequired[str]  # why a relayed peer is not direct


class BootstrapStatus(TypedDict):
    """``bootstrap``: what this daemon was given, its command line included (`doctor` checks these)."""

    addrs: list[str]
    files: list[str]
    peers: list[BootstrapPeerStatus]  # every bootstrap peer (files' too): connected, or why not


# --- refusals: every limit's refusals in one place (node/ops/refusals.py) ---------------------------------------


class RefusalsStatus(TypedDict):
    """``refusals``: what this node refused to peers, by kind and why (counts since start).

    Sums of counters kept elsewhere in the status (and the snapshot server's), so that one place answers
    "is anybody hitting my limits?". The averager's own refusal reasons (too_many_requests,
    too_many_requests_from_ip, banned_ip) are in ``sync.rejections`` too; its other reasons are refused
    updates, not requests."""

    connections_over_cap: int  # connections.cap_pruned
    connections_subnet_cap: int  # connections.subnet_pruned
    connections_window_overrun: int  # muxer.window_overruns: closed for sending past a receive window
    handshakes_refused: int  # authorization.refused_handshakes (swarm key, or not a Noise peer)
    peers_not_allowed: int  # authorization.refused_peers (node.allow_peers)
    state_sessions_busy: int  # all MAX_INBOUND_SESSIONS held (replication.busy_refusals less the next)
    state_sessions_peer_share: int  # replication.peer_share_refusals
    state_sessions_subnet_share: int  # stream_limits.refused of /starling/state
    snapshot_downloads_busy: int  # the snapshot server's max_serving downloads under way
    snapshot_downloads_subnet_share: int  # stream_limits.refused of the snapshot protocol
    dialbacks_subnet_share: int  # stream_limits.refused of the dial-back protocol
    averaging_requests_busy: int  # sync.rejections.too_many_requests
    averaging_requests_per_ip: int  # sync.rejections.too_many_requests_from_ip
    averaging_requests_banned_ip: int  # sync.rejections.banned_ip
    clocks_capped: int  # swarm_totals.clock_capped: a record's clock over MAX_LEAD_S ahead was not followed


# --- the whole status --------------------------------------------------------------------------------------


class NodeStatus(TypedDict):
    """What ``starling status --json`` prints and the control socket's ``status`` command returns."""

    peer_id: str
    swarm: str
    version: str
    uptime_s: float
    home: str
    addrs: list[str]
    connected_peers: list[str]
    connections: ConnectionsStatus
    bootstrap: BootstrapStatus
    discovery: DiscoveryStatus
    role: str  # trainer | network-only
    authorization: AuthorizationStatus
    stream_limits: StreamLimitsStatus
    muxer: MuxerStatus  # peers that overran a stream's receive window (p2p/limits.py)
    refusals: RefusalsStatus  # what every limit refused, summed by kind (node/ops/refusals.py)
    reachability: str  # public | private | unknown
    nat: NatStatus
    peers: list[PeerPathStatus]
    members: list[MemberStatus]
    swarm_totals: SwarmTotals
    running: NotRequired[bool]  # added by `starling status --json` (true), as its no-daemon answer has false
    training: NotRequired[TrainingStatus]  # trainers only, as the three below
    sync: NotRequired[SyncStatus]
    join: NotRequired[JoinStatus]
    swim: NotRequired[SwimStatus]  # node.membership = swim only
