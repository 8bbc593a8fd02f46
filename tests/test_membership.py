"""The SWIM membership core (node/swarm/membership.py) on small in-process networks (starling_testing/swim_sim.py):
failure detection, refutation, indirect probes, dissemination, joins, partitions, and its bounds against a
hostile sender. Deterministic seeds; simulated time only."""

from __future__ import annotations

import math
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.swarm.membership import (
    ALIVE,
    DEAD,
    MAX_INCARNATION_JUMP,
    SUSPECT,
    UNKNOWN,
    Ack,
    Alive,
    Dead,
    Membership,
    MembershipConfig,
    Ping,
    PingReq,
    Progress,
    Suspect,
    SyncReply,
    SyncRequest,
    _Queue,
)
from starling_testing.swim_sim import SimNet

QUIET = {"loss": 0.0, "latency": (0.01, 0.05)}


def _recorder() -> tuple[list[tuple[int, int, int, int, float]], object]:
    events: list[tuple[int, int, int, int, float]] = []
    return events, lambda *e: events.append(e)


def test_a_dead_member_is_suspected_then_confirmed_dead_everywhere() -> None:
    events, hook = _recorder()
    net = SimNet(seed=1, hook=hook, **QUIET)
    ids = net.start(20)
    net.run_for(10)
    victim, killed_at = ids[5], net.now
    net.kill(victim)
    net.run_for(120)
    assert all(node.state_of(victim) == DEAD for node in net.nodes.values())
    # Every node held it suspect before dead, or was told of the death by others; at least its detector
    # went through suspicion (SWIM never kills on one missed probe).
    about = [(obs, new) for obs, member, _, new, t in events if member == victim and t > killed_at]
    first = {}
    for obs, new in about:
        first.setdefault(obs, new)
    assert SUSPECT in first.values()
    assert all(state in (SUSPECT, DEAD) for state in first.values())
    assert sum(n.counters["declared_dead"] for n in net.nodes.values()) >= 1


def test_a_live_member_refutes_a_false_suspicion_with_a_higher_incarnation() -> None:
    net = SimNet(seed=2, **QUIET)
    ids = net.start(12)
    net.run_for(5)
    victim, accuser, listener = ids[3], ids[4], ids[6]
    # The accuser (a member) tells a third node that the victim is suspect.
    net.send(accuser, [(listener, Ping(accuser, 999, listener, (Suspect(victim, 0, accuser),)))])
    net.run_for(1)
    assert net.nodes[listener].state_of(victim) == SUSPECT
    net.run_for(60)
    assert net.nodes[victim].incarnation == 1
    assert net.nodes[victim].counters["refuted"] >= 1
    assert all(n.state_of(victim) == ALIVE and n.incarnation_of(victim) == 1
               for pid, n in net.nodes.items() if pid != victim)


def test_indirect_probes_keep_a_member_whose_direct_path_drops_alive() -> None:
    def run(k: int) -> tuple[set[int], int]:
        events, hook = _recorder()
        net = SimNet(seed=3, hook=hook, config=MembershipConfig(indirect_k=k), **QUIET)
        ids = net.start(10)
        a, b = ids[0], ids[1]
        net.cut = lambda src, dst: {src, dst} == {a, b}
        net.run_for(120)
        suspected = {obs for obs, member, _, new, _ in events if member == b and new == SUSPECT}
        return suspected, net.nodes[a].counters["indirect_probes"]

    suspected, indirect = run(3)
    assert indirect > 0 and suspected == set()
    # Without indirect probes the same cut link makes b suspect: the indirect path is what saved it.
    suspected, _ = run(0)
    assert suspected


def test_a_join_through_a_seed_reaches_everyone_and_the_joiner_learns_everyone() -> None:
    net = SimNet(seed=4, config=MembershipConfig(join_page_entries=8), **QUIET)
    ids = net.start(40)
    net.run_for(5)
    joiner = net.join("newcomer", ids[17])
    net.run_for(60)
    assert all(n.state_of(joiner) == ALIVE for pid, n in net.nodes.items() if pid != joiner)
    assert sorted(net.nodes[joiner].members()) == sorted(net.nodes)
    pages = net.nodes[joiner].counters["join_pages_asked"]
    assert pages >= 40 // 8  # paged, not one unbounded reply
    # ... by many members, not the seed alone (its load must not grow with N per joiner).
    assert net.nodes[ids[17]].counters["pages_served"] < pages / 2
    # The table it was handed is not news: its queue holds its own announcement, not 40 others'.
    assert net.nodes[joiner].queued_news() < 5


def test_a_member_that_missed_a_joins_gossip_learns_of_it_from_the_joiners_probe() -> None:
    joiner = Membership(50, 0.0, random.Random(1))
    joiner.preload(range(50), 0.0)
    joiner.join(0, 0.0)
    pings = []
    for t in range(1, 100):
        pings += [m for _, m in joiner.tick(float(t)) if isinstance(m, Ping)]
    # Long after its own Alive left its broadcast queue, its probes still carry it...
    late = pings[-10:]
    assert late and all(Alive(50, 0) in p.updates for p in late)
    # ... so a member that never heard the gossip learns of it from the probe.
    deaf = _node(members=50)
    deaf.receive(100.0, late[-1])
    assert deaf.state_of(50) == ALIVE


def test_a_seed_spreads_the_joiners_own_announcement_but_not_the_table_it_hands_over() -> None:
    """The joiner's Alive on its sync request is news for the swarm (before, the seed applied it silently,
    and a member not connected to the joiner heard of it only from a push-pull slice, in a daemon whose
    probes go to connected members only)."""
    seed = _node(members=5)
    joiner = Membership(60, 0.0, random.Random(2))
    ((_, request),) = joiner.join(0, 0.0)
    assert isinstance(request, SyncRequest)
    request = SyncRequest(60, request.seq, request.cursor, (*request.entries, Alive(61, 0)), until=request.until)
    seed.receive(0.5, request)
    assert seed.state_of(60) == ALIVE
    pings = [m for t in range(1, 10) for _, m in seed.tick(float(t)) if isinstance(m, Ping)]
    carried = {u.member for p in pings for u in p.updates if isinstance(u, Alive)}
    assert 60 in carried and 61 not in carried


def test_a_member_held_quietly_since_it_connected_is_gossiped_when_its_own_announcement_arrives() -> None:
    """A daemon holds a connected peer at once (``preload``); the peer's announcement that follows said nothing
    new there and went no further, so members not connected to the peer never heard of it."""
    node = _node(members=5)
    node.preload([40], 0.5)
    node.receive(1.0, Ping(40, 1, 0, (Alive(40, 0),)))
    node.receive(1.5, Ping(40, 2, 0, (Alive(40, 0),)))  # once is enough
    pings = [m for t in range(2, 12) for _, m in node.tick(float(t)) if isinstance(m, Ping)]
    assert any(Alive(40, 0) in p.updates for p in pings)


def test_confirmations_of_a_suspicion_count_and_travel_on_only_up_to_k() -> None:
    node = _node(members=30, suspicion_mult=4)  # k = 2
    node.receive(1.0, Ping(1, 1, 0, (Suspect(9, 0, 1),)))
    first, _ = node.suspicion(9) or (0.0, 0)
    for accuser in range(2, 8):
        node.receive(1.0, Ping(accuser, accuser, 0, (Suspect(9, 0, accuser),)))
    deadline, accusers = node.suspicion(9) or (0.0, 0)
    assert accusers == 3 and deadline < first


def test_progress_reaches_every_member_and_a_newer_version_replaces_it() -> None:
    net = SimNet(seed=5, **QUIET)
    ids = net.start(30)
    author = net.nodes[ids[2]]
    author.set_progress(7, 2.5, 100.0, net.now)
    net.run_for(30)
    seen = [n.progress_of(ids[2]) for pid, n in net.nodes.items() if pid != ids[2]]
    assert all(p is not None and p.outer_step == 7 for p in seen)
    author.set_progress(8, 2.4, 100.0, net.now)  # within progress_interval_s: held back, then published
    net.run_for(60)
    assert all(n.progress_of(ids[2]).outer_step == 8 for pid, n in net.nodes.items() if pid != ids[2])


def test_progress_is_published_at_most_once_per_interval() -> None:
    node = Membership(0, 0.0, random.Random(0), MembershipConfig(progress_interval_s=30.0))
    for i in range(100):
        node.set_progress(i, 1.0, 1.0, i * 0.1)
    assert node.progress_of(0).version == 1
    node.tick(31.0)
    assert node.progress_of(0).version == 2 and node.progress_of(0).outer_step == 99


def test_halves_of_a_partition_find_each_other_again() -> None:
    config = MembershipConfig(pushpull_s=5.0)
    net = SimNet(seed=6, config=config, **QUIET)
    ids = net.start(16)
    left = set(ids[:8])
    net.cut = lambda src, dst: (src in left) != (dst in left)
    net.run_for(200)
    assert all(net.nodes[a].state_of(b) == DEAD for a in ids[:8] for b in ids[8:])
    net.cut = None
    net.run_for(300)
    assert all(net.nodes[a].state_of(b) == ALIVE for a in ids for b in ids if a != b)


# ------------------------------------------------------------------------------------- hostile senders


def _node(members: int = 5, **config: object) -> Membership:
    node = Membership(0, 0.0, random.Random(0), MembershipConfig(**config))  # type: ignore[arg-type]
    node.preload(range(members), 0.0)
    return node


def test_updates_past_the_cap_of_one_message_are_dropped() -> None:
    node = _node(members=5, max_updates=8)
    flood = tuple(Alive(100 + i, 0) for i in range(50))
    node.receive(1.0, Ping(1, 1, 0, flood))
    assert node.size == 5 + 8
    assert node.counters["updates_over_cap"] == 42


def test_claims_about_unknown_members_and_from_non_members_are_ignored() -> None:
    node = _node()
    node.receive(1.0, Ping(1, 1, 0, (Suspect(77, 0, 1), Dead(78, 0, 1))))
    assert node.state_of(77) == UNKNOWN and node.state_of(78) == UNKNOWN and node.size == 5
    # A stranger may announce itself, nothing else.
    node.receive(1.0, Ping(50, 2, 0, (Suspect(2, 0, 50), Alive(51, 0), Alive(50, 0))))
    assert node.state_of(2) == ALIVE and node.state_of(51) == UNKNOWN
    assert node.state_of(50) == ALIVE
    assert node.counters["from_non_member"] == 2
    # An accuser that is not a member does not count, even relayed by a member.
    node.receive(1.0, Ping(1, 3, 0, (Suspect(3, 0, 60),)))
    assert node.state_of(3) == ALIVE and node.counters["accuser_not_member"] == 1


def test_a_suspect_or_dead_claim_about_ourselves_is_refuted_never_adopted() -> None:
    node = _node()
    out = node.receive(1.0, Ping(1, 1, 0, (Suspect(0, 0, 1),)))
    assert node.incarnation == 1 and node.state_of(0) == ALIVE
    ack = out[0][1]
    assert isinstance(ack, Ack) and Alive(0, 1) in ack.updates
    node.receive(2.0, Ping(1, 2, 0, (Dead(0, 1, 1),)))
    assert node.incarnation == 2
    node.receive(3.0, Ping(1, 3, 0, (Suspect(0, 1, 1),)))  # an old incarnation: nothing to refute
    assert node.incarnation == 2


def test_a_dead_member_comes_back_only_with_a_higher_incarnation() -> None:
    node = _node()
    node.receive(1.0, Ping(1, 1, 0, (Dead(2, 3, 1),)))
    assert node.state_of(2) == DEAD
    node.receive(2.0, Ping(1, 2, 0, (Alive(2, 3),)))
    assert node.state_of(2) == DEAD
    node.receive(3.0, Ping(1, 3, 0, (Alive(2, 4),)))
    assert node.state_of(2) == ALIVE and node.incarnation_of(2) == 4


def test_incarnation_games_are_bounded() -> None:
    node = _node()
    node.receive(1.0, Ping(1, 1, 0, (Alive(2, MAX_INCARNATION_JUMP + 5), Dead(3, 2**40, 1), Alive(4, -1))))
    assert node.incarnation_of(2) == 0 and node.state_of(3) == ALIVE and node.state_of(4) == ALIVE
    assert node.counters["incarnation_jump"] == 1 and node.counters["malformed"] == 1


def test_the_member_table_is_capped_and_dead_members_make_room_first() -> None:
    node = _node(members=5, max_members=10, max_updates=100)
    node.receive(1.0, Ping(1, 1, 0, tuple(Alive(100 + i, 0) for i in range(50))))
    assert node.size == 10 and node.counters["table_full"] == 45
    node.receive(2.0, Ping(1, 2, 0, (Dead(100, 0, 1),)))
    node.receive(3.0, Ping(1, 3, 0, (Alive(500, 0),)))
    assert node.size == 10 and node.state_of(500) == ALIVE and node.state_of(100) == UNKNOWN


def test_a_sync_reply_is_capped_and_a_strangers_view_of_us_costs_no_incarnation() -> None:
    node = _node(members=5, join_page_entries=16, pushpull_entries=8)
    node.receive(1.0, SyncReply(1, 1, -1, tuple(Alive(100 + i, 0) for i in range(500))))
    assert node.size <= 5 + 17
    node.receive(2.0, SyncRequest(999, 2, -1, (), Suspect(0, 0, 999)))
    assert node.incarnation == 0


def test_progress_claims_are_bounded() -> None:
    node = _node()
    node.receive(1.0, Ping(1, 1, 0, (Progress(2, 5, 10, 1.0, 3.0), Progress(77, 1, 1, 1.0, 1.0),
                                     Progress(3, 1, 1, float("nan"), 1.0), Progress(4, 2**33, 1, 1.0, 1.0))))
    assert node.progress_of(2).outer_step == 10
    assert node.progress_of(77) is None and node.progress_of(3) is None and node.progress_of(4) is None
    node.receive(2.0, Ping(1, 2, 0, (Progress(2, 4, 99, 1.0, 3.0),)))  # older version
    assert node.progress_of(2).outer_step == 10


def test_the_broadcast_queue_is_bounded_and_each_update_is_sent_a_limited_number_of_times() -> None:
    queue = _Queue(cap=10)
    for i in range(100):
        queue.put(Alive(i, 0))
    assert len(queue) == 10
    sent: dict[int, int] = {}
    for _ in range(100):
        batch = queue.take(limit=3, max_count=4, max_bytes=400)
        assert len(batch) <= 4 and sum(u.size for u in batch) <= 400
        for u in batch:
            sent[u.member] = sent.get(u.member, 0) + 1
    assert len(queue) == 0 and set(sent.values()) == {3}


_updates = st.one_of(
    st.builds(Alive, st.integers(0, 12), st.integers(-2, 2**33)),
    st.builds(Suspect, st.integers(0, 12), st.integers(-2, 2**33), st.integers(0, 12)),
    st.builds(Dead, st.integers(0, 12), st.integers(-2, 2**33), st.integers(0, 12)),
    st.builds(Progress, st.integers(0, 12), st.integers(0, 2**33), st.integers(-5, 2**33),
              st.floats(allow_nan=True), st.floats(allow_nan=True)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 12), st.lists(_updates, max_size=20)), max_size=30))
def test_whatever_peers_send_the_bounds_hold(batches: list[tuple[int, list]]) -> None:
    node = _node(members=4, max_members=8, max_updates=6)
    incarnation = 0
    for i, (sender, updates) in enumerate(batches):
        node.receive(float(i), Ping(sender, i, 0, tuple(updates)))
        node.tick(float(i) + 0.5)
        assert node.size <= 8
        assert node.state_of(0) == ALIVE and node.incarnation >= incarnation
        incarnation = node.incarnation
        assert all(0 <= node.incarnation_of(m) < 2**32 for m in range(13))


# ------------------------------------------------------------------------- evidence and local health (Lifeguard)


def _probe_of(out: list) -> tuple[int, Ping]:
    (target, ping), = [(t, m) for t, m in out if isinstance(m, Ping)]
    return target, ping


def test_a_probe_nobody_could_carry_is_no_evidence_but_one_helpers_could_is() -> None:
    # The daemon's rule: messages go to connected members only. Member 2's connection dropped (so the
    # direct ping cannot go); with no other member connected, no helper can be asked either.
    node = _node()
    node.can_probe = lambda pid: False
    assert [t for t, _ in node.probe(2, 1.0)] == [2]  # (the daemon drops a ping to a member not connected)
    assert node.tick(1.6) == []  # the direct deadline: no helper to ask
    node.tick(3.1)
    assert node.state_of(2) == ALIVE and node.counters["no_evidence"] == 1 and node.counters["suspected"] == 0
    assert [t for t, _ in node.recheck(3.2)] == [2] and node.recheck(3.3) == []  # once a connection appears
    node.abandon(2)  # (the daemon closed that connection itself: that probe says nothing either)
    assert node.counters["probes_abandoned"] == 1
    # With one member connected it is asked to probe, and its silence too is evidence: a member that died
    # (and took its connections with it) must still turn suspect.
    node.can_probe = lambda pid: pid == 1
    node.probe(2, 5.0)
    out = node.tick(5.6)
    assert [t for t, m in out if not isinstance(m, Ping)] == [1]
    node.tick(7.1)
    assert node.state_of(2) == SUSPECT and node.counters["no_evidence"] == 1


def test_a_member_that_sent_other_data_since_the_ping_is_not_suspected_but_one_silent_since_is() -> None:
    # A daemon's connections tell when each member last delivered anything, on any protocol. Member 2 is
    # slow (its ack waits behind its other traffic) but sent something after the ping went: no helpers, no
    # suspicion. Member 3 last sent something before the ping: probed as before, suspected.
    node = _node(period_s=1000.0)  # (no round-robin probe of its own meanwhile)
    last_data = {2: -1.0, 3: 4.5}
    node.heard_since = lambda pid, since: last_data.get(pid, -1.0) > since
    node.probe(2, 1.0)
    last_data[2] = 1.2  # (after the ping, which went at 1.0)
    assert node.tick(1.6) == []  # the direct deadline: no helper asked
    assert node.counters["alive_by_traffic"] == 1 and node.counters["indirect_probes"] == 0
    node.tick(3.1)
    assert node.state_of(2) == ALIVE and node.counters["suspected"] == 0
    node.probe(3, 5.0)
    assert [t for t, m in node.tick(5.6) if isinstance(m, PingReq)]  # helpers asked: nothing since the ping
    last_data[3] = 6.0  # and what arrives before the final deadline counts too
    node.tick(7.1)
    assert node.state_of(3) == ALIVE and node.counters["alive_by_traffic"] == 2
    # Silent since: suspected as before, once the ping of 5.0, still unanswered, has been waited for
    # (see the pending-request test below: three times its 3 s, at most max_answer_wait_s).
    node.probe(3, 8.0)
    assert node.tick(8.6) == [] and node._answer_wait(3, 8.0) == node.config.max_answer_wait_s
    assert [t for t, m in node.tick(16.0) if isinstance(m, PingReq)]
    node.tick(17.5)
    assert node.state_of(3) == SUSPECT and node.counters["suspected"] == 1


def test_a_helper_acks_for_a_target_that_sent_it_other_data_since_its_ping_and_not_for_a_silent_one() -> None:
    helper = _node(period_s=1000.0)
    last_data = {2: -1.0}
    helper.heard_since = lambda pid, since: last_data.get(pid, -1.0) > since
    # Member 1 asks the helper to probe member 2 (its own ping of 2 went unanswered).
    out = helper.receive(1.0, PingReq(1, 77, 2))
    (_, ping), = out
    assert isinstance(ping, Ping) and ping.target == 2
    assert helper.tick(1.3) == []  # nothing from 2 yet
    last_data[2] = 1.4  # 2 sends the helper something, though not the ack
    acks = [(to, m) for to, m in helper.tick(1.6) if isinstance(m, Ack)]  # (checked every half ack timeout)
    assert [(to, m.seq) for to, m in acks] == [(1, 77)] and helper.counters["relayed_alive_by_traffic"] == 1
    # A target silent since the helper's ping: no ack, the relay expires as before.
    helper.receive(2.0, PingReq(1, 78, 3))
    assert not [m for t in (2.3, 2.6, 3.0, 3.5, 4.1) for _, m in helper.tick(t) if isinstance(m, Ack)]
    assert helper._relays == {}


def test_time_this_node_could_not_listen_does_not_count_against_a_probe() -> None:
    node = _node()
    t0 = node.next_wakeup()
    target, ping = _probe_of(node.tick(t0))
    # This node's loop stalled 3 s (past the probe's whole 2 s): the ack may be sitting unread. The timer
    # loop notes the lag before it runs the timers: the probe is not over.
    node.note_lag(3.0, t0 + 3.0)
    node.tick(t0 + 3.0)
    assert node.state_of(target) == ALIVE and node.counters["indirect_probes"] == 0
    node.receive(t0 + 3.05, Ack(target, ping.seq, ()))
    node.tick(t0 + 6.0)
    assert node.state_of(target) == ALIVE and node.counters["suspected"] == 0


def test_local_health_stretches_the_timeouts_and_the_period_and_acks_bring_it_back() -> None:
    node = _node(members=3)
    for _ in range(3):
        node.note_lag(0.3, 0.0)  # over half the 0.5 s ack timeout: a starved loop
    node.note_lag(0.1, 0.0)  # scheduling noise: no count
    assert node.local_health == 3
    t0 = node.next_wakeup()
    target, ping = _probe_of(node.tick(t0))
    probe = node._probes[ping.seq]
    assert (probe.deadline_direct, probe.deadline) == (t0 + 4 * 0.5, t0 + 4 * 2.0)  # x (1 + 3)
    assert node._next_probe == t0 + 4 * node.config.period_s
    node.tick(t0 + 1.9)
    assert node.counters["indirect_probes"] == 0
    node.receive(t0 + 1.95, Ack(target, ping.seq, ()))
    assert node.local_health == 2
    # Refuting a suspicion of itself means this node answered too late for someone: up again.
    node.receive(t0 + 2.0, Ping(1, 9, 0, (Suspect(0, 0, 1),)))
    assert node.local_health == 3 and node.incarnation == 1
    for _ in range(20):
        node.note_lag(5.0, t0 + 3)
    assert node.local_health == node.config.max_local_health


def test_a_probe_that_fails_with_no_helper_to_ask_counts_against_this_nodes_health() -> None:
    # A joiner connected to its seed alone (member 1): when its ping goes unanswered nobody can say whether
    # the seed or the joiner failed, so the failure stretches the joiner's next timeouts (memberlist's rule).
    node = _node(members=3)
    node.can_probe = lambda pid: pid == 1
    node._next_probe = other_probes = float("inf")  # only the probes this test starts
    assert [t for t, _ in node.probe(1, 1.0)] == [1]
    assert node.tick(1.6) == []  # the direct deadline: no helper to ask
    node.tick(3.1)
    assert node.local_health == 1 and node.state_of(1) == ALIVE  # one such miss is no suspicion (next test)
    _, ping = _probe_of(node.probe(1, 40.0))  # (past the time its unanswered ping of 1.0 is waited for)
    assert node._probes[ping.seq].deadline == 40.0 + 2 * node.config.probe_timeout_s
    # With a helper asked, its silence is the evidence (it is connected too): this node's health is not
    # the question, as before.
    other = _node(members=3)
    other.can_probe = lambda pid: pid in (1, 2)
    other._next_probe = other_probes
    other.probe(2, 1.0)
    assert [t for t, m in other.tick(1.6) if isinstance(m, PingReq)] == [1]
    other.tick(3.1)
    assert other.state_of(2) == SUSPECT and other.local_health == 0


def test_a_member_its_prober_can_ask_nobody_about_is_suspected_only_after_misses_in_a_row() -> None:
    """At a 64-daemon join, 155 of the 221 probes that failed were a newcomer's of its seed, its only
    connection, which answered late while 63 others joined through it: each made the seed suspect in the
    newcomer's view and spread to every view. With no helper to ask, ``lonely_misses`` failed probes in a row
    are a suspicion; anything heard from the member between them starts the count again. So a hung member
    of a swarm of two is still suspected, later."""
    node = _node(members=3)
    node.can_probe = lambda pid: pid == 1
    node._next_probe = float("inf")  # only the probes this test starts
    t = 1.0
    misses = node.config.lonely_misses
    for _ in range(misses - 1):
        node.probe(1, t)
        node.tick(t + 0.6)
        t += 20.0
        node.tick(t)
    assert node.state_of(1) == ALIVE and node.counters["lonely_misses"] == misses - 1
    node.receive(t, Ping(1, 99, 0, ()))  # a message from it: it lives (late acks and pings alike)
    for _ in range(misses - 1):
        node.probe(1, t)
        node.tick(t + 0.6)
        t += 20.0
        node.tick(t)
    assert node.state_of(1) == ALIVE
    node.probe(1, t)
    node.tick(t + 0.6)
    node.tick(t + 20.0)
    assert node.state_of(1) == SUSPECT


def test_a_member_probed_moments_ago_is_passed_over_by_the_round_robin() -> None:
    """A daemon probes connected members only: a newcomer connected to its seed alone pinged it every period
    (63 pings a second at the seed of a 64-daemon join). A member probed less than ``probe_spacing_s`` ago is
    passed over; with several to probe the round-robin goes on as before."""
    node = _node(members=3)
    node.can_probe = lambda pid: pid == 1
    assert _round_robin(node, 12) == [1] * (12 // int(node.config.probe_spacing_s / node.config.period_s))
    many = _node(members=9)
    many.can_probe = lambda pid: True
    assert sorted(_round_robin(many, 8)) == list(range(1, 9))  # one per period, each member once


def _round_robin(node: Membership, periods: int) -> list[int]:
    """The members ``node`` starts probing over ``periods`` probe periods (each probe dropped at once)."""
    targets = []
    for i in range(periods):
        now = 10.0 + i * node.config.period_s
        node._next_probe = now
        targets += [t for t, m in node.tick(now) if isinstance(m, Ping)]
        node._probes.clear()
    return targets


def test_a_sparsely_connected_node_finds_its_one_possible_helper() -> None:
    # A joiner holds 64 members but is connected to two (the daemon sends to connected members only): when
    # its probe of one goes unanswered, the other is asked, every time (16 random draws of the table found it
    # about two times in five).
    for seed in range(20):
        node = Membership(0, 0.0, random.Random(seed))
        node.preload(range(64), 0.0)
        node.can_probe = lambda pid: pid in (1, 2)
        node._next_probe = float("inf")  # only the probe this test starts
        node.probe(1, 1.0)
        assert [t for t, m in node.tick(1.6) if isinstance(m, PingReq)] == [2], seed


def test_a_member_never_heard_of_is_looked_up_in_its_hash_bucket_at_a_connected_member() -> None:
    # Member 7 joined while this node's gossip missed it: the daemon knows it from its record in the swarm
    # state and asks a member it may send to for 7's bucket of the table, a page of one bucket.
    node = Membership(0, 0.0, random.Random(1))
    node.preload(range(3), 0.0)
    node.can_probe = lambda pid: pid == 1
    server = Membership(1, 0.0, random.Random(2))
    server.preload([0, 2, 7], 0.0)
    assert node.look_up([0, 2], 1.0) == []  # itself, and a member it holds: nothing to ask
    (dst, request), = node.look_up([7], 1.0)
    assert dst == 1 and isinstance(request, SyncRequest) and request.until == request.cursor + 1
    (back, reply), = server.receive(1.0, request)
    assert back == 0 and isinstance(reply, SyncReply)
    node.receive(1.1, reply)
    assert node.state_of(7) == ALIVE and node.counters["lookups"] == 1
    node.can_probe = lambda pid: False
    assert node.look_up([8], 2.0) == []  # nobody to ask


def test_a_member_held_dead_is_looked_up_revived_by_a_newer_incarnation_or_told_on_until_it_refutes() -> None:
    node = Membership(0, 0.0, random.Random(1))
    node.preload(range(3), 0.0)
    node.can_probe = lambda pid: pid == 1
    node.receive(0.5, Ping(1, 1, 0, (Dead(2, 0, 1),)))  # member 1 declared 2 dead; its refutation missed us
    assert node.state_of(2) == DEAD
    server = Membership(1, 0.0, random.Random(2))
    server.preload(range(3), 0.0)
    server.receive(0.6, Ping(2, 1, 1, (Alive(2, 1),)))  # 2 refuted: incarnation 1
    (_, request), = node.look_up([2], 1.0)
    (_, reply), = server.receive(1.0, request)
    node.receive(1.1, reply)
    assert node.state_of(2) == ALIVE and node.incarnation_of(2) == 1
    # A server that holds the same incarnation alive is told of the death (with this node's own claim), and
    # gossips it on: that is how the member hears of it and refutes.
    stale = Membership(1, 0.0, random.Random(3))
    stale.preload(range(3), 0.0)
    node.receive(1.5, Ping(1, 2, 0, (Dead(2, 1, 1),)))
    (_, request), = node.look_up([2], 2.0)
    assert request.entries == (Dead(2, 1, 0),)
    stale.receive(2.0, Ping(2, 2, 1, (Alive(2, 1),)))
    stale.receive(2.1, request)
    assert stale.state_of(2) == DEAD and any(isinstance(u, Dead) and u.member == 2 for u in stale._piggyback())


def test_a_member_held_suspect_for_a_while_is_looked_up_and_its_refutation_ends_the_suspicion() -> None:
    """At a 64-daemon join single views held a member suspect for 30 s (then dead) after every other view had
    its refutation, which the gossip's limited retransmissions never brought them. A suspicion older than
    ``lookup_suspect_after_s`` is asked about (carrying no claim, so as not to spread it); a younger one is
    left to its refutation."""
    node = Membership(0, 0.0, random.Random(1))
    node.preload(range(3), 0.0)
    node.can_probe = lambda pid: pid == 1
    node.receive(0.5, Ping(1, 1, 0, (Suspect(2, 0, 1),)))  # member 1 suspected 2; 2's refutation missed us
    assert node.state_of(2) == SUSPECT
    assert node.look_up([2], 0.5 + node.config.lookup_suspect_after_s / 2) == []  # a young suspicion
    server = Membership(1, 0.0, random.Random(2))
    server.preload(range(3), 0.0)
    server.receive(0.6, Ping(2, 1, 1, (Alive(2, 1),)))  # 2 refuted: incarnation 1
    now = 0.5 + node.config.lookup_suspect_after_s
    (_, request), = node.look_up([2], now)
    assert request.entries == ()
    (_, reply), = server.receive(now, request)
    node.receive(now + 0.1, reply)
    assert node.state_of(2) == ALIVE and node.incarnation_of(2) == 1


def _join_exchange(seed: Membership, joiner: Membership, until: float) -> int:
    """Run a join of ``joiner`` through ``seed`` alone (a daemon's joiner connected to its seed only), messages
    delivered at once, ticking every 0.1 s of simulated time; returns the page requests the joiner sent."""
    requests = 0
    joiner.can_probe = lambda pid: pid == seed.me  # connected to its seed alone: nobody else to ask
    outbox = joiner.join(seed.me, 0.0)
    t = 0.0
    while t < until and not joiner.counters["joined"]:
        for dst, message in outbox:
            if dst == seed.me and isinstance(message, SyncRequest):
                requests += 1
                for back_dst, reply in seed.receive(t, message):
                    if back_dst == joiner.me:
                        joiner.receive(t, reply)
        t += 0.1
        outbox = [(d, m) for d, m in joiner.tick(t) if isinstance(m, SyncRequest)]
    return requests


def test_a_joiner_gets_a_64_member_table_from_its_seed_in_one_page() -> None:
    """In a daemon a joiner connected to its seed alone can ask nobody else; when its first request covered
    1/64 of the hash space, a 64-member table took ~7 pages, and 63 joiners at once waited minutes on the
    seed's pages per second (docs/benchmarks.md, "SWIM in the daemon")."""
    seed = _node(members=64)
    joiner = Membership(100, 0.0, random.Random(1))
    requests = _join_exchange(seed, joiner, until=60.0)
    assert joiner.counters["joined"] == 1
    assert sorted(joiner.members()) == sorted([*range(64), 100])
    assert requests == 1


def test_a_member_that_joined_on_a_partial_table_catches_up_with_a_page_from_another_member() -> None:
    """A joiner's one page is its seed's table at that moment; at a join, a seed that held half the swarm.
    ``catch_up`` pulls the table again from a member that has caught up (not while a pull is under way)."""
    seed = _node(members=8)
    joiner = Membership(100, 0.0, random.Random(1))
    _join_exchange(seed, joiner, until=10.0)
    assert joiner.counters["joined"] == 1 and len(joiner.members()) == 9
    other = Membership(3, 0.0, random.Random(2))  # a member both hold, which has caught up: it holds 40
    other.preload(range(40), 0.0)
    joiner.can_probe = lambda pid: pid == 3
    out = joiner.catch_up(20.0)
    (dst, request), = out
    assert dst == 3 and isinstance(request, SyncRequest) and request.cursor == 0
    assert joiner.catch_up(20.1) == []  # one pull at a time
    for _, reply in other.receive(20.2, request):
        joiner.receive(20.2, reply)
    assert set(range(40)) <= set(joiner.members())
    assert joiner.counters["caught_up"] == 1 and joiner.counters["joined"] == 1
    assert joiner.catch_up(21.0)  # done: another may start


def test_a_joiner_answered_busy_backs_off_instead_of_asking_every_page_interval() -> None:
    """A seed over its pages per second answers "busy"; a joiner that can ask nobody else asked again every
    ``join_page_s`` (0.5 s), so 63 joiners sent their seed ~126 requests a second it could not serve."""
    seed = _node(members=64, sync_serve_per_s=1e-6)  # never a token: every request answered "busy"
    joiner = Membership(100, 0.0, random.Random(1))
    requests = _join_exchange(seed, joiner, until=60.0)
    assert joiner.counters["joined"] == 0 and seed.counters["sync_busy"] == requests
    # One request per join_page_s would be 120 in these 60 s; backing off up to join_busy_max_s it is a
    # handful plus one per 8 s at most.
    assert requests <= 6 + 60 / MembershipConfig().join_busy_max_s / 0.5


def test_a_member_whose_answers_came_late_is_waited_for_as_long_as_they_take_and_no_longer() -> None:
    """At a 64-daemon join on two cores the bootstrap node's acks took 1.5 to 3.3 s for 10 s, past the 2 s a
    probe waits: a prober that had timed it so still suspected it at its next probe, and every view showed
    it suspect. An answer's time, late ones included, now sets how long the member's next ping waits (TCP's
    retransmission timer: smoothed time plus four deviations), at most ``max_answer_wait_s``; quick answers
    bring it back to the configured timeouts, and a member that stops answering is still suspected."""
    node = _node(period_s=1000.0, pushpull_s=1000.0)  # (no probe or push-pull of its own meanwhile)
    _, ping = _probe_of(node.probe(2, 1.0))
    assert [t for t, m in node.tick(1.6) if isinstance(m, PingReq)]  # as before: helpers asked at 0.5 s
    node.receive(2.8, Ack(2, ping.seq, ()))  # its own ack, 1.8 s after the ping (within the probe's 2 s)
    assert node.state_of(2) == ALIVE and math.isclose(node._answer_wait(2), 1.8 + 4 * 0.9)
    # The next probe of 2 waits 5.4 s for the direct ack (before: helpers at 0.5 s, suspect at 2 s).
    _, ping = _probe_of(node.probe(2, 10.0))
    assert node.tick(11.0) == [] and node.tick(12.1) == []
    assert node.state_of(2) == ALIVE and node.counters["indirect_probes"] == 1
    node.receive(13.0, Ack(2, ping.seq, ()))  # 3 s late by the configured timeouts
    assert node.counters["suspected"] == 0 and node.counters["acks"] == 2
    # A member that stops answering is still suspected: the stretched direct wait, then the indirect stage.
    _, ping = _probe_of(node.probe(2, 20.0))
    wait = node._answer_wait(2)
    assert node.tick(20.0 + wait - 0.01) == []
    assert [t for t, m in node.tick(20.0 + wait) if isinstance(m, PingReq)]
    node.tick(20.0 + wait + 1.5)
    assert node.state_of(2) == SUSPECT and node.counters["suspected"] == 1
    # A direct ack that cannot come is not waited for: with no connection to the slow member, or once it
    # drops, its helpers are asked at the ack timeout, as for any member.
    node.receive(30.0, Ping(2, 1, 0))  # (it lives: refuted, alive again)
    node.receive(30.0, Ack(2, 99, (Alive(2, 1),)))
    assert node.state_of(2) == ALIVE and node._answer_wait(2) > 2.0
    connected = {1, 2, 3, 4}
    node.can_probe = lambda pid: pid in connected
    connected.discard(2)
    wait = node._answer_wait(2, 40.0)
    node.probe(2, 40.0)
    assert [t for t, m in node.tick(40.5) if isinstance(m, PingReq)]
    # Its helpers' acks are waited for as long as its own answers take: they relay its answers to their
    # pings (at a 64-daemon join a newcomer whose connection to the slow bootstrap node had dropped gave its
    # helpers 1.5 s, and turned it suspect).
    deadline = 40.0 + node.config.probe_timeout_s + wait - node.config.ack_timeout_s
    node.tick(deadline - 0.01)
    assert node.state_of(2) == ALIVE
    node.tick(deadline)
    assert node.state_of(2) == SUSPECT
    node.receive(deadline, Ping(2, 2, 0))  # (it lives: refuted, alive again)
    node.receive(deadline, Ack(2, 98, (Alive(2, 2),)))
    assert node.state_of(2) == ALIVE
    assert node._answer_wait(3) > 2.0  # (while every answer came late, member 3's is waited for too)
    node.probe(3, 45.0)
    assert node.tick(45.5) == []  # connected: its ack is waited for
    connected.discard(3)  # and then its connection drops
    assert [t for t, m in node.tick(45.6) if isinstance(m, PingReq)]
    node.tick(48.0)  # (its helpers silent: suspect, as before)
    # Quick answers bring the wait back to the configured timeouts: the member is no longer held slow.
    node.can_probe = None
    for i in range(40):
        _, ping = _probe_of(node.probe(2, 100.0 + i))
        node.receive(100.0 + i + 0.01, Ack(2, ping.seq, ()))
    assert node._answer_wait(2) == 0.0 and 2 not in node._slow


def test_a_wait_is_counted_stretched_only_where_the_estimate_outlasts_local_health_and_relays_wait_alike() -> None:
    """``swim.waits_stretched`` counted every ping whose estimate passed the ack timeout, also where local
    health's stretch was already longer (the wait no longer in fact); and a relayed ping added the whole
    estimate to the probe timeout where a probe takes the larger of the estimate and the ack timeout."""
    node = _node(period_s=1000.0, pushpull_s=1000.0)
    _, ping = _probe_of(node.probe(2, 1.0))
    node.receive(1.6, Ack(2, ping.seq, ()))  # 0.6 s: the estimate is 0.6 + 4 * 0.3 = 1.8 s
    assert math.isclose(node._answer_wait(2), 1.8) and node.counters["waits_stretched"] == 0
    node.local_health = 3  # its own timeouts x 4: the direct ack waited for 2 s, longer than the estimate
    _, ping = _probe_of(node.probe(2, 10.0))
    assert node.counters["waits_stretched"] == 0
    node.receive(10.1, Ack(2, ping.seq, ()))
    node.local_health = 0  # the estimate wins: counted
    _, ping = _probe_of(node.probe(2, 20.0))
    assert node.counters["waits_stretched"] == 1
    node.receive(20.1, Ack(2, ping.seq, ()))
    # A relayed ping of 2 (for member 3) is kept the probe timeout plus what the estimate adds past the ack
    # timeout, as the probe's own stages are, for a late ack to be forwarded.
    wait = node._answer_wait(2)
    node.heard_since = None
    (target, relayed), = node.receive(30.0, PingReq(3, 7, 2))
    assert target == 2 and node.counters["waits_stretched"] == 2
    deadline = 30.0 + node.config.probe_timeout_s + wait - node.config.ack_timeout_s
    node.tick(deadline - 0.01)
    assert node.receive(deadline - 0.01, Ack(2, relayed.seq, ())) == [(3, Ack(0, 7, ()))]
    deadline = 40.0 + node.config.probe_timeout_s + node._answer_wait(2) - node.config.ack_timeout_s
    (target, relayed), = node.receive(40.0, PingReq(3, 8, 2))
    node.tick(deadline)  # (that late ack made the estimate longer: the deadline is taken anew)
    assert node.receive(deadline + 0.01, Ack(2, relayed.seq, ())) == []


def test_an_answer_after_the_probe_gave_up_still_times_the_member_and_the_wait_is_capped() -> None:
    node = _node(period_s=1000.0)
    _, ping = _probe_of(node.probe(2, 1.0))
    node.tick(1.6)
    node.tick(3.1)
    assert node.state_of(2) == SUSPECT
    node.receive(31.0, Ack(2, ping.seq, ()))  # 30 s after the ping: the probe ended long ago
    assert node._answer_wait(2) == node.config.max_answer_wait_s == 8.0
    # Only the member asked times itself: an ack of the same seq from another member (a helper, a forger)
    # times nobody.
    _, ping = _probe_of(node.probe(3, 40.0))
    node.receive(42.0, Ack(4, ping.seq, ()))
    assert 3 not in node._slow and 4 not in node._slow


def test_a_seed_that_answered_a_joiners_page_late_is_waited_for_at_the_joiners_first_probe() -> None:
    """A joiner's first probe of its seed has no ack to go by, but its page request does: the seed's answer
    (a page, or "busy") times it. At the 64-daemon join the seed answered its joiners late while they came."""
    joiner = Membership(0, 0.0, random.Random(0), MembershipConfig(period_s=1000.0))
    (seed, request), = joiner.join(1, 0.0)
    assert seed == 1 and isinstance(request, SyncRequest)
    joiner.receive(2.0, SyncReply(1, request.seq, 0, (), None, busy=True))  # 2 s after the request
    _, ping = _probe_of(joiner.probe(1, 3.0))
    assert math.isclose(joiner._probes[ping.seq].deadline_direct, 3.0 + 2.0 + 4 * 1.0)


def test_a_member_with_a_request_still_unanswered_is_waited_for_at_least_as_long_as_that_request_waited() -> None:
    """At a 64-daemon join the bootstrap node slowed down as the newcomers came: a newcomer whose estimate
    of it was quick (one answer, in time) pinged it with the usual 2 s, while its page request of 5 s
    before was still unanswered; the ping failed, the seed turned suspect, and its page and its ack came
    4 to 8 s after they went. A request still pending is what the member's answers take now, at least."""
    joiner = Membership(0, 0.0, random.Random(0), MembershipConfig(period_s=1000.0, pushpull_s=1000.0))
    joiner.preload([1, 2, 3], 0.0)
    _, ping = _probe_of(joiner.probe(1, 0.5))
    joiner.receive(0.6, Ack(1, ping.seq, ()))  # quick: no estimate stretches anything
    assert joiner._answer_wait(1, 1.0) == 0.0
    joiner._seq += 1  # a page request to the seed at 1.0 (as join() asks it), never answered in this test
    joiner._ask(joiner._seq, 1, 1.0)
    _, ping = _probe_of(joiner.probe(1, 6.0))  # it has waited 5 s: three times that, at most 8 s
    assert joiner._answer_wait(1, 6.0) == joiner.config.max_answer_wait_s
    assert joiner.tick(6.6) == [] and joiner.tick(13.9) == []  # (before: helpers asked at 6.5, suspect at 8)
    joiner.receive(13.5, Ack(1, ping.seq, ()))  # 7.5 s late, in time now
    assert joiner.state_of(1) == ALIVE and joiner.counters["suspected"] == 0
    # That answer came after the page request went: the request was lost (a member answers in order), so it
    # stretches nothing any more; nor does a ping that could not go, nor a request older than the horizon.
    assert joiner._pending_since(1, 14.0) is None
    joiner.can_probe = lambda pid: pid != 2
    joiner.probe(2, 20.0)  # (no connection: the ping cannot go)
    assert joiner._pending_since(2, 21.0) is None
    joiner.can_probe = None
    joiner.tick(25.0)
    joiner.receive(25.0, Ping(2, 1, 0))  # (it lives)
    _, ping = _probe_of(joiner.probe(3, 30.0))  # never answered
    assert joiner._pending_since(3, 35.0) == 30.0
    horizon = joiner.config.max_answer_wait_s + joiner.config.probe_timeout_s
    assert joiner._pending_since(3, 30.0 + horizon + 0.1) is None


def test_the_answer_times_kept_are_bounded() -> None:
    node = _node(members=2, max_slow_members=8)
    node.preload(range(2, 300), 0.0)
    for pid in range(2, 300):  # 298 members, each answering 3 s late
        _, ping = _probe_of(node.probe(pid, float(pid)))
        node.receive(pid + 3.0, Ack(pid, ping.seq, ()))
    assert len(node._slow) == 8 and node.counters["slow_members_forgotten"] == 298 - 8
    assert sorted(node._slow) == list(range(292, 300))  # the latest timed
    for pid in range(2, 300):  # pings nobody answers: only the latest are remembered
        node.probe(pid, 1000.0)
    assert len(node._asked) == 64
    node.tick(1010.0)
    node.tick(1020.0)  # every probe over; the dead are forgotten with their times
    assert len(node._asked) == 64


def test_a_member_never_timed_is_waited_for_as_long_as_the_swarms_answers_take_now() -> None:
    """At a 64-daemon join every member's answers came 1.5 to 6 s late while the machine was saturated, and
    a prober's first ping of a member it had never timed was suspected as often as the bootstrap node. The
    estimate over every answer stretches the wait for everyone while answers are slow, and quick answers
    bring it back."""
    node = _node(members=8, period_s=1000.0, pushpull_s=1000.0)
    for pid in (1, 2, 3):  # three members answer 2 s late
        _, ping = _probe_of(node.probe(pid, 10.0 * pid))
        node.tick(10.0 * pid + 0.6)
        node.receive(10.0 * pid + 2.0, Ack(pid, ping.seq, ()))
    _, ping = _probe_of(node.probe(5, 40.0))  # never timed
    assert node.tick(40.6) == [] and node.tick(42.1) == []  # before: helpers at 40.5, suspect at 42.0
    node.receive(42.5, Ack(5, ping.seq, ()))
    assert node.state_of(5) == ALIVE and node.counters["suspected"] == 0
    for i in range(40):  # answers quick again: the configured timeouts hold for a member not held slow
        _, ping = _probe_of(node.probe(6, 100.0 + i))
        node.receive(100.0 + i + 0.01, Ack(6, ping.seq, ()))
    _, ping = _probe_of(node.probe(7, 200.0))
    assert [t for t, m in node.tick(200.5) if isinstance(m, PingReq)]
