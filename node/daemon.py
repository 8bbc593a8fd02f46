"""The Starling daemon: one trio process that owns the libp2p host and everything built on it.

The daemon is a tree of tasks in one nursery (control socket, connection manager, discovery, swarm-state
replication, averaging, and the trainer's supervisor when training); cancelling the nursery stops them
all. Each component owns its own deadlines, so no remote peer can hold the daemon. The trainer runs in
a separate worker process: the daemon only ever waits on it through a pipe, never on torch.

Stopping: :meth:`Daemon.stop` cancels the nursery, which stops every component at once; the slow ones
shield their own bounded clean-up (the supervisor lets the worker checkpoint, the replicator publishes our
departure and saves the state), and the libp2p host is closed only after the whole nursery has finished, so
those goodbyes still reach the peers. (Cancelling `run` from outside instead would cancel the host's own
tasks too: a connection still being set up is then closed under the goodbye, and the peers learn of the
departure only by suspicion.)

Why one module, though long: its one job is the node's lifetime, building the components in order,
running them in the nursery and answering their questions from the state that only the daemon holds (the
worker's status, the replica, the connections). Policy lives in the room that owns it, built here from
the components it reads: partner choice and the swarm's pace in node/averaging/partners.py (`Partners`),
which the averager's view (`AveragerSwarm` at the end) and the catch-up read.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import logging
import socket
import time
from collections.abc import Callable, Iterable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import multiaddr
import trio
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from node.averaging.averager import Averager
from node.averaging.latejoin import (
    CatchUp,
    choose_donors,
    has_checkpoint,
    late_join,
    progress_view,
    snapshot_source,
)
from node.averaging.partners import Partners
from node.averaging.swarm_view import AveragerHooks
from node.bridge.livephi import LivePhi, hold_for
from node.config.home import Home
from node.config.load import Config, write_run_config
from node.ops import refusals
from node.ops.control import serve_control
from node.ops.dashboards import StatusLog, log_directory, open_log
from node.ops.history import HistoryError, LossHistory, series_of
from node.ops.logs import log_summary_loop
from node.ops.metrics import Metrics, serve_metrics
from node.ops.sdnotify import Notifier, summarize_status, watchdog_loop
from node.ops.tensorboard import TensorBoardLog
from node.ops.wandb_log import WandbLog
from node.status_schema import DIRECT_PATHS, JoinStatus, NodeStatus, OutOfReachStatus
from node.swarm.circuit import short_id
from node.swarm.crdt import Manifest, MemberState
from node.swarm.manifest_trust import ManifestAuthority, ManifestPinError, read_manifest_pin
from node.swarm.nat import NatConfig, NatService, dial_budget_s
from node.swarm.replicator import ReplicationTiming, StateReplicator, load_state
from node.swarm.swim_service import REDIAL_S, SwimService
from node.swarm.swim_service import timing as swim_timing
from p2p.addrs import parse_bootstrap, parse_listen
from p2p.auth import AccessControl, SwarmKeyError, read_swarm_key
from p2p.bootstrap_file import watch_bootstrap_files, write_addr_file
from p2p.connmgr import SILENT_S, ConnManager
from p2p.discovery import SwarmDiscovery, make_on_connected
from p2p.fsutil import atomic_write_bytes, tighten_private_folders
from p2p.host import build_host, foreign_listeners, port_in_use
from p2p.identity import peer_id_of
from p2p.limits import MuxerOffences
from p2p.netgroup import SubnetStreamLimits
from protocols.dialback import PROTOCOL_ID as DIALBACK_PROTOCOL
from protocols.snapshot import PROTOCOL_ID as SNAPSHOT_PROTOCOL
from protocols.snapshot import ModelShape, SnapshotServer
from protocols.state import PROTOCOL_ID as STATE_PROTOCOL
from protocols.state import PROTOCOL_ID_1_0 as STATE_PROTOCOL_1_0
from protocols.state import PROTOCOL_ID_2_0 as STATE_PROTOCOL_2_0

if TYPE_CHECKING:
    from node.bridge.ipc import Adopted
    from node.bridge.supervisor import CheckedTask

AVG_PROTOCOL_VERSION = 1  # the major version of /starling/avg; peers on another one cannot average

log = logging.getLogger("starling.daemon")

# Points in the control socket's `history` answer (each member's spread over its span): ~7 MB of JSON at
# most, well inside the client's 16 MiB (node/ops/control.py), and plenty for a plot.
HISTORY_ANSWER_POINTS = 100_000

#: The protocols under per-subnet stream limits, as `status`'s `refusals` names their refusals.
SUBNET_REFUSAL_KINDS = {
    str(STATE_PROTOCOL): "state_sessions_subnet_share",
    str(STATE_PROTOCOL_2_0): "state_sessions_subnet_share",
    str(STATE_PROTOCOL_1_0): "state_sessions_subnet_share",
    str(SNAPSHOT_PROTOCOL): "snapshot_downloads_subnet_share",
    str(DIALBACK_PROTOCOL): "dialbacks_subnet_share",
}

HISTORY_SAVE_S = 30.0
STATUS_FOLLOW_S = 1.0  # the status's readers (gauges, TensorBoard) see it this often; a point per new outer step
DONOR_ADDR_TTL_S = 600  # how long a late-join donor's addresses (from its record) stay in the peerstore


def _record_addrs(texts: Iterable[str]) -> list[multiaddr.Multiaddr]:
    """The addresses a member record carries that parse (a record is a peer's claim: skip the rest)."""
    addrs = []
    for text in texts:
        try:
            addrs.append(multiaddr.Multiaddr(text))
        except Exception:
            continue
    return addrs


@functools.cache
def starling_version() -> str:
    """The installed package's version, read once: every heartbeat puts it in this node's record, and
    importlib.metadata parses the package's METADATA file on each call (5% of an idle daemon's CPU)."""
    try:
        return version("starling")
    except PackageNotFoundError:
        return "0+unknown"


class StartupError(Exception):
    """The daemon cannot start for a reason the operator must fix (exit code 2)."""


def _why_not_listening(host: str, port: int) -> str:
    """Reproduce a failed bind to report the real reason (py-libp2p only logs it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {port} is already in use"
            return e.strerror or str(e)
    return "the listener failed to start"


_E = TypeVar("_E", bound=BaseException)


def find_exception(exc: BaseException, kind: type[_E]) -> _E | None:
    """The first `kind` in `exc` or in the exception groups trio wraps it in (nested nurseries): the one
    walk the daemon (a listener's OSError) and the CLI (a StartupError under the run's nursery) share."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := find_exception(inner, kind)) is not None:
                return found
    return None


class Daemon:
    def __init__(self, cfg: Config, home: Path, key_pair: KeyPair, *, train: bool) -> None:
        self.cfg = cfg
        self.home = home
        self.layout = Home(home)
        self.key_pair = key_pair
        self.peer_id = peer_id_of(key_pair)
        self.train = train
        self.started_at = time.time()
        node = cfg.node
        for problem in tighten_private_folders(self.layout.private_folders):  # checkpoints are 0600 in 0700 folders
            log.warning("cannot make %s private (0600/0700)", problem)
        self.listen_addrs = [parse_listen(a) for a in node.listen]
        announce = [parse_listen(a, allow_wildcard=False) for a in node.announce]
        key_file = self.layout.swarm_key_file(node.swarm_key_file)
        try:
            psk = read_swarm_key(key_file) if (node.swarm_key_file or key_file.exists()) else None
        except SwarmKeyError as e:
            raise StartupError(str(e)) from None
        # Peers that overrun a stream's receive window (p2p/limits.py): their connection is closed, and the
        # averager counts each overrun as an offence (repeated ones ban the peer from averaging).
        self.muxer_offences = MuxerOffences()
        # The host's hard limit; the connection manager makes room below it for newcomers (p2p/connmgr.py).
        max_connections = node.max_peers * 2
        self.host = build_host(
            key_pair,
            announce=announce,
            max_connections=max_connections,
            dial_timeout=node.dial_timeout,
            psk=psk,
            muxer_offences=self.muxer_offences,
        )
        # Before any protocol registers its handler, so that every handler is gated.
        self.access = AccessControl(keyed=psk is not None, allow=node.allow_peers)
        self.access.install(self.host)
        # Per-subnet shares of the protocols a peer can make this node work for (see p2p/netgroup.py).
        # Averaging requests have their own per-IP share and IP bans in the averager (node/averaging/admission.py).
        self.stream_limits = SubnetStreamLimits({SNAPSHOT_PROTOCOL: 1, STATE_PROTOCOL: 4, STATE_PROTOCOL_2_0: 4,
                                                 STATE_PROTOCOL_1_0: 4, DIALBACK_PROTOCOL: 2})
        self.stream_limits.install(self.host)
        #: Set when a session or a busy refusal's referral brought this node records new to it while it was
        #: short of connections: `_learn_member_addrs` looks at once.
        self._new_members_seen = trio.Event()
        self.connmgr = ConnManager(
            self.host,
            target=node.target_peers,
            cap=node.max_peers,
            limit=max_connections,
            dial_timeout=node.dial_timeout,
            max_per_subnet=node.max_conns_per_subnet,
            explain=lambda peer, since: self.access.explain_dial(str(peer), since),
        )
        self.discovery = SwarmDiscovery(self.host, self.connmgr, node.swarm, interval=node.discovery_interval)
        for text in node.bootstrap:
            self.connmgr.add_candidate(parse_bootstrap(text), source="bootstrap", permanent=True)

        try:
            pinned = read_manifest_pin(self.layout.manifest_pin, node.swarm)
        except ManifestPinError as e:
            raise StartupError(str(e)) from None
        # What makes the run manifest unforgeable: the configured founder or hash, else the first one seen.
        authority = ManifestAuthority(founder=node.founder, manifest_hash=node.manifest_hash, pinned=pinned)
        state = load_state(
            self.layout.swarm_state,
            key_pair,
            suspect_after=node.suspect_after,
            gone_after=node.gone_after,
            max_per_subnet=node.max_members_per_subnet,
            authority=authority,
        )
        # node.membership = "swim": liveness from SWIM's probes, records re-signed only when they change.
        # A connection that delivers nothing is dropped and redialed once every connection is silent
        # (p2p/connmgr.py, SILENT_S): SWIM's probes, answered within seconds, are what says it delivers; a dropped
        # member is dialled again within the NAT service's budget before its drop counts as news.
        self.swim = SwimService(
            self.host, key_pair,
            config=swim_timing(node.swim_period_s, node.swim_ack_timeout_s, node.swim_suspicion_mult),
            connections=self.connmgr, redial_s=lambda: dial_budget_s(REDIAL_S, self.nat.typical_rtt_s()),
        ) if node.membership == "swim" else None
        self.replicator = StateReplicator(
            self.host,
            state,
            node.swarm,
            path=self.layout.swarm_state,
            pin_path=self.layout.manifest_pin,
            self_fields=self._member_fields,
            local_manifest=self._local_manifest,
            timing=ReplicationTiming(heartbeat_s=node.heartbeat_s),
            liveness=self.swim,  # SWIM mode: members' states from its probes (None: from heartbeats)
            # Swim mode: records by anti-entropy alone (pushed on change), no gossipsub; see the replicator.
            gossip=self.swim is None,
            # Over its cap, a newcomer is referred on rather than sent the whole table (the replicator's _hands_on);
            # a newcomer served may be closed without its grace; a session's answer says the connection delivers.
            connections=self.connmgr,
            on_new_members=self._new_members,
        )
        self.nat = NatService(self.host, self.connmgr, NatConfig(), psk=psk)  # dial-back probes need the key
        self.connmgr.dial = self.nat.dial
        if self.swim is not None:
            self.connmgr.on_closing = self.swim.tell_closing
            self.connmgr.silent_after = SILENT_S
            self.connmgr.stranded = self._stranded
        self.connmgr.on_connected = make_on_connected(
            self.discovery.peer_connected, self.replicator.peer_connected, self.nat.peer_connected
        )
        try:
            self.history = LossHistory.load(self.layout.history)
        except HistoryError as e:
            log.warning("%s; starting a new loss history", e)
            self.history = LossHistory()

        # The worker process must not inherit NOTIFY_SOCKET: only the daemon speaks to systemd.
        self.notifier = Notifier.from_env(unset_environment=True)
        self.metrics = Metrics()
        self.supervisor: Any = None
        self.averager: Averager | None = None
        self.catch_up: CatchUp | None = None
        self.partners = Partners(
            str(self.peer_id), cfg.sync, cfg.train, candidates=self.replicator.partner_candidates,
            alive=self.replicator.alive_members, path_of=self.nat.path_of,
            sits_out=lambda peer: self.averager is not None and self.averager.sits_out(peer),
            training=self._training,
        )
        if train:
            self.catch_up = CatchUp(
                self.host,
                home,
                cfg.sync,
                own_outer_step=self.partners.own_outer_step,
                trainers=self.partners.swarm_steps,
                deliver=lambda path, outer_step: self.supervisor.adopt_at_next_outer_step(path, outer_step),
                model=self._worker_model,
                on_refused=self._donor_lied,
                # Whether a catch-up may move the count alone (latejoin.py, `CatchUp.follow_instead`).
                link_rate_bps=lambda: self.averager.typical_rate_bps() if self.averager else None,
                period_s=lambda: self.averager.outer_period_s() if self.averager else 0.0,
                follow=lambda outer_step: self.averager.follow(outer_step) if self.averager else None,
                worker_restarts=lambda: int(self._training().get("restarts") or 0),
                may_download_from=self._may_download_from,
            )
            bind = "127.0.0.1" if all(str(a).startswith("/ip4/127.") for a in self.listen_addrs) else "0.0.0.0"
            self.averager = Averager(
                self.host,
                cfg.sync,
                AveragerSwarm(self.partners, self.nat, self._averaging_manifest_hash, self._training),
                hooks=AveragerHooks(
                    on_transfer=lambda peer, nbytes, seconds: self.nat.record_throughput(peer, nbytes, seconds),
                    on_outer_step=self.catch_up.note_outer_step,
                    on_behind=self.catch_up.behind,
                    weights_fresh=self.catch_up.weights_fresh,
                ),
                metrics=self.metrics,
                listen_host=bind,
                # The pace gives the swarm's fastest trainer H inner steps per outer step: no honest
                # partner's Delta covers more (node/averaging/robust.py).
                max_inner_steps=cfg.train.inner_steps,
            )
            self.muxer_offences.on_offence = self.averager.note_offence
        self.ready = trio.Event()
        # `stop()` cancels the component nursery when it exists, else the whole of `run` (start-up).
        self._run_scope: trio.CancelScope | None = None
        self._components_scope: trio.CancelScope | None = None
        self._stop_requested = False
        self._last_progress_step = 0
        # What joiners download: the worker's current slow weights (the shared slot, while still), else the
        # newest checkpoint's (node/bridge/livephi.py).
        self.live_phi = LivePhi(hold_s=hold_for(cfg.train.overlap))
        self.snapshots = SnapshotServer(snapshot_source(home), live=self.live_phi.snapshot, max_serving=2,
                                        bytes_per_s=cfg.sync.serve_mbps * 125_000)
        self.join_status: dict[str, Any] = {"state": "not started"}
        self._relay_only_donors: set[str] = set()  # trainers we said we take no snapshot from (logged once)
        # Our model as the start-up check described it (only where a late join will run): the donors'
        # snapshots are checked against it before a byte is downloaded.
        self._checked: CheckedTask | None = None

    # --- what this node tells the swarm ------------------------------------------------------------------

    def _training(self) -> dict[str, Any]:
        return self.supervisor.status() if self.supervisor is not None else {}

    def _member_fields(self) -> dict[str, Any]:
        tr = self._training()
        manifest = self._local_manifest()
        fields: dict[str, Any] = {
            # Circuit addresses go here, not in identify/DHT records: py-libp2p truncates them there.
            "addrs": ([str(a) for a in self.host.get_addrs()] + self.nat.relay_addrs())[:16],
            "role": "trainer" if self.train else "network-only",
            "version": starling_version(),
            "manifest_hash": manifest.hash if manifest else "",
            # The NAT verdict that status's top line shows: the record said `unknown` beside `public` there.
            "reachability": self.nat.reachability,
        }
        if self.averager is not None:
            fields["partners"] = self.averager.recent_partners()[:16]
        if tr:
            fields.update(
                outer_step=int(tr.get("outer_step") or 0),
                step=int(tr.get("step") or 0),
                loss=tr.get("loss"),
                val_loss=tr.get("val_loss"),
                samples_per_s=float(tr.get("samples_per_s") or 0.0),
            )
            self._count_progress(int(tr.get("step") or 0))
        return fields

    def _count_progress(self, step: int) -> None:
        """Feed the swarm-wide G-counter with the samples and tokens trained since the last heartbeat."""
        if step > self._last_progress_step:
            # An inner step of a worker group (train.local_ranks) covers every rank's batch.
            samples = (step - self._last_progress_step) * self.cfg.train.batch_size * self.cfg.train.local_ranks
            self._last_progress_step = step
            self.replicator.add_progress(samples, samples * self.cfg.train.seq_len)
        elif step < self._last_progress_step:  # the worker resumed from an older checkpoint
            self._last_progress_step = step

    def _local_manifest(self) -> Manifest | None:
        """The run manifest this trainer needs its partners to share (None for a network-only node)."""
        if self.supervisor is None:
            return None
        fields = self.supervisor.manifest_fields()
        if fields is None:
            return None
        return self._manifest_of(str(fields["task"]), str(fields["model_hash"]))

    def _manifest_of(self, task: str, model_hash: str) -> Manifest:
        t = self.cfg.train
        optimizer = f"{t.outer}:{t.alpha}:{t.beta}:{t.gamma}:{t.inner_steps}"
        return Manifest(
            task=task,
            model_hash=model_hash,
            optimizer_hash=hashlib.sha256(optimizer.encode()).hexdigest(),
            protocol_version=AVG_PROTOCOL_VERSION,
        )

    def _worker_model(self) -> ModelShape | None:
        """Our model as the worker's hello said it (None before): what a catch-up's donors must serve."""
        fields = self.supervisor.manifest_fields() if self.supervisor is not None else None
        return None if fields is None else ModelShape(str(fields["layout_hash"]), int(fields["numel"]))

    def _join_model(self) -> ModelShape | None:
        """Our model as the start-up check described it: what a late join's donors must serve."""
        c = self._checked
        return ModelShape(c.layout_hash, c.numel) if c is not None and c.layout_hash else None

    def _averaging_manifest_hash(self) -> str | None:
        """The manifest hash the averager compares partners' requests with: our own once the worker has
        loaded the task; until then the swarm's, which the worker will be checked against.

        Before the worker says what it trains, a request from an honest member met an unknown manifest of
        ours and was logged as `ERROR refusing ...: run manifest ... differs from ours none` on every
        normal join; with the swarm's hash it is answered `busy` (nothing to exchange yet) without an error.
        """
        if (local := self._local_manifest()) is not None:
            return local.hash
        swarm = self.replicator.state.manifest
        return swarm.hash if swarm is not None else None

    def _out_of_reach(self) -> OutOfReachStatus | None:
        """Possible partners exist and none is eligible because of the outer-step gap: what status says
        instead of nothing. After a worker restarted from an older checkpoint, the two trainers stepped solo
        side by side while status showed their old pairing as "one island of 2 trainers" (issue #27)."""
        if self.supervisor is None or self.partners.eligible():
            return None
        ours = self.partners.own_outer_step()
        steps = [m.record.outer_step for m in self.partners.possible()]
        if not steps:
            return None
        nearest = min(steps, key=lambda step: abs(step - ours))
        gap, swarm = self.cfg.sync.max_step_gap, None
        if self.catch_up is not None and self.cfg.sync.catch_up_after:
            swarm = self.catch_up.swarm_outer_step()
        return {"trainers": len(steps), "nearest_steps": abs(nearest - ours), "behind": nearest > ours,
                "catches_up": swarm is not None and abs(ours - swarm) > gap,
                "catch_up_off": not self.cfg.sync.catch_up_after, "max_step_gap": gap}

    def _on_adopted(self, report: Adopted) -> None:
        """The worker took (or refused) a catch-up snapshot."""
        assert self.catch_up is not None
        self.catch_up.adopted(report)
        if not report.error:
            # The step counter jumped with the snapshot: those samples were not trained here.
            self._last_progress_step = report.step

    def _stranded(self) -> bool:
        """Connected yet holding no member's record but this node's: nobody to dial but the peers it has
        (p2p/connmgr.py closes and redials such a node's connections once they are `SILENT_S` old). Not
        while every peer it has is one whose records it refused as incompatible (another swarm or run):
        a redial would bring the same refusal, a handshake and a session every `SILENT_S` for nothing."""
        state = self.replicator.state
        if state.member_count() - (state.member_data(str(self.peer_id)) is not None) > 0:
            return False
        incompatible = self.replicator.incompatible_peers()
        return any(p.to_base58() not in incompatible for p in self.connmgr.connected())

    def _new_members(self) -> None:
        """The replicator merged records new to this node. Below its target of connections, hand their
        addresses over now: a newcomer's first session gives it the members it has to dial (at a 64-daemon
        join, up to 5 s sooner than the next look). At the target, the next look is soon enough."""
        if self.connmgr.below_target():
            self._new_members_seen.set()

    async def _learn_member_addrs(self) -> None:
        """Members' signed records carry their addresses, circuit ones included: give them to the
        connection manager so that NATed members are reachable through their relays, and so that members
        this node is not connected to are dialed up to `node.target_peers` (suspect ones included: see
        :meth:`node.swarm.replicator.StateReplicator.members_to_dial`)."""
        # What each member's record said when last handed over: parsing every member's addresses every 5 s
        # was 2% of an idle daemon's CPU with 16 daemons. All are handed over again once a minute, for the
        # candidates the connection manager forgot (after repeated failures, or when it was full).
        handed: dict[str, tuple[str, ...]] = {}
        rounds = 0
        while True:
            members = self.replicator.members_to_dial()
            if self.swim is not None:  # members SWIM never heard of, holds dead or suspect: ask a connected member
                self.swim.look_up(m.record.peer_id for m in self.replicator.members()
                                  if m.state in (MemberState.GONE, MemberState.SUSPECT))
            if rounds % 12 == 0:
                handed = {}
            rounds += 1
            for m in members:
                if handed.get(m.record.peer_id) == m.record.addrs:
                    continue
                handed[m.record.peer_id] = m.record.addrs
                addrs = _record_addrs(m.record.addrs)
                if addrs:
                    self.connmgr.add_candidate(PeerInfo(ID.from_base58(m.record.peer_id), addrs), source="state")
            handed = {m.record.peer_id: handed[m.record.peer_id] for m in members if m.record.peer_id in handed}
            # Every 5 s, or at once when a session or a referral brought new members while this node is short
            # of connections: a newcomer whose only connection is a busy bootstrap node has nobody else to dial
            # until then.
            with trio.move_on_after(5.0):
                await self._new_members_seen.wait()
            self._new_members_seen = trio.Event()

    # --- status ------------------------------------------------------------------------------------------

    def status(self) -> NodeStatus:
        connections, authorization = self.connmgr.status(), self.access.status()
        stream_limits, muxer = self.stream_limits.status(), self.muxer_offences.status()
        replica = self.replicator.status()
        st: NodeStatus = {
            "peer_id": str(self.peer_id),
            "swarm": self.cfg.node.swarm,
            "version": starling_version(),
            "uptime_s": round(time.time() - self.started_at, 1),
            "home": str(self.home),
            "addrs": [str(a) for a in self.host.get_addrs()],
            "connected_peers": sorted(str(p) for p in self.connmgr.connected()),
            "connections": connections,
            # What this daemon was given, its command line included: `doctor` checks these, not the config's.
            "bootstrap": {"addrs": list(self.cfg.node.bootstrap), "files": list(self.cfg.node.bootstrap_files),
                          "peers": self.connmgr.bootstrap_status()},
            "discovery": self.discovery.status(),
            "role": "trainer" if self.train else "network-only",
            "authorization": authorization,
            "stream_limits": stream_limits,
            "muxer": muxer,
            # Every limit's refusals in one place, from the sections above (node/ops/refusals.py).
            "refusals": refusals.collect(
                connections=connections, muxer=muxer, authorization=authorization, stream_limits=stream_limits,
                replication=replica["swarm_totals"]["replication"],
                averaging_rejections=self.averager.rejections if self.averager is not None else {},
                snapshot_busy=self.snapshots.refused_busy, subnet_kinds=SUBNET_REFUSAL_KINDS,
                clock_capped=replica["swarm_totals"]["clock_capped"],
            ),
            "reachability": self.nat.reachability,
            "nat": self.nat.status(),
            "peers": self.nat.peers_status(),
            **replica,  # members, swarm_totals
        }
        if self.swim is not None:
            st["swim"] = self.swim.status()
        if self.supervisor is not None:
            st["training"] = self.supervisor.status()
        if self.averager is not None:
            sync = st["sync"] = self.averager.status()
            if self.catch_up is not None:
                sync["catch_ups"] = self.catch_up.catch_ups
                sync["catch_up_follows"] = self.catch_up.follows
                sync["catch_up"] = progress_view(self.catch_up.status)
            sync["out_of_reach"] = self._out_of_reach()
            join: JoinStatus = {**progress_view(self.join_status)}
            join["serving"] = self.snapshots.serving
            join["served"] = self.snapshots.served
            join["served_live"] = self.snapshots.served_live
            join["results_held_s"] = round(self.live_phi.held_s, 3)
            join["live_cut"] = self.live_phi.cut
            st["join"] = join
        return st

    async def _handle_control(self, request: dict[str, Any]) -> dict[str, Any]:
        cmd = request["cmd"]
        if cmd == "status":
            return {"ok": True, "status": self.status()}
        if cmd == "history":
            # A copy on the loop (memory copies), the lists in a thread: a full history's lists took 0.7 s.
            snapshot = self.history.snapshot()
            series = await trio.to_thread.run_sync(series_of, snapshot, HISTORY_ANSWER_POINTS)
            return {"ok": True, "history": series}
        if cmd == "ping":
            return {"ok": True}
        return {"ok": False, "error": f"unknown command {cmd!r}"}

    # --- run ---------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop gracefully: cancel the components (each runs its own bounded clean-up) while the host stays
        up to carry their goodbyes; before the components exist, cancel the start-up itself."""
        self._stop_requested = True
        if self._components_scope is not None:
            self._components_scope.cancel()
        elif self._run_scope is not None:
            self._run_scope.cancel()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until :meth:`stop` (or until cancelled from outside, which also cancels the host's tasks)."""
        with trio.CancelScope() as self._run_scope:
            if self._stop_requested:
                return
            await self._run(task_status)

    async def _run(self, task_status: trio.TaskStatus[None]) -> None:
        node = self.cfg.node
        if self.train:
            await self._check_task()
        self._check_ports_free()
        async with self.host.run(self.listen_addrs):
            self._check_listening()
            log.info("peer id %s, swarm %r", self.peer_id, node.swarm)
            for a in self.host.get_addrs():
                log.info("listening on %s", a)
            with trio.CancelScope() as self._components_scope:
                if self._stop_requested:
                    return
                await self._run_components(task_status)

    async def _run_components(self, task_status: trio.TaskStatus[None]) -> None:
        node = self.cfg.node
        async with trio.open_nursery() as nursery:
            if node.addr_file:
                write_addr_file(Path(node.addr_file), [str(a) for a in self.host.get_addrs()])
            if node.bootstrap_files:
                paths = [Path(p) for p in node.bootstrap_files]
                nursery.start_soon(watch_bootstrap_files, paths, self.connmgr)
            try:
                await nursery.start(serve_control, self.layout.control_socket, self._handle_control)
            except OSError as e:  # a read-only or foreign-owned HOME
                raise StartupError(
                    f"cannot create the control socket {self.layout.control_socket}: {e.strerror or e}"
                ) from None
            if self.swim is not None:  # before any connection: a peer's first stream must find our handler
                await nursery.start(self.swim.run)
            await nursery.start(self.connmgr.run)
            await nursery.start(self.nat.run)
            nursery.start_soon(self._learn_member_addrs)
            await nursery.start(self.discovery.run)
            await nursery.start(self.replicator.run)
            nursery.start_soon(self._keep_history)
            if node.allow_peers:
                nursery.start_soon(self._enforce_allowlist)
            if node.metrics_port:
                try:
                    await nursery.start(serve_metrics, self.metrics, node.metrics_host, node.metrics_port)
                except OSError as e:
                    raise StartupError(
                        f"cannot serve metrics on {node.metrics_host}:{node.metrics_port}: {e.strerror or e}"
                    ) from None
                log.info("metrics on http://%s:%d/metrics", node.metrics_host, node.metrics_port)
            boards = self._dashboards() if self.train else []
            if node.metrics_port or boards:
                nursery.start_soon(self._follow_status, bool(node.metrics_port), boards)
            if self.train:
                self.host.set_stream_handler(SNAPSHOT_PROTOCOL, self.snapshots.handle)
                self.supervisor = self._make_supervisor()
                assert self.averager is not None and self.catch_up is not None
                try:
                    await nursery.start(self.averager.run)
                except (OSError, BaseExceptionGroup) as e:
                    if (startup := self._datapath_error(e)) is None:
                        raise
                    raise startup from None
                await nursery.start(self.catch_up.run)
                nursery.start_soon(self._train)
            self.ready.set()
            self.notifier.ready(summarize_status(self.status()))
            nursery.start_soon(watchdog_loop, self.notifier, lambda: summarize_status(self.status()))
            nursery.start_soon(log_summary_loop, lambda: summarize_status(self.status()))
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self.notifier.stopping("stopping")

    async def _enforce_allowlist(self) -> None:
        """Connections from peers outside `node.allow_peers` are closed (their streams are already refused)."""
        while True:
            await self.access.disconnect_outsiders(self.host, self.host.get_connected_peers())
            await trio.sleep(1.0)

    async def _train(self) -> None:
        """Late join first (a node without a checkpoint starts from the swarm's weights), then train."""
        t = self.cfg.sync
        if t.join_donors > 0:
            await late_join(
                self.host,
                self.home,
                self._join_donors,
                model=self._join_model(),
                max_donors=t.join_donors,
                wait_s=t.join_wait_s,
                timeout_s=t.join_timeout_s,
                status=self.join_status,
                on_refused=self._donor_lied,
                alone=self._knows_no_one,
            )
        await self.supervisor.run()

    def _knows_no_one(self) -> bool:
        """No bootstrap peer configured, no connection and no other member: the founder's first start,
        with no donor to wait for (a peer that dials us in the late join's grace period counts)."""
        node = self.cfg.node
        me = str(self.peer_id)
        return (not node.bootstrap and not node.bootstrap_files and not self.host.get_connected_peers()
                and not any(m.record.peer_id != me for m in self.replicator.state.members()))

    def _donor_lied(self, peer: str) -> None:
        """A donor whose record carries our manifest served a snapshot of another model: that is no honest
        mistake, so it counts as an offence towards a ban, as a poisoned averaging update does."""
        if self.averager is not None:
            self.averager.note_offence(peer, "snapshot_mismatch")

    def _join_donors(self) -> list[str]:
        """The late join's donors (node/averaging/latejoin.py, `choose_donors`) among the members this node
        shows, for our run manifest: ours as the start-up check described it, else the swarm's."""
        c = self._checked
        wanted = self._manifest_of(c.name, c.model_hash).hash if c is not None and c.model_hash else None
        if wanted is None:
            swarm = self.replicator.state.manifest
            wanted = swarm.hash if swarm is not None else None
        donors = choose_donors(((m.state, m.record) for m in self.replicator.members()), str(self.peer_id), wanted,
                               self.cfg.sync.max_step_gap, self._may_download_from)
        # A joiner learns its donors from their records a second after it met the bootstrap node, before the
        # connection manager has dialled any of them (`_learn_member_addrs`, every 5 s): without their
        # addresses every download failed at once ("no known addresses") and the joiner started a fresh
        # model (bench/chaos.py, check (f)). Their signed records carry them.
        peerstore = self.host.get_peerstore()
        for record in donors:
            addrs = _record_addrs(record.addrs)
            if addrs:
                peerstore.add_addrs(ID.from_base58(record.peer_id), addrs, DONOR_ADDR_TTL_S)
        return [record.peer_id for record in donors]

    def _may_download_from(self, peer: str, reachability: str | None = None) -> bool:
        """Whether a snapshot (bulk tensors, as an exchange's) may come from `peer`: over a direct or
        hole-punched connection, or from a peer that is not connected at all and does not say it sits
        behind a NAT (its record's `reachability`; None: read it from its record), so that the download
        dials it directly. A donor reachable only through a relay would move the model over the relay,
        which `sync.allow_relay_bulk` (off by default) forbids, as for exchanges.

        Why: in the network lab a joiner behind a hostile NAT picked a trainer behind another one as a
        donor; the download dialled that trainer's addresses for 27 s before it failed, while the joiner
        had not started training (tests/test_nat_swarm_lab.py)."""
        if self.cfg.sync.allow_relay_bulk:
            return True
        path = self.nat.path_of(peer)
        if path in DIRECT_PATHS:
            return True
        if path != "none":
            return False  # relayed: a new stream would ride the relayed connection
        if reachability is None:
            member = self.replicator.state.member(peer)
            reachability = member.record.reachability if member is not None else "unknown"
        if reachability not in ("private", "relayed"):
            return True
        if peer not in self._relay_only_donors:
            self._relay_only_donors.add(peer)
            log.info("no snapshot from %s: its record says it is %s, so it is reachable only through a relay "
                     "until a hole punch succeeds (sync.allow_relay_bulk is off)", short_id(peer), reachability)
        return False

    async def _keep_history(self) -> None:
        """Record every member's progress for `starling plot`; saved every 30 s and on stop."""
        last_save = trio.current_time()
        try:
            while True:
                for m in self.replicator.state.members():
                    r = m.record
                    self.history.observe(r.peer_id, r.step, r.outer_step, r.loss, r.val_loss, r.heartbeat)
                if trio.current_time() - last_save >= HISTORY_SAVE_S:
                    data = self.history.to_bytes()
                    await trio.to_thread.run_sync(atomic_write_bytes, self.layout.history, data)
                    last_save = trio.current_time()
                await trio.sleep(1.0)
        finally:
            try:
                atomic_write_bytes(self.layout.history, self.history.to_bytes())
            except OSError as e:
                log.warning("could not save the loss history: %s", e)

    def _dashboards(self) -> list[tuple[StatusLog, str]]:
        """The dashboards' writers the config turns on (node/ops/dashboards.py), each with its line once open."""
        t, root = self.cfg.train, self.layout.root
        out: list[tuple[StatusLog, str]] = []
        if t.tensorboard_dir:
            where = log_directory(t.tensorboard_dir, root)
            out.append((TensorBoardLog(where), f"TensorBoard files in {where} (tensorboard --logdir {where})"))
        if t.wandb_dir:
            where = log_directory(t.wandb_dir, root)
            out.append((WandbLog(where, short_id(str(self.peer_id)), self.cfg.node.swarm),
                        f"offline W&B run in {where}/wandb (wandb sync {where}/wandb/offline-run-*)"))
        return out

    async def _follow_status(self, gauges: bool, boards: list[tuple[StatusLog, str]]) -> None:
        """The status, built once a second for all its readers: the Prometheus gauges (events such as rounds
        are observed where they happen) and the dashboards' files (node/ops/dashboards.py)."""
        async with contextlib.AsyncExitStack() as stack:
            opened = [b for board, ready in boards if (b := await stack.enter_async_context(open_log(board, ready)))]
            while True:
                st = self.status()
                if gauges:
                    self.metrics.update_from_status(st)
                for board in opened:
                    board.observe(st)
                await trio.sleep(STATUS_FOLLOW_S)

    def _datapath_error(self, exc: BaseException) -> StartupError | None:
        """The averager's start failed: if its side-channel listener could not bind (sync.datapath_port busy
        or not allowed), a one-line StartupError saying so; None for any other failure. Without this, a busy
        port was an 84-line ExceptionGroup and exit 1."""
        error = find_exception(exc, OSError)
        if error is None or self.averager is None or self.averager.listener is None:
            return None
        listener = self.averager.listener
        in_use = error.errno == errno.EADDRINUSE
        why = f"port {listener.port} is already in use" if in_use else (error.strerror or str(error))
        return StartupError(
            f"cannot open the averaging side channel on {listener.host}:{listener.port} (sync.datapath_port): "
            f"{why}; choose another sync.datapath_port, or 0 for any free port"
        )

    def _fixed_ports(self) -> list[tuple[multiaddr.Multiaddr, str, int]]:
        """(address, IP, port) of each listen address with an IP and a fixed (non-zero) port."""
        out = []
        for addr in self.listen_addrs:
            proto = addr.protocols()[0].name
            port = int(addr.value_for_protocol("tcp"))
            if proto in ("ip4", "ip6") and port:
                out.append((addr, addr.value_for_protocol(proto), port))
        return out

    def _check_ports_free(self) -> None:
        """A fixed listen port that anything listens on already is an operator's error (exit 2), even when
        the holder is another Starling daemon, which py-libp2p's SO_REUSEPORT would let us share silently
        (see p2p/host.py, `port_in_use`)."""
        for addr, host, port in self._fixed_ports():
            if port_in_use(host, port):
                raise StartupError(
                    f"cannot listen on {addr}: port {port} is already in use (another starling daemon with a "
                    "different --home, or another program); stop it or choose another port with --listen"
                )

    def _check_listening(self) -> None:
        for addr, host, port in self._fixed_ports():
            if foreign_listeners(host, port):  # a twin started at the same moment passed the check too
                raise StartupError(
                    f"cannot listen on {addr}: port {port} is also bound by another process (another starling "
                    "daemon started at the same time?); give each daemon its own port"
                )
        bound = self.host.get_transport_addrs()
        if len(bound) >= len(self.listen_addrs):
            return
        bound_text = {str(a) for a in bound}
        for addr in self.listen_addrs:
            if str(addr) in bound_text:
                continue
            proto = addr.protocols()[0].name
            host = addr.value_for_protocol(proto)
            port = int(addr.value_for_protocol("tcp"))
            if port == 0 and any(str(b).startswith(f"/{proto}/{host}/tcp/") for b in bound):
                continue
            raise StartupError(f"cannot listen on {addr}: {_why_not_listening(host, port)}")

    def _make_supervisor(self) -> Any:
        from node.bridge.supervisor import SupervisorHooks, WorkerSupervisor

        assert self.averager is not None
        hooks = SupervisorHooks(on_metrics=self._record_own_progress, on_adopted=self._on_adopted,
                                pace=self.partners.pace)
        return WorkerSupervisor(self.cfg.train, self.home, str(self.peer_id), self.averager.exchange,
                                task_options=self._task_options(), hooks=hooks, fragments=self.cfg.sync.fragments,
                                live=self.live_phi)

    def _task_options(self) -> dict[str, Any]:
        """The `[task]` section for the worker's task (empty for a Config built without one)."""
        section = self.cfg.sections.get("task")
        return dict(section.values) if section is not None else {}

    def _record_own_progress(self, metrics: Any) -> None:
        """Our own trainer's every report goes into the loss history as it comes, not only the member
        record's value once a heartbeat: the curve then starts at the first inner step (the worker reports
        it at once) and has the worker's resolution."""
        self.history.observe(str(self.peer_id), metrics.step, metrics.outer_step, metrics.loss, metrics.val_loss,
                             time.time())

    async def _check_task(self) -> None:
        """Before anything starts: can the worker load the configured device and task? A task that cannot
        be imported or built, or a GPU that is not there, is an operator's error (exit 2, one line), not a
        worker that fails after the daemon said it was ready (node/bridge/supervisor.py, `check_task`)."""
        from node.bridge.supervisor import TaskCheckError, check_task

        level = logging.getLevelName(logging.getLogger("starling").getEffectiveLevel()).lower()
        # A late join will run: the check builds the model too and says its size, which the donors'
        # snapshots must match (a donor's claim alone once decided how much the joiner wrote to disk).
        joining = (self.cfg.sync.join_donors > 0 and not has_checkpoint(self.home)
                   and not self.layout.join.snapshot.exists())
        try:
            checked = await check_task(self.cfg.train, str(self.peer_id), log_level=level,
                                       task_options=self._task_options(), describe=joining)
        except TaskCheckError as e:
            raise StartupError(str(e)) from None
        if checked is not None:
            self._checked = checked
            log.debug("train.task %r loads (task %s)", self.cfg.train.task, checked.name)
        try:
            write_run_config(self.home, self.cfg)  # what `export` rebuilds the model from
        except OSError as e:  # a full disk is reported by the checkpoints; export then needs `--set` again
            log.warning("cannot record the run's options in %s: %s", self.layout.run_config, e)


class AveragerSwarm:
    """The swarm as this daemon's averager sees it (node/averaging/swarm_view.py, `SwarmView`): the partner
    policy (node/averaging/partners.py) and the NAT service's paths and round trips, each answer computed when
    the averager asks. Built from those components, not from the daemon."""

    def __init__(self, partners: Partners, nat: NatService, manifest_hash: Callable[[], str | None],
                 training: Callable[[], dict[str, Any]]) -> None:
        self._partners = partners
        self._nat = nat
        self._manifest_hash = manifest_hash
        self._training = training

    def manifest_hash(self) -> str | None:
        return self._manifest_hash()

    def eligible_partners(self) -> list[str]:
        return self._partners.eligible()

    def anyone_else(self) -> bool:
        return bool(self._partners.possible())

    def path_of(self, peer: str) -> str:
        return self._nat.path_of(peer)

    def reachable(self) -> bool:
        return self._nat.reachability != "private"

    def rtt_s(self, peer: str) -> float | None:
        try:
            return self._nat.rtt_of(ID.from_base58(peer))
        except Exception:  # a malformed id or a connection closing under us: no round trip known
            return None

    def pace(self) -> float:
        return float(self._training().get("period_s") or 0.0)

    def outer_period(self) -> float:
        return self._partners.outer_period_s()

    def swarm_steps(self) -> dict[str, int]:
        return self._partners.swarm_steps()

    def speeds(self) -> dict[str, float]:
        return self._partners.speeds()
