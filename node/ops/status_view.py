"""The readable `starling status` view, rendered from the same dict that `--json` prints.

Rendering from the JSON keeps the two views honest with each other: there is one source of truth, the
daemon's status(), and this module only formats it. Every section is optional, so an older daemon or a
network-only node renders fine.

A swarm of hundreds would print a wall of rows, one per member and connection: past a limit (DEFAULT_ROWS,
`starling status --members N`) a list is summarised and cut to the rows an operator acts on (this node, its
partners, suspect members, the trainers furthest from the swarm), and the rest are counted. The JSON is never
cut.
"""

from __future__ import annotations

from typing import Any

from node.ops.islands import pairing_graph
from node.ops.refusals import refused_line
from node.status_schema import (
    MemberStatus,
    MixingStatus,
    NodeStatus,
    PeerPathStatus,
    SyncStatus,
    TrainingStatus,
)

MAX_PARTNERS_SHOWN = 4  # partners named on the mixing line; the rest are counted
DEFAULT_ROWS = 20  # rows of one per-member list (members, connections, incompatible peers) before it is cut
MAX_ISLANDS_NAMED = 4  # islands spelled out on the pairing-graph line; the rest are counted
RECENT_REFUSAL_S = 120.0  # a refused averaging request is shown this long after it


def short(peer_id: str) -> str:
    return peer_id[:6] + ".." + peer_id[-6:] if len(peer_id) > 14 else peer_id


def _dur(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _bootstrap_lines(st: NodeStatus) -> list[str]:
    """One line per bootstrap peer this node cannot reach, with the cause of its last failed dial."""
    boot = st.get("bootstrap")
    peers = boot.get("peers") if isinstance(boot, dict) else None
    if not isinstance(peers, list):
        return []  # an older daemon
    lines = []
    for p in peers:
        if not isinstance(p, dict) or p.get("connected") or not p.get("last_error"):
            continue
        addrs = ", ".join(str(a) for a in p.get("addrs") or []) or "?"
        failures = p.get("failures") or 0
        lines.append(f"bootstrap {short(str(p.get('peer_id', '?')))} at {addrs}: not connected "
                     f"({failures} failed dial{'s' * (failures != 1)}): {p['last_error']}")
    return lines


def render_status(st: NodeStatus, rows: int | None = DEFAULT_ROWS) -> str:
    """The readable view. `rows`: the most rows one per-member list shows (None: all of them).

    A list within `rows` renders in full, as it always has; a longer one (a swarm of hundreds) gets a
    summary line of counts, then the rows that matter most, then how many were left out (`--json` and
    `starling status --all` keep every one).
    """
    out: list[str] = []
    out.append(f"starling {st.get('version', '?')}  peer {st.get('peer_id', '?')}")
    out.append(
        f"swarm {st.get('swarm', '?')!r}  role {st.get('role', '?')}  up {_dur(st.get('uptime_s', 0))}"
        + (f"  reachability {st['reachability']}" if "reachability" in st else "")
    )
    for a in st.get("addrs", []):
        out.append(f"  listening {a}")
    conns = st.get("connections", {})
    peers = st.get("connected_peers", [])
    out.append(
        f"connections: {len(peers)} connected (target {conns.get('target', '?')}, cap {conns.get('cap', '?')}),"
        f" {conns.get('candidates', 0)} known, {conns.get('dialing', 0)} dialing,"
        f" {conns.get('backing_off', 0)} backing off"
    )
    detail = {p.get("peer_id"): p for p in st.get("peers", []) if isinstance(p, dict)}
    if peers:
        shown = peers
        if rows is not None and len(peers) > rows:
            out.append(_paths_summary(peers, detail))
            shown = _connections_shown(peers, detail, _partners_of_this_node(st), rows)
        table = [["peer", "path", "rtt_ms"]]
        for p in shown:
            d: PeerPathStatus | dict[str, Any] = detail.get(p) or {}
            table.append([short(p), str(d.get("path", "-")), _fmt(d.get("rtt_ms"), ".1f")])
        out.extend(_table(table))
        if len(shown) < len(peers):
            out.append(_more_line(len(peers) - len(shown)))
    out.extend(_bootstrap_lines(st))
    nat = st.get("nat") or {}
    if nat.get("reason"):
        out.append(f"nat: {nat['reason']}")
    disc = st.get("discovery")
    if disc:
        out.append(
            f"discovery: {disc.get('members_found', 0)} members found in the DHT,"
            f" routing table {disc.get('routing_table', 0)}, {disc.get('lookups', 0)} lookups"
            + (f" ({disc['lookups_skipped']} not needed: connections or members' records enough)"
               if disc.get("lookups_skipped") else "")
            + (f"  (last error: {disc['last_error']})" if disc.get("last_error") else "")
        )
    refusals = st.get("refusals")
    if isinstance(refusals, dict):  # an older daemon has none
        out.append(refused_line(refusals))
    tr = st.get("training")
    if tr:
        out.append(
            f"training: {tr.get('task', '?')} on {tr.get('device', '?')}  state {tr.get('state', '?')}"
            f"  step {_fmt(tr.get('step'))}  outer {_fmt(tr.get('outer_step'))}"
            f"  loss {_fmt(tr.get('loss'), '.4f')}  val {_fmt(tr.get('val_loss'), '.4f')}"
            f"  {_fmt(tr.get('samples_per_s'), '.1f')} samples/s"
            + (f"  restarts {tr['restarts']}" if tr.get("restarts") else "")
        )
        if tr.get("error"):
            out.append(_training_error_line(tr))
        if tr.get("checkpoint_error"):
            n = tr.get("checkpoint_failures") or 1
            kept = tr.get("checkpoint_step")
            out.append(f"checkpoints failing: {n} in a row, latest {tr['checkpoint_error']}; the last one written is "
                       f"{'at step ' + str(kept) if kept is not None else 'from before this start'}: free space "
                       "on the file system of HOME")
    sy = st.get("sync")
    if sy:
        out.append(
            f"sync: {sy.get('rounds', 0)} rounds ({sy.get('solo_rounds', 0)} solo, {sy.get('failures', 0)} failed),"
            f" {sy.get('distinct_partners', 0)} partners since start, last {short(str(sy.get('last_partner') or '-'))}"
            f" in {_fmt(sy.get('last_duration_s'), '.2f')}s, wire {sy.get('wire_dtype', '?')}"
            + _compression_part(sy)
            + (f", {sy['last_bytes_per_param']:.3g} B/param" if isinstance(sy.get("last_bytes_per_param"), float)
               else "")
        )
        transfer = sy.get("transfer")
        if isinstance(transfer, dict):
            out.append(
                f"  exchanging with {short(str(transfer.get('partner', '?')))}: "
                f"{_fmt((transfer.get('bytes') or 0) / 1e6, '.1f')} MB in {_fmt(transfer.get('seconds'), '.0f')}s"
                + (f" at {transfer['rate_mbps']:g} Mbit/s each way" if transfer.get("rate_mbps") is not None else "")
            )
        asked = _asked_line(sy.get("last_asked"))
        if asked:
            out.append(asked)
        mixing = sy.get("mixing")
        if isinstance(mixing, dict):
            out.append(_mixing_line(mixing))
        bounds = _bounds_line(sy)
        if bounds:
            out.append(bounds)
        sitting_out = _sitting_out_line(sy)
        if sitting_out:
            out.append(sitting_out)
        refusal = _refusal_line(sy)
        if refusal:
            out.append(refusal)
        reach = _out_of_reach_line(sy)
        if reach:
            out.append(reach)
    if tr and (tr.get("period_s") is not None or tr.get("last_inner_steps") is not None):
        out.append(_pace_line(tr))
    donor = _donor_line(st.get("join"))
    if donor:
        out.append(donor)
    incompatible = _incompatible_lines(st)
    if rows is not None and len(incompatible) > rows:
        incompatible = [*incompatible[:rows], _more_line(len(incompatible) - rows, "incompatible peers")]
    out.extend(incompatible)
    members = st.get("members")
    if members:
        reasons: dict[int, str] = {}
        shown_members = members
        if rows is not None and len(members) > rows:
            out.extend(_members_summary(members))
            reasons = _members_shown(st, members, rows)
            shown_members = [members[i] for i in reasons]
        # `step` is the member's inner step (the lr schedule and the loss curve follow it), `outer` its outer
        # step (partners are chosen by it); they differ by a factor of about train.inner_steps.
        table = [["member", "state", "step", "outer", "loss", "samples/s", "partners", "last seen"]
                 + (["shown as"] if reasons else [])]
        for i, m in zip(reasons or range(len(members)), shown_members, strict=True):
            # A member that does not train (a network-only bootstrap node, a relay) has no steps, loss or speed:
            # blank, not "0 0 - 0.0", which reads as a trainer that is stuck.
            trains = m.get("role") == "trainer"
            table.append([
                short(str(m.get("peer_id", "?"))),
                # Its records stopped once it was refused: "suspect 31s ago" would hide why.
                "incompatible" if m.get("incompatible") else str(m.get("state", "?")),
                _fmt(m.get("step")) if trains else "",
                _fmt(m.get("outer_step")) if trains else "",
                _fmt(m.get("loss"), ".4f") if trains else "",
                _fmt(m.get("samples_per_s"), ".1f") if trains else "",
                _partner_count(m),
                (_dur(m["last_seen_s"]) + " ago") if isinstance(m.get("last_seen_s"), (int, float)) else "-",
            ] + ([reasons[i]] if reasons else []))
        if not reasons:
            out.append(f"members: {len(members)}")
        out.extend(_table(table))
        if reasons:
            out.append(_more_line(len(members) - len(reasons)))
        out.append(_pairing_line(members, cut=bool(reasons)))
    return "\n".join(out)


def _more_line(left_out: int, what: str = "") -> str:
    return f"  ... and {left_out} more{' ' + what if what else ''} (starling status --all, or --json)"


def _partners_of_this_node(st: NodeStatus) -> list[str]:
    """This node's partners, most relevant first: the one it exchanges with now, the latest, those of its
    recent outer steps (most frequent first), and those its own member record names."""
    found: list[str] = []
    sy = st.get("sync")
    if isinstance(sy, dict):
        transfer = sy.get("transfer")
        if isinstance(transfer, dict):
            found.append(str(transfer.get("partner")))
        if sy.get("last_partner"):
            found.append(str(sy.get("last_partner")))
        mixing = sy.get("mixing")
        partners = mixing.get("partners") if isinstance(mixing, dict) else None
        if isinstance(partners, dict):
            found += [str(p) for p, _ in sorted(partners.items(), key=lambda kv: (-_count(kv[1]), str(kv[0])))]
    for m in st.get("members") or []:
        if isinstance(m, dict) and m.get("self") and isinstance(m.get("partners"), list):
            found += [str(p) for p in m["partners"]]
    return list(dict.fromkeys(found))  # first mention wins, order kept


def _paths_summary(peers: list[str], detail: dict[Any, Any]) -> str:
    by_path: dict[str, int] = {}
    for p in peers:
        path = str((detail.get(p) or {}).get("path", "unknown"))
        by_path[path] = by_path.get(path, 0) + 1
    return "  paths: " + ", ".join(f"{n} {path}" for path, n in sorted(by_path.items(), key=lambda kv: (-kv[1], kv[0])))


def _connections_shown(peers: list[str], detail: dict[Any, Any], partners: list[str], rows: int) -> list[str]:
    """The connections worth a row when they are too many: partners, then relayed ones (slow, and the
    usual reason pairs do not average), then the rest as the daemon listed them."""
    connected = set(peers)
    relayed = [p for p in peers if "relay" in str((detail.get(p) or {}).get("path", ""))]
    ordered = dict.fromkeys([*(p for p in partners if p in connected), *relayed, *peers])
    return list(ordered)[:rows]


def _members_summary(members: list[MemberStatus]) -> list[str]:
    """Counts by state and role, and the alive trainers' spread of outer steps and speed."""
    states: dict[str, int] = {}
    roles: dict[str, int] = {}
    outer: list[int] = []
    speed: list[float] = []
    for m in members:
        state = "incompatible" if m.get("incompatible") else str(m.get("state", "?"))
        states[state] = states.get(state, 0) + 1
        role = str(m.get("role", "?"))
        roles[role] = roles.get(role, 0) + 1
        if m.get("state") == "alive" and m.get("role") == "trainer":
            if isinstance(step := m.get("outer_step"), int) and not isinstance(step, bool):
                outer.append(step)
            if isinstance(rate := m.get("samples_per_s"), (int, float)) and not isinstance(rate, bool):
                speed.append(float(rate))
    order = ["alive", "suspect", "gone", "left", "incompatible"]
    by_state = [f"{states.pop(s)} {s}" for s in order if s in states] + [f"{n} {s}" for s, n in sorted(states.items())]
    by_role = [f"{roles.pop('trainer', 0)} trainers", f"{roles.pop('network-only', 0)} network-only"]
    by_role += [f"{n} {r}" for r, n in sorted(roles.items())]
    lines = [f"members: {len(members)} ({', '.join(by_state)}; {', '.join(by_role)})"]
    if outer:
        outer.sort()
        speed.sort()
        spread = f"  alive trainers: outer steps {outer[0]}..{outer[-1]} (median {outer[len(outer) // 2]})"
        if speed:
            spread += (f", samples/s {speed[0]:.1f}..{speed[-1]:.1f} (median {speed[len(speed) // 2]:.1f})")
        lines.append(spread)
    return lines


def _members_shown(st: NodeStatus, members: list[MemberStatus], rows: int) -> dict[int, str]:
    """{index in `members`: why it is shown}, in the order shown, at most `rows`: this node, its partners,
    suspect (and incompatible) members, the alive trainers furthest behind and ahead, then the most
    recently heard. Each kind first gets a share of the rows, so a flood of one kind (200 suspects after a
    partition) cannot push the others out; rows left over go to the same kinds in the same order."""
    index = {str(m.get("peer_id")): i for i, m in enumerate(members)}
    partners = [index[p] for p in _partners_of_this_node(st) if p in index]
    trouble = [i for i, m in enumerate(members)
               if not m.get("self") and (m.get("incompatible") or m.get("state") == "suspect")]
    trainers = sorted((i for i, m in enumerate(members)
                       if m.get("state") == "alive" and m.get("role") == "trainer" and not m.get("self")
                       and isinstance(m.get("outer_step"), int)), key=lambda i: members[i]["outer_step"])
    extremes = max(1, rows // 10)
    behind, ahead = trainers[:extremes], trainers[::-1][:extremes]

    def heard(i: int) -> float:
        age = members[i].get("last_seen_s")
        return float(age) if isinstance(age, (int, float)) else float("inf")

    recent = sorted(range(len(members)), key=heard)
    groups: list[tuple[str, list[int], int]] = [
        ("this node", [i for i, m in enumerate(members) if m.get("self")], 1),
        ("partner", partners, max(1, rows // 4)),
        ("suspect", trouble, max(1, rows // 4)),
        ("furthest behind", behind, extremes),
        ("furthest ahead", ahead, extremes),
        ("recently heard", recent, rows),
    ]
    chosen: dict[int, str] = {}
    for second_pass in (False, True):
        for reason, candidates, share in groups:
            taken = 0
            for i in candidates:
                if len(chosen) >= rows or (not second_pass and taken >= share):
                    break
                if i not in chosen:
                    label = reason
                    if reason == "suspect" and members[i].get("incompatible"):
                        label = "incompatible"
                    chosen[i] = label
                    taken += 1
    return chosen


def _incompatible_lines(st: NodeStatus) -> list[str]:
    """This node's own disagreement with the swarm's manifest, and each peer refused as incompatible with
    what differs (swarm name, or run manifest)."""
    totals = st.get("swarm_totals")
    if not isinstance(totals, dict):
        return []
    lines = []
    if totals.get("manifest_error"):
        lines.append(f"manifest: {totals['manifest_error']}")
    ours = totals.get("our_manifest")
    task = f"ours: task {ours.get('task')!r}, " if isinstance(ours, dict) else "ours: "
    for p in totals.get("incompatible") or []:
        if not isinstance(p, dict):
            continue
        runs = f" (it runs starling {p['version']})" if p.get("version") else ""
        if p.get("field") == "swarm":
            what = f"swarm {p.get('theirs')!r}, ours {p.get('ours')!r}"
        else:
            differs = p.get("differs")
            how = (f"they differ in {', '.join(str(f) for f in differs)}" if isinstance(differs, list) and differs
                   else "another task, model config, optimizer config or protocol version")
            what = (f"run manifest {str(p.get('theirs'))[:12] or 'none'}, {task}manifest "
                    f"{str(p.get('ours'))[:12] or 'none'}: {how}")
        lines.append(f"incompatible {short(str(p.get('peer_id', '?')))}{runs}: {what}; never synced or averaged with")
    return lines


def _training_error_line(tr: TrainingStatus) -> str:
    """Why training stopped, or what the worker last died of (it may be training again by now)."""
    state = tr.get("state")
    if state == "failed":
        return f"training failed: {tr['error']} (the worker is not restarted; fix it and restart the daemon)"
    return f"last worker error: {tr['error']}"


def _compression_part(sy: SyncStatus) -> str:
    """`, compression X` for a setting other than `none`; with `auto`, also the preset its latest exchange
    used (chosen per exchange from the link's measured rate, node/averaging/compression_choice.py)."""
    configured, last = sy.get("compression"), sy.get("last_compression")
    if configured == "auto":
        return ", compression auto" + (f" (last {last})" if isinstance(last, str) else "")
    return f", compression {configured}" if configured not in (None, "none") else ""


def _bounds_line(sy: SyncStatus) -> str | None:
    """What partners sent outside the bounds (node/averaging/robust.py), shown only once something was: clipped
    updates, refused ones by reason, and banned partners."""
    clipped = sy.get("clipped")
    clipped = clipped if isinstance(clipped, dict) else {}
    refused = sy.get("rejections")
    refused = refused if isinstance(refused, dict) else {}
    banned = sy.get("banned")
    banned = banned if isinstance(banned, list) else []
    if not (any(clipped.values()) or refused or banned):
        return None
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(refused.items()))
    return (f"bounds: clipped {clipped.get('delta', 0)} Delta / {clipped.get('phi', 0)} phi,"
            f" refused {sum(refused.values())}{f' ({reasons})' if reasons else ''},"
            f" banned {', '.join(short(str(p)) for p in banned) or 'none'}")


def _sitting_out_line(sy: SyncStatus) -> str | None:
    """Trainers the averager stopped waiting for after missed rounds (node/averaging/partner_misses.py), with the
    seconds left of each one's back-off; shown only while one sits out. Without it an operator sees a member
    table full of alive trainers and a node that pairs with few of them, and cannot tell why."""
    section = sy.get("sitting_out")
    if not isinstance(section, dict):
        return None
    count = _count(section.get("count"))
    if count <= 0:
        return None
    peers = section.get("peers")
    peers = peers if isinstance(peers, dict) else {}
    ranked = sorted(peers.items(), key=lambda kv: (-_seconds(kv[1]), str(kv[0])))
    named = [f"{short(str(p))} {_seconds(left):.0f}s" for p, left in ranked[:MAX_PARTNERS_SHOWN]]
    if count > len(named):
        named.append(f"{count - len(named)} more")
    return (f"sitting out: {count} partner{'s' * (count != 1)} after missed averaging rounds"
            f" (seconds left): {', '.join(named)}")


def _refusal_line(sy: SyncStatus) -> str | None:
    """The latest averaging request refused, either way, while it is recent and no exchange has completed
    since: the reason two alive trainers step solo side by side (`declined` rose and `pairing graph`
    still showed their old island)."""
    last = sy.get("last_refusal")
    if (not isinstance(last, dict) or last.get("averaged_since")
            or _seconds(last.get("seconds_ago")) > RECENT_REFUSAL_S):
        return None
    peer = short(str(last.get("peer", "?")))
    who = f"{peer} refused our request" if last.get("by") == "partner" else f"we refused {peer}'s request"
    hint = f"; {last['hint']}" if last.get("hint") else ""
    return f"not averaging: {who} {_seconds(last.get('seconds_ago')):.0f}s ago: {last.get('reason', '?')!r}{hint}"


def _out_of_reach_line(sy: SyncStatus) -> str | None:
    """Every possible partner is further than the allowed gap of outer steps away: no request is even sent,
    so no refusal says it. After a worker restarted from an older checkpoint, its node stepped solo beside
    an alive partner while `pairing graph` still showed their old island."""
    reach = sy.get("out_of_reach")
    if not isinstance(reach, dict):
        return None
    count, steps = _count(reach.get("trainers")), _count(reach.get("nearest_steps"))
    where = (f"the other trainer of this run is {steps}" if count == 1
             else f"all {count} other trainers of this run are at least {steps}")
    side = "behind" if reach.get("behind") else "ahead"
    catch_up = sy.get("catch_up")
    state = catch_up.get("state") if isinstance(catch_up, dict) else None
    if reach.get("catch_up_off"):
        what = f"this node is {side}, and sync.catch_up_after = 0: nobody catches up"
    elif reach.get("catches_up"):
        doing = f" (catch-up: {state})" if state and state != "idle" else ""
        what = f"this node is {side}: it catches up from the swarm{doing}"
    else:
        what = f"this node is {side}: the others catch up with it"
    return (f"not averaging: {where} outer steps away (sync.max_step_gap {_count(reach.get('max_step_gap'))}); "
            f"{what}")


def _seconds(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _asked_line(asked: Any) -> str:
    """Where the time of our latest asked exchange went: each phase in seconds, and in round trips where the
    connection's RTT is known (a fixed cost near 3 RTT is the exchange working as built)."""
    if not isinstance(asked, dict) or not isinstance(asked.get("phases_s"), dict):
        return ""
    rtts: dict[str, Any] = asked["phases_rtt"] if isinstance(asked.get("phases_rtt"), dict) else {}
    parts = [f"{name} {_fmt(seconds, '.2f')}s" + (f" ({rtts[name]:g} RTT)" if isinstance(rtts.get(name), (int, float))
                                                  else "")
             for name, seconds in asked["phases_s"].items()]
    rtt = asked.get("rtt_ms")
    return (f"  last asked exchange ({short(str(asked.get('partner', '?')))}"
            + (f", RTT {rtt:g} ms" if isinstance(rtt, (int, float)) else "") + "): " + ", ".join(parts))


def _mixing_line(mixing: MixingStatus) -> str:
    """How well this node mixes: the averaged share of its recent outer steps and whom with.

    The totals on the `sync:` line count since the daemon started and hide a node that paired well an
    hour ago and steps solo now; this line covers only the last few outer steps (the averager's window).
    """
    steps = mixing.get("outer_steps")
    if not isinstance(steps, int) or steps <= 0:
        return "mixing: no outer steps yet"
    partners = mixing.get("partners")
    partners = partners if isinstance(partners, dict) else {}
    ranked = sorted(partners.items(), key=lambda kv: (-_count(kv[1]), str(kv[0])))
    named = [f"{short(str(p))} x{_count(n)}" for p, n in ranked[:MAX_PARTNERS_SHOWN]]
    if len(ranked) > MAX_PARTNERS_SHOWN:
        named.append(f"{len(ranked) - MAX_PARTNERS_SHOWN} more")
    solo = mixing.get("solo_share")
    solo_text = f" ({solo:.0%} solo)" if isinstance(solo, (int, float)) else ""
    count = len(partners)
    who = f" with {count} partner{'s' * (count != 1)}: {', '.join(named)}" if named else ", no partner"
    scheduled = mixing.get("scheduled")
    sched_text = f"; {scheduled} with the scheduled partner" if isinstance(scheduled, int) and named else ""
    return (
        f"mixing: {_fmt(mixing.get('averaged'))} of the last {steps} outer steps averaged{solo_text}{who}"
        f"{sched_text}"
    )


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _secs(seconds: float) -> str:
    """Seconds for humans: sub-second paces (tiny test models) in ms, so they do not read as 0.0 s."""
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _donor_line(join: Any) -> str | None:
    """What this node served joiners (issue #55): only once it served one, or is serving, or was cut."""
    if not isinstance(join, dict) or not (join.get("served") or join.get("serving") or join.get("live_cut")):
        return None
    line = f"donor: served {join.get('served', 0)} snapshot download(s), {join.get('served_live', 0)} of live weights"
    if join.get("serving"):
        line += f"; serving {join['serving']} now"
    if join.get("results_held_s"):
        line += f"; outer results held {_fmt(join['results_held_s'], '.1f')}s for them"
    if join.get("live_cut"):
        line += f"; {join['live_cut']} cut (the weights changed first; those joiners get a checkpoint next)"
    return line


def _pace_line(tr: TrainingStatus) -> str:
    """The swarm's pace, and how many inner steps this machine fits in one outer step (fewer = slower)."""
    period = tr.get("period_s")
    inner = tr.get("last_inner_steps")
    pace = (
        f"an outer step every {_secs(period)}"
        if isinstance(period, (int, float)) and period > 0
        else "an outer step every train.inner_steps inner steps of this machine"
    )
    return f"pace: {pace}" + (f", {inner} inner steps in the last" if isinstance(inner, int) else "")


def _partner_count(member: MemberStatus) -> str:
    """How many partners a trainer names for its recent outer steps; blank for non-trainers."""
    partners = member.get("partners")
    if member.get("role") != "trainer" or not isinstance(partners, list):
        return ""
    return str(len(partners))


def _pairing_line(members: list[MemberStatus], cut: bool = False) -> str:
    """Whether the alive trainers form one pairing group, as `starling doctor` judges it. `cut`: the member
    table was cut, so name at most a few islands and a few trainers of each (hundreds would fill the screen)."""
    graph = pairing_graph(members)
    unpaired = f", {len(graph.unpaired)} unpaired" if graph.unpaired else ""
    if not graph.islands and len(graph.unpaired) == 1:
        # After its partner left, "no pairs ..., 1 unpaired" read as if pairing had failed.
        return "pairing graph: one alive trainer, nobody to pair with"
    if not graph.islands:
        return f"pairing graph: no pairs in the alive trainers' recent outer steps{unpaired}"
    if not graph.split:
        return f"pairing graph: one island of {graph.paired} trainers{unpaired}"
    most = MAX_ISLANDS_NAMED if cut else len(graph.islands)
    groups = "  ".join("{" + _named(island, MAX_PARTNERS_SHOWN if cut else len(island)) + "}"
                       for island in graph.islands[:most])
    if len(graph.islands) > most:
        groups += f"  and {len(graph.islands) - most} more"
    return f"pairing graph: {len(graph.islands)} islands (see starling doctor): {groups}{unpaired}"


def _named(peers: list[str], most: int) -> str:
    """Up to `most` short PeerIDs, the rest counted."""
    named = ", ".join(short(p) for p in peers[:most])
    return named + (f", {len(peers) - most} more" if len(peers) > most else "")
