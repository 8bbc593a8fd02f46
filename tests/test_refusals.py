"""node.ops.refusals: every limit's refusals summed into `status`'s one `refusals` section."""

from __future__ import annotations

from typing import get_type_hints

from node.ops.refusals import KINDS, collect
from node.status_schema import RefusalsStatus
from tests.test_status_schema import schema_errors

STATE, SNAPSHOT, DIALBACK = "/starling/state/1.0.0", "/starling/snapshot/1.0.0", "/starling/dialback/1.0.0"
SUBNET_KINDS = {STATE: "state_sessions_subnet_share", SNAPSHOT: "snapshot_downloads_subnet_share",
                DIALBACK: "dialbacks_subnet_share"}  # fmt: skip


def test_every_kind_has_words_for_the_view_and_a_key_in_the_schema() -> None:
    assert list(KINDS) == list(get_type_hints(RefusalsStatus))


def test_collect_reads_each_limits_own_counter() -> None:
    refusals = collect(
        connections={"target": 8, "cap": 32, "connected": 3, "candidates": 5, "dialing": 0, "backing_off": 0,
                     "max_per_subnet": 16, "subnet_pruned": 2, "cap_pruned": 1},
        muxer={"window_overruns": 4, "dropped_bytes": 9_000_000, "offenders": 1},
        authorization={"swarm_key": True, "allowlist": 2, "refused_handshakes": 5, "refused_peers": 6},
        stream_limits={"per_subnet": {STATE: 4}, "refused": {STATE: 7, DIALBACK: 1, "/other/1.0.0": 100}},
        replication={"busy_refusals": 15, "peer_share_refusals": 12},  # the rest of the section is not read
        averaging_rejections={"too_many_requests": 1, "too_many_requests_from_ip": 3, "banned_ip": 2,
                              "phi_distance": 50},  # a refused update, not a refused request
        snapshot_busy=8,
        subnet_kinds=SUBNET_KINDS,
        clock_capped=9,
    )  # fmt: skip
    assert schema_errors(refusals, RefusalsStatus) == []
    assert refusals == {
        "connections_over_cap": 1, "connections_subnet_cap": 2, "connections_window_overrun": 4,
        "handshakes_refused": 5, "peers_not_allowed": 6,
        "state_sessions_busy": 3, "state_sessions_peer_share": 12, "state_sessions_subnet_share": 7,
        "snapshot_downloads_busy": 8, "snapshot_downloads_subnet_share": 0, "dialbacks_subnet_share": 1,
        "averaging_requests_busy": 1, "averaging_requests_per_ip": 3, "averaging_requests_banned_ip": 2,
        "clocks_capped": 9,
    }  # fmt: skip
