"""The daemon's side of an outer step: pair with one random partner and average, or step solo.

The worker publishes `(phi, Delta)` in shared memory and the supervisor calls `Averager.exchange`. For
up to `sync.pair_window_s` the node both *asks* random eligible partners and *accepts* requests from
partners that are ready themselves; whichever pairing happens first completes this outer step. No node
ever waits for more than one partner, and a partner that is busy, refuses, fails or misses its deadline
costs a back-off for that partner and, at worst, a solo step here.

Crossing requests (A asks B while B asks A) become one exchange: the request of the smaller PeerID wins.
Deadlines come from each link's measured throughput (an EWMA), not from a fixed timeout.

Two rules keep heterogeneous machines from drifting apart for good:

- When the daemon knows of no other trainer that could pair at all (alive, of our run, with a usable
  path, whatever its outer step), the outer step is solo at once: waiting out the pairing window would
  only slow down a node that nobody can pair with. Trainers that exist but whose records put them outside
  `sync.max_step_gap` still get the window (records lag a heartbeat, and in a swarm of short outer steps
  a node that never waited would race away from everyone). Busy partners count as eligible.
- After an exchange both partners adopt the larger of their two outer steps (each learns the other's
  from the request or the answer, `ExchangeRequest.group_outer_step` hands it to the worker), so paired
  nodes' counters never drift apart. A node that has had no eligible partner for a while re-syncs from
  the swarm instead (node/latejoin.py, `CatchUp`), fed by `on_outer_step`.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import trio
from libp2p.peer.id import ID

from node.sync_config import SyncConfig
from p2p.datapath import DataPathListener
from protocols import avg
from protocols.avg import Declined, Rejected, Tensors
from protocols.wire import ProtocolError, close_quietly

log = logging.getLogger("starling.averager")

BACKOFF_MAX_S = 300.0
# Protocol errors that only a buggy or hostile partner produces (a dead link is no offence).
_MALFORMED = {"malformed", "too_large", "bad_kind", "bad_version", "bad_field", "bad_size", "auth"}
RATE_EWMA = 0.5
MAX_INBOUND = 16  # pairing requests read concurrently


def layout_hash(layout: Any) -> str:
    return hashlib.sha256(msgpack.packb([[n, list(s)] for n, s in layout])).hexdigest()


@dataclass
class _Pending:
    """This node's published outer step while it looks for a partner."""

    request: Any  # node.supervisor.ExchangeRequest
    tensors: Tensors
    layout_hash: str
    claimed_by: str | None = None  # partner peer id once an exchange owns the outputs; "solo" when closed
    initiating_to: str | None = None
    result: int = 1
    done: trio.Event = field(default_factory=trio.Event)
    transfer_finished: trio.Event = field(default_factory=trio.Event)
    transfer_scope: trio.CancelScope | None = None
    partner_outer_step: int | None = None  # the partner's, from its request or its answer


@dataclass
class _Link:
    """What we know of one partner: measured rate and back-off."""

    rate_bps: float
    failures: int = 0
    offences: int = 0
    banned_until: float = 0.0
    next_try: float = 0.0
    rounds: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    last_path: str = ""  # what carried the bulk last time: datapath (side channel) or stream (libp2p)


class Averager:
    def __init__(
        self,
        host: Any,
        cfg: SyncConfig,
        *,
        manifest_hash: Callable[[], str | None],
        eligible_peers: Callable[[], list[str]] | None = None,
        metrics: Any = None,
        listen_host: str = "127.0.0.1",
        path_of: Callable[[str], str] | None = None,
        on_transfer: Callable[[str, int, float], None] | None = None,
        reachable: Callable[[], bool] | None = None,
        on_outer_step: Callable[[bool], None] | None = None,
        anyone_else: Callable[[], bool] | None = None,
    ) -> None:
        self.host = host
        self.cfg = cfg
        self.manifest_hash = manifest_hash
        self.eligible_peers = eligible_peers
        self.metrics = metrics
        self.path_of = path_of  # direct | hole-punched | relayed | none (p2p/nat.py)
        self.on_transfer = on_transfer
        # Behind a NAT our side-channel port cannot be reached: offering it would cost the partner a
        # connect timeout on every round before it falls back to the libp2p stream.
        self.reachable = reachable
        # Told at the start of every outer step whether any partner was eligible (the catch-up counts
        # the steps without one).
        self.on_outer_step = on_outer_step
        # Whether any other trainer of our run could pair at all, whatever its outer step: when none can,
        # the outer step is solo at once. Trainers that the records show outside the step gap still get the
        # pairing window: records lag (a heartbeat old), the gap is judged on the actual request, and where
        # outer steps are short a node that never waits races ahead of everyone and pairs with no one.
        self.anyone_else = anyone_else
        self.listener = DataPathListener(listen_host, cfg.datapath_port, max_frame_size=avg.MAX_FRAME) if cfg.datapath else None
        self.me = str(host.get_id())
        self._pending: _Pending | None = None
        self._links: dict[str, _Link] = {}
        self.stats: dict[str, Any] = {
            "rounds": 0,
            "solo_rounds": 0,
            "unpaired_rounds": 0,  # solo at once: no eligible partner when the outer step began
            "failures": 0,
            "declined": 0,
            "last_partner": None,
            "last_duration_s": None,
            "last_bytes": None,
            "last_path": None,
            "bytes_sent": 0,
            "bytes_received": 0,
            "last_error": None,
        }
        self._partners: set[str] = set()
        self.rejections: dict[str, int] = {}
        self._inbound = 0
        self._norms: collections.deque[float] = collections.deque(maxlen=32)  # accepted Delta norms

    # --- lifecycle ---------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.host.set_stream_handler(avg.PROTOCOL_ID, self._handle_stream)
        async with trio.open_nursery() as nursery:
            if self.listener is not None:
                await nursery.start(self.listener.serve)
            task_status.started()
            await trio.sleep_forever()

    def status(self) -> dict[str, Any]:
        st = dict(self.stats)
        st["distinct_partners"] = len(self._partners)
        st["wire_dtype"] = self.cfg.wire_dtype
        st["datapath_port"] = self.listener.port if self.listener is not None else None
        st["per_peer"] = {
            p: {"rounds": link.rounds, "bytes_sent": link.bytes_sent, "bytes_received": link.bytes_received,
                "rate_mbps": round(link.rate_bps * 8 / 1e6, 1), "failures": link.failures, "path": link.last_path}
            for p, link in self._links.items()
        }
        st["state"] = "pairing" if self._pending is not None else "idle"
        st["rejections"] = dict(self.rejections)
        now = trio.current_time()
        st["banned"] = sorted(p for p, link in self._links.items() if link.banned_until > now)
        return st

    # --- validation of what partners send ------------------------------------------------------------------

    def _validate(self, mine: float, theirs: float) -> None:
        """Reject a partner's Delta whose norm is far outside ours and the recent history (poisoning)."""
        history = list(self._norms)
        reference = max(mine, statistics.median(history) if history else 0.0)
        if not math.isfinite(theirs) or (reference > 0 and theirs > self.cfg.max_delta_ratio * reference):
            raise Rejected(
                "delta_norm",
                f"Delta norm {theirs:.3g} is over {self.cfg.max_delta_ratio:g}x the reference {reference:.3g}",
            )

    # --- the supervisor's call ---------------------------------------------------------------------------

    async def exchange(self, request: Any) -> int:
        """Average this outer step with one partner; returns 2, or 1 for a solo step.

        With 2, `request.phi_out` and `request.delta_out` hold the pair's sums of phi and Delta (the
        same bits on both partners; the worker's outer step divides by the group size).

        After an exchange, `request.group_outer_step` is the larger of the two outer steps (the worker
        adopts it). With no other trainer to pair with (`anyone_else`) the step is solo at once (see the
        module docstring); otherwise it waits up to the pairing window for a partner.
        """
        if self.eligible_peers is not None:
            has_partner = any(p != self.me for p in self.eligible_peers())
            if self.on_outer_step is not None:
                self.on_outer_step(has_partner)
            if not has_partner and self.anyone_else is not None and not self.anyone_else():
                self.stats["solo_rounds"] += 1
                self.stats["unpaired_rounds"] += 1
                log.debug("outer step %d: solo after 0.00s (no other trainer to pair with)", request.outer_step)
                return 1
        pending = _Pending(
            request,
            Tensors(request.phi, request.delta, request.phi_out, request.delta_out),
            layout_hash(request.layout),
        )
        began = trio.current_time()
        self._pending = pending
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pair, pending)
                await pending.done.wait()
                nursery.cancel_scope.cancel()
        finally:
            self._pending = None
            if pending.transfer_scope is not None and not pending.transfer_finished.is_set():
                # We are being cancelled while a responder transfer writes into the outputs: stop it
                # and wait for it to let go of the shared memory before the worker reuses it.
                pending.transfer_scope.cancel()
                with trio.CancelScope(shield=True), trio.move_on_after(5):
                    await pending.transfer_finished.wait()
        if pending.result < 2:
            self.stats["solo_rounds"] += 1
        else:
            request.group_outer_step = self._group_outer_step(request.outer_step, pending.partner_outer_step)
        log.debug("outer step %d: %s after %.2fs", request.outer_step,
                  "averaged" if pending.result >= 2 else "solo", trio.current_time() - began)
        return pending.result

    async def _pair(self, pending: _Pending) -> None:
        deadline = trio.current_time() + self.cfg.pair_window_s
        while pending.claimed_by is None and trio.current_time() < deadline:
            partner = self._choose_partner()
            if partner is None:
                await trio.sleep(random.uniform(0.1, 0.4))
                continue
            await self._try_partner(pending, partner)
            if pending.claimed_by is None:
                await trio.sleep(random.uniform(0.05, 0.2))
        if pending.claimed_by is None:
            pending.claimed_by = "solo"  # close the door to late requests
            pending.result = 1
            pending.done.set()

    def _may_punch(self, partner: str) -> bool:
        """Whether to open a punched side channel with `partner` where its listener (or ours) is behind a
        NAT: only with the side channel on and over a direct connection (a relayed one's remote address is
        the relay's, so a punch towards it could only fail)."""
        return self.cfg.datapath and (self.path_of is None or self.path_of(partner) in ("direct", "hole-punched"))

    def _group_outer_step(self, ours: int, theirs: int | None) -> int:
        """The outer step both partners continue from: the larger one. A partner's step beyond our own gap
        (its `max_step_gap` may be larger than ours) is not adopted: we keep our own."""
        if theirs is None or abs(theirs - ours) > self.cfg.max_step_gap:
            return ours
        if theirs > ours:
            log.debug("adopting the partner's outer step %d (ours was %d)", theirs, ours)
        return max(ours, theirs)

    def _choose_partner(self) -> str | None:
        now = trio.current_time()
        connected = {str(p) for p in self.host.get_connected_peers()}
        pool = connected if self.eligible_peers is None else connected & set(self.eligible_peers())
        pool.discard(self.me)
        ready = [p for p in pool if self._link(p).next_try <= now and self._link(p).banned_until <= now]
        return random.choice(ready) if ready else None

    def _link(self, peer: str) -> _Link:
        link = self._links.get(peer)
        if link is None:
            link = self._links[peer] = _Link(rate_bps=self.cfg.assumed_rate_mbps * 1e6 / 8)
        return link

    def _transfer_deadline(self, peer: str, numel: int) -> float:
        plan = avg.make_plan(numel, self.cfg.wire_dtype, 4096)
        expected = 2 * plan.total_bytes / max(self._link(peer).rate_bps, 1.0)
        return 10.0 + self.cfg.deadline_slack * expected

    def _request_fields(self, pending: _Pending) -> dict[str, Any]:
        return {
            "outer_step": pending.request.outer_step,
            "manifest_hash": self.manifest_hash() or "none",
            "layout_hash": pending.layout_hash,
            "wire_dtype": self.cfg.wire_dtype,
            "int8_block": 4096,
            "datapath": self.listener is not None,
        }

    async def _try_partner(self, pending: _Pending, partner: str) -> None:
        pending.initiating_to = partner
        began = trio.current_time()
        claimed_here = False
        numel = pending.tensors.phi.numel()
        try:
            stream = None
            with trio.fail_after(self.cfg.handshake_timeout_s):
                stream = await self.host.new_stream(ID.from_base58(partner), [avg.PROTOCOL_ID])

            def claim(partner_outer_step: int) -> bool:
                nonlocal claimed_here
                if pending.claimed_by is not None:
                    return False  # a crossing request claimed this step meanwhile
                pending.claimed_by = partner
                pending.partner_outer_step = partner_outer_step
                claimed_here = True
                return True

            try:
                result = await avg.initiate(
                    stream,
                    self._request_fields(pending),
                    pending.tensors,
                    local_peer_id=self.host.get_id().to_bytes(),
                    remote_peer_id=ID.from_base58(partner).to_bytes(),
                    remote_ip=avg.partner_ip(stream),
                    handshake_timeout=self.cfg.handshake_timeout_s,
                    transfer_deadline=self._transfer_deadline(partner, numel),
                    on_accept=claim,
                    validate=self._validate,
                    offer_punch=self._may_punch(partner),
                )
            finally:
                await close_quietly(stream)
        except Declined as e:
            self.stats["declined"] += 1
            self._back_off(partner, soft=True)
            log.debug("partner %s declined: %s", partner, e)
            return
        except Exception as e:  # ProtocolError, TooSlowError, and whatever libp2p raises for a dead stream
            self._fail(partner, e, trio.current_time() - began)
            if claimed_here:  # our exchange owned this step and failed: solo, nothing applied
                pending.result = 1
                pending.done.set()
            return
        finally:
            pending.initiating_to = None
        self._succeed(partner, result)
        pending.result = 2
        pending.done.set()

    # --- the responder -----------------------------------------------------------------------------------

    async def _handle_stream(self, stream: Any) -> None:
        """Inbound requests: at most MAX_INBOUND read at once (each under the handshake deadline), so
        silent or slow peers cannot pile up tasks and buffers; extra ones are reset at once."""
        if self._inbound >= MAX_INBOUND:
            self.rejections["too_many_requests"] = self.rejections.get("too_many_requests", 0) + 1
            await close_quietly(stream, reset=True)
            return
        self._inbound += 1
        try:
            await self._serve_request(stream)
        finally:
            self._inbound -= 1

    async def _serve_request(self, stream: Any) -> None:
        partner = str(stream.muxed_conn.peer_id)
        try:
            request = await avg.read_request(stream, self.cfg.handshake_timeout_s)
        except (ProtocolError, trio.TooSlowError) as e:
            self._fail(partner, e, 0.0, count=isinstance(e, ProtocolError))
            await close_quietly(stream, reset=True)
            return
        pending = self._pending
        verdict = self._judge(request, pending, partner)
        if verdict is not None:
            await avg.answer(stream, verdict[0], verdict[1], pending.request.outer_step if pending else 0)
            await close_quietly(stream)
            return
        assert pending is not None
        pending.claimed_by = partner
        pending.partner_outer_step = request.outer_step
        began = trio.current_time()
        try:
            with trio.CancelScope() as scope:
                pending.transfer_scope = scope
                result = await avg.respond(
                    stream,
                    request,
                    pending.tensors,
                    outer_step=pending.request.outer_step,
                    listener=self.listener if (self.reachable is None or self.reachable()) else None,
                    local_peer_id=self.host.get_id().to_bytes(),
                    remote_peer_id=stream.muxed_conn.peer_id.to_bytes(),
                    handshake_timeout=self.cfg.handshake_timeout_s,
                    transfer_deadline=self._transfer_deadline(partner, request.numel),
                    validate=self._validate,
                    allow_punch=self._may_punch(partner),
                )
            if scope.cancelled_caught:
                raise trio.TooSlowError("cancelled by shutdown")
        except Exception as e:  # ProtocolError, TooSlowError, a reset stream: all end in a solo step
            self._fail(partner, e, trio.current_time() - began)
            pending.result = 1
            pending.done.set()
            await close_quietly(stream, reset=True)
            return
        finally:
            pending.transfer_finished.set()
        self._succeed(partner, result)
        pending.result = 2
        pending.done.set()
        await close_quietly(stream)

    def _judge(self, req: avg.AvgRequest, pending: _Pending | None, partner: str) -> tuple[str, str] | None:
        """None to accept, else (verdict, reason)."""
        if (
            self.path_of is not None
            and not self.cfg.allow_relay_bulk
            and self.path_of(partner) not in ("direct", "hole-punched")
        ):
            return ("refuse", "no direct path between us: bulk tensors do not go through relays")
        if self._link(partner).banned_until > trio.current_time():
            return ("refuse", "banned for repeated invalid updates")
        ours = self.manifest_hash() or "none"
        if req.manifest_hash != ours:
            log.error("refusing %s: run manifest %s differs from ours %s", partner, req.manifest_hash[:12], ours[:12])
            return ("refuse", f"manifest mismatch: yours {req.manifest_hash}, ours {ours}")
        if pending is None:
            return ("busy", "not ready (training between outer steps)")
        if req.layout_hash != pending.layout_hash or req.numel != pending.tensors.phi.numel():
            return ("refuse", f"parameter layout mismatch: yours {req.layout_hash[:12]}, ours {pending.layout_hash[:12]}")
        gap = abs(req.outer_step - pending.request.outer_step)
        if gap > self.cfg.max_step_gap:
            return ("refuse", f"outer steps too far apart: yours {req.outer_step}, ours {pending.request.outer_step}")
        if req.wire_dtype not in ("fp32", "bf16", "int8"):
            return ("refuse", f"unknown wire dtype {req.wire_dtype!r}")
        if pending.claimed_by is not None:
            return ("busy", "already exchanging")
        if pending.initiating_to is not None:
            if pending.initiating_to == partner and partner < self.me:
                return None  # crossing requests: the smaller PeerID's request wins
            return ("busy", "crossing request" if pending.initiating_to == partner else "asking someone else")
        return None

    # --- bookkeeping -------------------------------------------------------------------------------------

    def _succeed(self, partner: str, result: avg.TransferResult) -> None:
        link = self._link(partner)
        measured = (result.bytes_sent + result.bytes_received) / 2 / max(result.duration_s, 1e-3)
        link.rate_bps = measured if link.rounds == 0 else (1 - RATE_EWMA) * link.rate_bps + RATE_EWMA * measured
        link.rounds += 1
        link.failures = 0
        link.next_try = 0.0
        link.bytes_sent += result.bytes_sent
        link.bytes_received += result.bytes_received
        link.last_path = result.path
        self._partners.add(partner)
        self._norms.extend(result.delta_norms)
        total = result.bytes_sent + result.bytes_received
        self.stats.update(
            rounds=self.stats["rounds"] + 1,
            last_partner=partner,
            last_duration_s=round(result.duration_s, 3),
            last_bytes=total,
            last_path=result.path,
            bytes_sent=self.stats["bytes_sent"] + result.bytes_sent,
            bytes_received=self.stats["bytes_received"] + result.bytes_received,
        )
        if self.metrics is not None:
            self.metrics.observe_round(result.duration_s, total, partner, True)
        if self.on_transfer is not None:
            self.on_transfer(partner, total, result.duration_s)
        log.info("averaged with %s over the %s in %.2fs (%.1f MB)", partner, result.path, result.duration_s, total / 1e6)

    def _offence(self, partner: str, reason: str) -> None:
        """A poisoned or malformed update: counted per reason; repeated offences ban the partner."""
        self.rejections[reason] = self.rejections.get(reason, 0) + 1
        link = self._link(partner)
        link.offences += 1
        if link.offences >= self.cfg.ban_after:
            link.banned_until = trio.current_time() + self.cfg.ban_s
            link.offences = 0
            log.warning("banning %s for %.0fs after %d invalid updates", partner, self.cfg.ban_s, self.cfg.ban_after)

    def _fail(self, partner: str, error: BaseException, duration: float, *, count: bool = True) -> None:
        text = f"{type(error).__name__}: {error}"[:300]
        if isinstance(error, Rejected):
            self._offence(partner, error.reason)
        elif isinstance(error, ProtocolError) and count and error.reason.value in _MALFORMED:
            self._offence(partner, f"protocol_{error.reason.value}")
        self.stats["last_error"] = f"{partner}: {text}"
        if count:
            self.stats["failures"] += 1
            self._back_off(partner)
            if self.metrics is not None:
                self.metrics.observe_round(duration, 0, partner, False)
        log.warning("exchange with %s failed: %s", partner, text)

    def _back_off(self, partner: str, *, soft: bool = False) -> None:
        link = self._link(partner)
        if soft:
            link.next_try = trio.current_time() + random.uniform(0.5, 1.5)
            return
        link.failures += 1
        delay = min(BACKOFF_MAX_S, self.cfg.backoff_s * 2 ** (link.failures - 1))
        link.next_try = trio.current_time() + delay * random.uniform(0.8, 1.2)
