"""node.averaging: the daemon's side of an outer step, and how a trainer catches up (no torch).

    averager.py            Averager: runs the rounds (pair and average, or step solo; answer partners)
    round.py               Round, RoundState: one published outer step's round, its explicit state and its partner
    admission.py           Admission: whom it listens to and asks (the link table, per-IP caps, bans, back-offs)
    report.py              Report: its counters, mixing window and refusals for status and the log
    phases.py              PhaseClock: where an asked exchange's time goes (open, answer, connect, transfer, result)
    swarm_view.py          SwarmView, AveragerHooks: what it asks of the rest of the node, and tells it
    group_mean.py          weighted_mean: a group of four's sample-weighted means from a pair's sums
    stepping.py            group_outer_step, follow_the_swarm, phase_shift: the counter and the phase after a round
    pairing.py             schedule, scheduled_partners: who averages with whom at each outer step, from each
                           node's own member list (local: views a few members apart still agree); agreement: how
                           many nodes' partners name them back
    partners.py            Partners: who could pair with us now, and the swarm's pace, from the member records
    partner_misses.py      PartnerMisses, Attempt: trainers that miss round after round stop counting as partners
    robust.py              UpdateBound: how far one partner's values may move us
    compression_choice.py  choose_compression: `sync.compression = auto`'s preset for each exchange
    link_model.py          bandwidth_s: a transfer's time less its round trips (RTT and slow start), for `auto`
    latejoin.py            CatchUp, late_join: a trainer takes the swarm's weights instead of its own

Imports the bridge (the exchange it serves, the checkpoint file it writes a snapshot to), the config and the
status contract; never node.swarm (the daemon answers the averager's `SwarmView`) nor node.worker.
"""
