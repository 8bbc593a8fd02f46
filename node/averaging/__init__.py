"""node.averaging: the daemon's side of an outer step, and how a trainer catches up (no torch).

    averager.py            Averager: the round state machine (pair and average, or step solo), admission
                           (per-IP caps, bans, the link table), group arithmetic, the outer-step counter
    pairing.py             schedule, scheduled_partners: who averages with whom at each outer step, from each
                           node's own member list (local: views a few members apart still agree); agreement
    partner_misses.py      PartnerMisses: trainers that miss round after round stop counting as partners
    robust.py              UpdateBound: how far one partner's values may move us
    compression_choice.py  choose_compression: `sync.compression = auto`'s preset for each exchange
    latejoin.py            CatchUp, late_join: a trainer takes the swarm's weights instead of its own

Imports the bridge (the exchange it serves, the checkpoint file it writes a snapshot to), the config and the
status contract; never node.swarm (the daemon hands the averager the swarm's answers) nor node.worker.
"""
