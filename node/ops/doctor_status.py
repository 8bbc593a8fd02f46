"""`starling doctor`'s status checks: own reachability, clock skew against peers, versions, the run
manifest, training (failing checkpoints included) and the pairing graph (islands, solo steps).

They are pure functions of the running daemon's `status` (the dict `starling status --json` prints, node/
status_schema.py), so that each verdict can be tested on a synthetic status; keys may be absent and a check
never raises on them. Without a daemon node/ops/doctor.py reports them as skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from node.ops.doctor_findings import (
    ERROR,
    MAX_LISTED,
    OK,
    SKIP,
    WARN,
    Finding,
    as_number,
    host_port,
    list_some,
    short,
)
from node.ops.islands import PairingGraph, pairing_graph
from node.status_schema import MemberStatus, NodeStatus

SKEW_WARN_S = 2.0
SKEW_ERROR_S = 60.0
HLC_MAX_DRIFT_S = 600.0  # protocols/hlc.py rejects records stamped further ahead than this
DELIVERY_ALLOWANCE_S = 1.0  # gossip delay assumed when a heartbeat's receipt time is known
MANY_RESTARTS = 3
SOLO_SHARE_WARN = 0.5  # own recent outer steps without a partner, above which mixing is too weak
SOLO_MIN_STEPS = 10  # recent outer steps needed before the solo share means anything

NTP_FIX = (
    "keep every node's clock synchronised with NTP (`timedatectl set-ntp true`; check with "
    "`timedatectl` or `chronyc tracking`), on this machine and on the peers named"
)


def _members(status: NodeStatus) -> list[MemberStatus]:
    return [m for m in status.get("members") or [] if isinstance(m, dict)]


def _peers(status: NodeStatus, states: tuple[str, ...] = ("alive", "suspect")) -> list[MemberStatus]:
    """Other members in one of `states`."""
    return [m for m in _members(status) if not m.get("self") and m.get("state") in states]


def check_reachability(status: NodeStatus) -> list[Finding]:
    """Whether peers can dial this node, as the daemon's NAT detection found."""
    reach = status.get("reachability")
    paths = [p.get("path") for p in status.get("peers") or [] if isinstance(p, dict)]
    relayed = sum(1 for p in paths if isinstance(p, str) and "relay" in p)
    via = f" ({relayed} of {len(paths)} connections go through a relay)" if relayed else ""
    if reach is None:
        return [Finding("reachability", SKIP, "skipped: this daemon does not report its reachability")]
    if reach == "public":
        return [Finding("reachability", OK, f"public: peers can dial this node directly{via}")]
    if reach == "unknown":
        return [
            Finding("reachability", OK, "not yet determined (the node needs connected peers to dial it back)")
        ]
    port = next((hp[2] for a in status.get("addrs") or [] if (hp := host_port(str(a)))), None)
    port_text = str(port) if port else "<port>"
    return [
        Finding(
            "reachability",
            WARN,
            f"{reach}: peers outside this network cannot dial this node; it is reached only through its own "
            f"outbound connections and relays, which makes averaging slower{via}",
            f"to accept direct connections, forward TCP port {port_text} on the router/firewall to this machine and "
            f'set node.announce = ["/ip4/<public IP>/tcp/{port_text}"] (or --announce). Otherwise nothing is '
            "required: relays carry the traffic",
        )
    ]


def _skew_estimate(member: MemberStatus, heartbeat_s: float, *, rarely_signed: bool = False) -> tuple[float, str] | None:
    """(estimated seconds the member's clock is ahead of ours, negative = behind; how it was estimated).

    Best case the status gives the author's heartbeat time and our receipt time: skew ~ heartbeat -
    received_at (ahead is a lower bound, since delivery takes time; behind allows a heartbeat interval plus
    DELIVERY_ALLOWANCE_S).
    Otherwise it gives `last_seen_s`, the age of min(heartbeat, receipt): an alive member heartbeats
    every `heartbeat_s`, so an age beyond two intervals (one may be lost) means its heartbeat times
    lag our clock, i.e. its clock is at least that much behind. A clock that runs ahead is invisible in
    that view (the receipt time caps last_seen) until records are rejected as too far ahead.

    ``rarely_signed`` (node.membership = swim: a record is re-signed only when it changes, and the status's
    last_seen is SWIM's evidence, not the record's age): a record may reach us any time after it was signed
    (a node that joined later gets it by anti-entropy, minutes on), so its lag says nothing of the author's
    clock; only a record dated ahead of its arrival does.
    """
    hb, received = as_number(member.get("heartbeat")), as_number(member.get("received_at"))
    if rarely_signed:
        if hb is None or received is None:
            return None
        return max(0.0, hb - received), "record time vs receipt time"
    if hb is not None and received is not None:
        raw = hb - received
        # A record may reach us up to a heartbeat late by anti-entropy (from a third node) and a moment
        # later still on a busy machine: only a lag beyond that is blamed on the member's clock.
        allowance = DELIVERY_ALLOWANCE_S + heartbeat_s
        return (raw if raw >= 0 else min(0.0, raw + allowance)), "heartbeat vs receipt time"
    age = as_number(member.get("last_seen_s"))
    if age is None:
        return None
    return -max(0.0, age - 2 * heartbeat_s), f"its latest heartbeat looks {age:.1f} s old"


def check_clock_skew(status: NodeStatus, *, heartbeat_s: float = 2.0) -> list[Finding]:
    """Peers whose clock differs from ours: > SKEW_WARN_S warns, > SKEW_ERROR_S is an error.

    Skew matters because liveness and the CRDT's hybrid logical clock use wall time: a peer far behind
    looks dead, one more than HLC_MAX_DRIFT_S ahead has its records rejected. Candidates are alive
    members and members connected right now although they look silent (a clock far behind makes a
    live peer look suspect or gone).
    """
    findings = []
    rejected = (status.get("swarm_totals") or {}).get("rejected") or {}
    n_rejected = rejected.get("clock_skew", 0) if isinstance(rejected, dict) else 0
    if n_rejected:
        findings.append(
            Finding(
                "clock",
                ERROR,
                f"{n_rejected} records were rejected because their timestamps were more than {HLC_MAX_DRIFT_S:.0f} s "
                "ahead of this node's clock (a peer's clock runs ahead, or this one is behind)",
                NTP_FIX,
            )
        )
    connected = set(status.get("connected_peers") or [])
    candidates = [
        m
        for m in _members(status)
        if not m.get("self")
        and (
            m.get("state") == "alive"
            or (m.get("state") in ("suspect", "gone") and m.get("peer_id") in connected)
        )
    ]
    # SWIM mode (the status has a `swim` section): records are re-signed only when they change.
    rarely_signed = isinstance(status.get("swim"), Mapping)
    exact = False
    skewed: list[tuple[float, MemberStatus, str]] = []
    for m in candidates:
        estimate = _skew_estimate(m, heartbeat_s, rarely_signed=rarely_signed)
        if estimate is None:
            continue
        skew, how = estimate
        exact = exact or how.startswith("heartbeat vs")
        if abs(skew) > SKEW_WARN_S:
            skewed.append((skew, m, how))
    # One line per skewed peer, the worst first; past MAX_LISTED the rest share one line, or a clock off on
    # this machine (every peer looks skewed) would print hundreds of lines at hundreds of members.
    skewed.sort(key=lambda item: -abs(item[0]))
    for skew, m, how in skewed[:MAX_LISTED]:
        side = "ahead of" if skew > 0 else "behind"
        findings.append(
            Finding(
                "clock",
                ERROR if abs(skew) > SKEW_ERROR_S else WARN,
                f"{short(str(m.get('peer_id', '?')))}: its clock is about {abs(skew):.1f} s {side} ours ({how}"
                f"{'' if m.get('state') == 'alive' else ', so it looks ' + str(m.get('state'))})",
                NTP_FIX + " (or its heartbeats are delayed: check its log and network)",
            )
        )
    rest = skewed[MAX_LISTED:]
    if rest:
        low, high = abs(rest[-1][0]), abs(rest[0][0])
        ours = " (most of the swarm: is this machine's clock the one that is off?)" if len(skewed) > len(
            candidates) // 2 else ""
        findings.append(
            Finding(
                "clock",
                ERROR if high > SKEW_ERROR_S else WARN,
                f"{len(rest)} more peers' clocks differ from ours by {low:.1f} to {high:.1f} s, "
                f"{len(skewed)} of {len(candidates)} live peers in all{ours}: "
                f"{list_some([short(str(m.get('peer_id', '?'))) for _, m, _ in rest])}",
                NTP_FIX,
            )
        )
    if not findings:
        note = (
            "; swim mode: records are re-signed only when they change, so only a clock running ahead shows"
            if rarely_signed and candidates
            else "" if exact or not candidates else "; a clock running ahead shows only once records are rejected"
        )
        seen = (
            f"among {len(candidates)} live peers{note}" if candidates else "(no live peers to compare with)"
        )
        findings.append(Finding("clock", OK, f"no skew above {SKEW_WARN_S:g} s seen {seen}"))
    return findings


def check_versions(status: NodeStatus, *, installed: str | None = None) -> list[Finding]:
    """This daemon's version against the installed one and against the peers'."""
    ours = status.get("version")
    findings = []
    if installed and ours and installed != ours:
        findings.append(
            Finding(
                "versions",
                WARN,
                f"the daemon runs {ours} but {installed} is installed",
                "restart the daemon to run the installed version",
            )
        )
    others = [
        f"{short(str(m.get('peer_id', '?')))} runs {m.get('version')}"
        for m in _peers(status)
        if m.get("version") and m.get("version") != ours
    ]
    if others:
        findings.append(
            Finding(
                "versions",
                WARN,
                f"{len(others)} peers run another version than ours ({ours}): {list_some(others)}",
                "run the same Starling version on every node (upgrade the older ones)",
            )
        )
    if not findings:
        n = len(_peers(status))
        findings.append(
            Finding("versions", OK, f"{ours}, same as all {n} live peers" if n else f"{ours} (no live peers)")
        )
    return findings


def check_manifest(status: NodeStatus) -> list[Finding]:
    """This node trains the swarm's run (task, model, optimizer, protocol); peers that do not are named."""
    totals = status.get("swarm_totals") or {}
    me: MemberStatus | dict[str, Any] = next((m for m in _members(status) if m.get("self")), {})
    ours = str(me.get("manifest_hash") or "")
    findings = []
    if totals.get("manifest_error"):
        findings.append(
            Finding(
                "manifest",
                ERROR,
                str(totals["manifest_error"]),
                "start this node with the swarm's train.* options (task, model, optimizer: compare "
                "`starling status --json` swarm_totals.manifest_hash on a working member), or give it its own "
                "node.swarm name",
            )
        )
    incompatible = set(totals.get("incompatible_peers") or [])
    odd = [m for m in _peers(status) if ours and m.get("manifest_hash") and m.get("manifest_hash") != ours]
    named = {str(m.get("peer_id")): str(m.get("manifest_hash") or "?") for m in odd}
    for m in _members(status):
        if m.get("peer_id") in incompatible:
            named.setdefault(str(m.get("peer_id")), str(m.get("manifest_hash") or "?"))
    for peer in incompatible - set(named):
        named[str(peer)] = "?"
    # What differs, as the state protocol's refusal said (a newer daemon reports it): the swarm or the manifest.
    differs: dict[str, Mapping[str, Any]] = {
        str(d.get("peer_id")): d for d in totals.get("incompatible") or [] if isinstance(d, dict)
    }

    def what(peer: str, manifest: str) -> str:
        said = differs.get(peer) or {}
        if said.get("field") == "swarm":
            return f"{short(peer)} (swarm {said.get('theirs')!r})"
        return f"{short(peer)} (manifest {str(said.get('theirs') or manifest)[:12]})"

    if named:
        listed = [what(p, h) for p, h in sorted(named.items())]
        findings.append(
            Finding(
                "manifest",
                WARN,
                f"{len(named)} peers are incompatible with this node (manifest {ours[:12] or 'none'}), "
                f"so they are never averaged with: {list_some(listed)}",
                "those nodes must run the same task, model and optimizer config as this swarm, or use their own "
                "node.swarm name",
            )
        )
    if not findings:
        swarm = totals.get("manifest_hash")
        if ours:
            findings.append(
                Finding(
                    "manifest",
                    OK,
                    f"this node's manifest {ours[:12]} matches the swarm's"
                    if not swarm or swarm == ours
                    else f"this node's manifest is {ours[:12]}",
                )
            )
        else:
            findings.append(
                Finding(
                    "manifest",
                    OK,
                    "no run manifest (network-only node, or the trainer is starting)"
                    + (f"; the swarm's is {str(swarm)[:12]}" if swarm else ""),
                )
            )
    return findings


def check_training(status: NodeStatus) -> list[Finding]:
    """The trainer runs; a failed or flapping worker is reported with its last error."""
    tr = status.get("training")
    if not isinstance(tr, dict) or not tr:
        why = "a network-only node" if status.get("role") == "network-only" else "no trainer reported"
        return [Finding("training", SKIP, f"skipped: {why}")]
    state, error = tr.get("state", "?"), tr.get("error")
    restarts = int(as_number(tr.get("restarts")) or 0)
    log_fix = "read the daemon's log (`journalctl -u starling`) for the worker's traceback"
    disk: list[Finding] = []
    if tr.get("checkpoint_error"):
        disk.append(Finding(
            "training",
            ERROR,
            f"checkpoints fail ({tr.get('checkpoint_failures') or 1} in a row), latest {tr['checkpoint_error']}; "
            f"training goes on, but a restart resumes from step {tr.get('checkpoint_step') or 'of the last one written'}",
            "free space on the file system of HOME (`df -h HOME`; old exports, logs), or move HOME to a larger one",
        ))
    if state == "failed":
        return [
            Finding(
                "training",
                ERROR,
                f"training stopped: {error}",
                f"fix the cause above ({log_fix}), then restart the daemon",
            )
        ]
    if disk:
        return disk
    if restarts >= MANY_RESTARTS:
        return [
            Finding(
                "training",
                WARN,
                f"the training worker restarted {restarts} times; last exit: {error}",
                f"{log_fix}; common causes are running out of memory (smaller train.batch_size) or "
                "a wrong train.device",
            )
        ]
    if state == "restarting":
        return [Finding("training", WARN, f"the training worker is restarting after: {error}", log_fix)]
    loss = as_number(tr.get("loss"))
    progress = f"step {tr.get('step', '?')}, outer step {tr.get('outer_step', '?')}" + (
        f", loss {loss:.4f}" if loss is not None else ""
    )
    again = f"; restarted {restarts} times, last: {error}" if restarts else ""
    return [Finding("training", OK, f"{state}: {progress}{again}")]


def _island_text(island: list[str], steps: Mapping[str, Any]) -> str:
    """One island as `{a, b, c} (outer steps 40-44)`: the step range hints at speed classes drifting apart."""
    numbers = [int(n) for p in island if (n := as_number(steps.get(p))) is not None]
    span = ""
    if numbers:
        low, high = min(numbers), max(numbers)
        span = f" (outer step {low})" if low == high else f" (outer steps {low}-{high})"
    return "{" + list_some([short(p) for p in island]) + "}" + span


ISLANDS_FIX = (
    "trainers of different speeds in different outer-step ranges? check that every node runs the same "
    "Starling version with sync.pace = swarm, and that sync.max_step_gap covers the spread of outer steps; "
    "check that the islands can reach each other directly (`starling status`: the path column of peers, "
    "and `nat:`; pairs reachable only through a relay never average unless sync.allow_relay_bulk)"
)


def check_pairing(status: NodeStatus) -> list[Finding]:
    """The alive trainers average across one connected group, and this node does not mostly step solo.

    Islands are groups of trainers that only pair among themselves: each trains its own model, which no
    single node's loss shows (see node/ops/islands.py). Unpaired trainers (no partner yet, as in a fresh
    swarm) are named but not blamed.
    """
    members = _members(status)
    if not members:
        return [Finding("pairing", SKIP, "skipped: this daemon reports no swarm members")]
    graph = pairing_graph(members)
    findings = _island_findings(graph, {str(m.get("peer_id")): m.get("outer_step") for m in members})
    findings += _solo_findings(status, graph.paired + len(graph.unpaired))
    if not findings:
        findings.append(Finding("pairing", OK, _pairing_ok_text(graph)))
    return findings


def _island_findings(graph: PairingGraph, steps: Mapping[str, Any]) -> list[Finding]:
    """A warning naming every island when the paired trainers form more than one group."""
    if not graph.split:
        return []
    listed = " and ".join(_island_text(island, steps) for island in graph.islands[:MAX_LISTED])
    if len(graph.islands) > MAX_LISTED:  # a swarm of hundreds shattered into pairs: one line, not a page
        listed += f" and {len(graph.islands) - MAX_LISTED} more islands"
    return [
        Finding(
            "pairing",
            WARN,
            f"the swarm's pairing graph has split into {len(graph.islands)} islands of trainers that never "
            f"averaged with each other over their recent outer steps: {listed}; each island trains its own model",
            ISLANDS_FIX,
        )
    ]


def _solo_findings(status: NodeStatus, trainers: int) -> list[Finding]:
    """A warning when this node took most of its recent outer steps solo although others could pair."""
    sync = status.get("sync")
    mixing = sync.get("mixing") if isinstance(sync, dict) else None
    if not isinstance(mixing, dict):
        return []
    share, steps = as_number(mixing.get("solo_share")), as_number(mixing.get("outer_steps"))
    me: MemberStatus | dict[str, Any] = next((m for m in _members(status) if m.get("self")), {})
    others = trainers - (1 if me.get("state") == "alive" and me.get("role") == "trainer" else 0)
    if share is None or steps is None or steps < SOLO_MIN_STEPS or share <= SOLO_SHARE_WARN or others < 1:
        return []
    return [
        Finding(
            "pairing",
            WARN,
            f"this node stepped solo in {share:.0%} of its last {steps:.0f} outer steps although {others} other "
            f"trainer{' is' if others == 1 else 's are'} alive: it barely mixes with the swarm",
            "find why partners are not eligible: outer steps more than sync.max_step_gap apart (`starling status`: "
            "the members' outer column), no direct path (`starling status`: path, `nat:`), another version or "
            "manifest (see the checks above), or bans (`starling status --json`: sync.banned)",
        )
    ]


def _pairing_ok_text(graph: PairingGraph) -> str:
    """The healthy verdict, with the unpaired trainers counted (a fresh swarm has only those)."""
    unpaired = f"; {len(graph.unpaired)} with no recent partner: {list_some([short(p) for p in graph.unpaired])}"
    if not graph.islands:
        alive = len(graph.unpaired)
        if not alive:
            return "pairing graph: no alive trainers"
        if alive == 1:
            return "pairing graph: one alive trainer, nobody to pair with"  # as `starling status` says
        return f"pairing graph: no pairs in the recent outer steps of the {alive} alive trainer{'s' * (alive != 1)}"
    return f"pairing graph: one island of {graph.paired} trainers" + (unpaired if graph.unpaired else "")
