"""node.ops.status_view: the readable `starling status`, rendered from the `--json` dict."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from node.ops.status_view import render_status, short

CAPTURED = Path(__file__).parent / "data" / "status_three_trainers.json"


def captured() -> dict[str, Any]:
    """`status --json` of a real three-trainer TINY swarm after ~45 s (starling_testing/daemon.py TINY)."""
    return json.loads(CAPTURED.read_text())


def line(text: str, prefix: str) -> str:
    [found] = [x for x in text.splitlines() if x.startswith(prefix)]
    return found


def test_mixing_line_shows_averaged_share_solo_share_and_partners_most_frequent_first() -> None:
    st = captured()
    st["sync"]["mixing"] = {
        "window": 20, "outer_steps": 20, "averaged": 17, "solo": 3, "solo_share": 0.15, "scheduled": 15,
        "partners": {"12D3KooWBbbbbbbbbbbbbbbbbbbbb": 5, "12D3KooWAaaaaaaaaaaaaaaaaaaaa": 6, "12D3KooWC": 6},
        "distinct_partners": 3,
    }  # fmt: skip
    mixing = line(render_status(st), "mixing:")
    assert mixing.startswith("mixing: 17 of the last 20 outer steps averaged (15% solo) with 3 partners: ")
    assert "12D3Ko..aaaaaa x6, 12D3KooWC x6, 12D3Ko..bbbbbb x5" in mixing
    assert mixing.endswith("; 15 with the scheduled partner")


def test_mixing_line_of_a_captured_swarm_names_both_partners() -> None:
    st = captured()
    text = render_status(st)
    for partner in st["sync"]["mixing"]["partners"]:
        assert short(partner) in line(text, "mixing:")
    assert "partners since start" in line(text, "sync:")


def test_mixing_line_before_any_outer_step_and_when_all_steps_were_solo() -> None:
    st = captured()
    st["sync"]["mixing"] = {"window": 20, "outer_steps": 0, "averaged": 0, "solo": 0, "solo_share": None,
                            "scheduled": 0, "partners": {}, "distinct_partners": 0}  # fmt: skip
    assert line(render_status(st), "mixing:") == "mixing: no outer steps yet"
    st["sync"]["mixing"].update(outer_steps=12, solo=12, solo_share=1.0)
    assert line(render_status(st), "mixing:") == "mixing: 0 of the last 12 outer steps averaged (100% solo), no partner"


def test_many_partners_are_cut_to_four_and_counted() -> None:
    st = captured()
    st["sync"]["mixing"]["partners"] = {f"peer{i}": 1 for i in range(6)}
    assert line(render_status(st), "mixing:").endswith("peer3 x1, 2 more; 11 with the scheduled partner")


def test_pace_line_shows_the_swarm_period_and_the_last_inner_steps() -> None:
    st = captured()
    st["training"].update(period_s=1.84, last_inner_steps=14)
    assert line(render_status(st), "pace:") == "pace: an outer step every 1.8 s, 14 inner steps in the last"
    st["training"].update(period_s=0.041, last_inner_steps=2)
    assert line(render_status(st), "pace:") == "pace: an outer step every 41 ms, 2 inner steps in the last"
    st["training"].update(period_s=None, last_inner_steps=5)
    assert "every train.inner_steps inner steps of this machine, 5 inner" in line(render_status(st), "pace:")


def test_members_table_counts_partners_for_trainers_and_leaves_others_blank() -> None:
    st = captured()
    relay = {**copy.deepcopy(st["members"][0]), "peer_id": "12D3KooWRelayRelayRelayRelay", "role": "network-only",
             "partners": [], "self": False}  # fmt: skip
    st["members"].append(relay)
    text = render_status(st)
    header = line(text, "  member")
    assert "partners" in header.split() and "outer" in header.split()
    column = header.index("partners")
    trainer_row = line(text, "  " + short(st["members"][0]["peer_id"]))
    assert trainer_row[column:].split()[0] == "2"
    relay_row = line(text, "  " + short(relay["peer_id"]))
    assert relay_row[column : column + len("partners")].strip() == ""
    # Nor steps, loss or speed: `make run`'s network-only bootstrap node read "0 0 - 0.0", a stuck trainer.
    step = header.index("step")
    assert relay_row[step:column].split() == [] and trainer_row[step:column].split()


def test_pairing_graph_line_says_one_island_or_names_the_islands() -> None:
    st = captured()
    assert line(render_status(st), "pairing graph:") == "pairing graph: one island of 3 trainers"
    a, b, c = (m["peer_id"] for m in st["members"])
    st["members"][0]["partners"], st["members"][1]["partners"] = [b], [a]
    st["members"][2]["partners"] = []
    assert line(render_status(st), "pairing graph:") == "pairing graph: one island of 2 trainers, 1 unpaired"
    st["members"].append({**st["members"][2], "peer_id": "12D3KooWDdddddddddddddddddddd", "partners": [c],
                          "self": False})  # fmt: skip
    split = line(render_status(st), "pairing graph:")
    assert split.startswith("pairing graph: 2 islands (see starling doctor): {")
    assert short(c) in split and short(a) in split


def test_a_lone_alive_trainer_is_not_reported_as_an_unpaired_failure() -> None:
    """Issue #27: after the partner left (8 pairs), `pairing graph: no pairs yet, 1 unpaired`."""
    st = captured()
    a, b, _ = (m["peer_id"] for m in st["members"])
    st["members"] = st["members"][:2]
    st["members"][0]["partners"], st["members"][1]["partners"] = [b], [a]
    st["members"][1]["state"] = "left"
    assert line(render_status(st), "pairing graph:") == "pairing graph: one alive trainer, nobody to pair with"


def test_an_old_daemon_without_mixing_pace_or_partners_still_renders() -> None:
    st = captured()
    del st["sync"]["mixing"]
    for key in ("period_s", "last_inner_steps"):
        del st["training"][key]
    for m in st["members"]:
        del m["partners"]
    text = render_status(st)
    assert "mixing:" not in text and "pace:" not in text
    assert "pairing graph: no pairs in the alive trainers' recent outer steps, 3 unpaired" in text


def test_bounds_line_appears_once_a_partner_was_clipped_refused_or_banned() -> None:
    st = captured()
    assert not any(x.startswith("bounds:") for x in render_status(st).splitlines())
    st["sync"].update(clipped={"delta": 4, "phi": 1}, rejections={"phi_distance": 3}, banned=["12D3KooWAttacker99"])
    text = line(render_status(st), "bounds:")
    assert "clipped 4 Delta / 1 phi" in text and "refused 3 (phi_distance 3)" in text
    assert short("12D3KooWAttacker99") in text


def test_a_running_transfer_shows_how_much_has_moved_and_how_fast() -> None:
    st = captured()
    st["sync"].update(state="exchanging", transfer={"partner": "12D3KooWAaaaaaaaaaaaaaaaaaaaa", "bytes": 12_400_000,
                                                    "seconds": 95.2, "rate_mbps": 0.41})
    assert line(render_status(st), "  exchanging with") == (
        "  exchanging with 12D3Ko..aaaaaa: 12.4 MB in 95s at 0.41 Mbit/s each way")


def test_refused_line_sums_every_limits_refusals_by_kind_largest_first() -> None:
    st = captured()
    st["refusals"] = {"connections_window_overrun": 1, "state_sessions_peer_share": 12,
                      "averaging_requests_per_ip": 3, "snapshot_downloads_busy": 0}  # fmt: skip
    assert line(render_status(st), "refused:") == (
        "refused: 12 state sessions (peer share), 3 averaging requests (per-IP), 1 connection closed (window overrun)")


def test_refused_line_before_anything_was_refused_and_from_an_older_or_newer_daemon() -> None:
    st = captured()
    st["refusals"] = {"connections_over_cap": 0, "dialbacks_subnet_share": 0}
    assert line(render_status(st), "refused:") == "refused: nothing"
    st["refusals"] = {"dialbacks_subnet_share": 2, "some_new_limit": 2}  # a key this version does not know
    assert line(render_status(st), "refused:") == "refused: 2 dial-backs (subnet share), 2 some_new_limit"
    del st["refusals"]
    assert not any(x.startswith("refused:") for x in render_status(st).splitlines())


def test_sync_line_shows_auto_with_the_last_exchanges_preset_and_its_bytes_per_parameter() -> None:
    """`sync.compression = auto` picks a preset per exchange: the line says the setting and what the last
    exchange used, with its bytes per parameter; a fixed preset shows as before, and `none` not at all."""
    st = captured()
    st["sync"].update(compression="auto", last_compression="medium", last_bytes_per_param=0.4392)
    assert ", compression auto (last medium), 0.439 B/param" in line(render_status(st), "sync:")
    st["sync"].update(last_compression=None, last_bytes_per_param=None)  # before the first exchange
    assert line(render_status(st), "sync:").endswith(", compression auto")
    st["sync"].update(compression="high", last_compression="high")
    assert ", compression high" in line(render_status(st), "sync:") and "(last" not in line(render_status(st), "sync:")
    st["sync"].update(compression="none", last_compression="none", last_bytes_per_param=4.0)
    assert "compression" not in line(render_status(st), "sync:")


def test_refused_line_counts_records_whose_clock_was_too_far_ahead_to_follow() -> None:
    st = captured()
    st["refusals"] = {"clocks_capped": 2, "averaging_requests_busy": 1}
    assert line(render_status(st), "refused:") == (
        "refused: 2 records' clocks not followed (over 5 s ahead), 1 averaging request (all busy)")
    st["refusals"] = {"clocks_capped": 1}
    assert line(render_status(st), "refused:") == "refused: 1 record's clock not followed (over 5 s ahead)"


def test_sitting_out_line_names_the_partners_with_the_most_time_left_first_and_counts_the_rest() -> None:
    st = captured()
    assert not any(x.startswith("sitting out:") for x in render_status(st).splitlines())  # an older daemon
    st["sync"]["sitting_out"] = {"count": 0, "exclusions": 3, "peers": {}}
    assert not any(x.startswith("sitting out:") for x in render_status(st).splitlines())  # none now
    peers = {f"12D3KooWFake{i}xxxxxxxxxxxxxx{i}": float(10 * i) + 0.4 for i in range(1, 6)}
    st["sync"]["sitting_out"] = {"count": 7, "exclusions": 9, "peers": peers}  # 2 more than named
    assert line(render_status(st), "sitting out:") == (
        "sitting out: 7 partners after missed averaging rounds (seconds left): "
        + ", ".join(f"{short(f'12D3KooWFake{i}xxxxxxxxxxxxxx{i}')} {10 * i}s" for i in (5, 4, 3, 2))
        + ", 3 more")
    st["sync"]["sitting_out"] = {"count": 1, "exclusions": 1, "peers": {"12D3KooWFake1xxxxxxxxxxxxxx1": 29.6}}
    assert line(render_status(st), "sitting out:") == (
        "sitting out: 1 partner after missed averaging rounds (seconds left): 12D3Ko..xxxxx1 30s")


def test_every_possible_partner_beyond_the_step_gap_is_said_as_not_averaging() -> None:
    """Issue #27, `kill -9` of a worker: restarted from an older checkpoint, the node was too far from its
    partner for either to even ask the other (no refusal to show), and status said nothing but its old
    "one island of 2 trainers"."""
    st = captured()
    assert "not averaging" not in render_status(st)
    reach = {"trainers": 1, "nearest_steps": 9, "behind": True, "catches_up": True, "catch_up_off": False,
             "max_step_gap": 2}
    st["sync"]["out_of_reach"] = reach
    st["sync"]["catch_up"] = {"state": "downloading"}
    assert line(render_status(st), "not averaging:") == (
        "not averaging: the other trainer of this run is 9 outer steps away (sync.max_step_gap 2); this node is "
        "behind: it catches up from the swarm (catch-up: downloading)")
    st["sync"]["out_of_reach"] = {**reach, "trainers": 3, "nearest_steps": 6, "behind": False, "catches_up": False,
                                  "max_step_gap": 4}
    assert line(render_status(st), "not averaging:") == (
        "not averaging: all 3 other trainers of this run are at least 6 outer steps away (sync.max_step_gap 4); "
        "this node is ahead: the others catch up with it")
    st["sync"]["out_of_reach"] = {**reach, "behind": False}  # a runaway: ahead, and off the swarm's position
    assert line(render_status(st), "not averaging:").endswith("this node is ahead: it catches up from the swarm "
                                                             "(catch-up: downloading)")
    st["sync"]["out_of_reach"] = {**reach, "catch_up_off": True}
    assert line(render_status(st), "not averaging:").endswith("this node is behind, and sync.catch_up_after = 0: "
                                                             "nobody catches up")
    st["sync"]["out_of_reach"] = None
    assert "not averaging" not in render_status(st)


# ---------------------------------------------------------------------------------------------------------
# hundreds of members: a summary, the rows that matter, and `--json` complete (issue #24)
# ---------------------------------------------------------------------------------------------------------


def big_swarm(n: int = 500) -> dict[str, Any]:
    """The captured status grown to `n` members: every 100th (from the 7th) suspect, every 50th (from the
    3rd) gone, every 10th network-only; alive trainers at outer steps 300..349, one laggard at 120 and one
    runner at 900; this node's two real partners last heard longest ago, so only their role shows them."""
    st = captured()
    me, a, b = st["members"]
    a["last_seen_s"] = b["last_seen_s"] = 999.0
    members = [me, a, b]
    for i in range(n - 3):
        m = {**copy.deepcopy(b), "peer_id": f"12D3KooWSynth{i:06d}", "self": False, "outer_step": 300 + i % 50,
             "last_seen_s": float(i % 97), "partners": [f"12D3KooWSynth{(i + 1) % (n - 3):06d}"],
             "state": "suspect" if i % 100 == 7 else "gone" if i % 50 == 3 else "alive",
             "role": "network-only" if i % 10 == 9 else "trainer"}  # fmt: skip
        members.append(m)
    members[n // 3]["outer_step"], members[n // 2]["outer_step"] = 120, 900
    st["members"] = members
    return st


def member_rows(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.startswith("  12D3Ko")]


def test_a_small_swarm_renders_in_full_whatever_the_limit_allows() -> None:
    st = captured()
    assert render_status(st) == render_status(st, rows=None) == render_status(st, rows=3)
    assert "members: 3" in render_status(st).splitlines()


def test_five_hundred_members_print_a_summary_and_at_most_the_limit_of_rows() -> None:
    st = big_swarm()
    text = render_status(st)
    small = render_status(captured())
    # The member table (3 rows in `small`) grows to 20 rows, a summary line, a spread line and a "more" line.
    assert len(text.splitlines()) <= len(small.splitlines()) + 20 + 3
    assert line(text, "members:") == (
        "members: 500 (485 alive, 5 suspect, 10 gone; 451 trainers, 49 network-only)")
    assert line(text, "  alive trainers:").startswith("  alive trainers: outer steps 120..900 (median ")
    rows = [x for x in text.splitlines() if x.startswith("  12D3Ko") and "ago" in x]
    assert len(rows) == 20
    assert line(text, "  ... and") == "  ... and 480 more (starling status --all, or --json)"


def test_the_cut_table_keeps_this_node_its_partners_suspects_and_the_extreme_trainers() -> None:
    st = big_swarm()
    text = render_status(st)
    shown = {x.split()[0]: x.split()[-1] if "recently" not in x else "recently heard" for x in member_rows(text)}
    me, a, b = (short(m["peer_id"]) for m in st["members"][:3])
    assert shown[me] == "node" and shown[a] == shown[b] == "partner"  # "this node"'s last word
    suspects = [short(m["peer_id"]) for m in st["members"] if m["state"] == "suspect"]
    assert len(suspects) == 5 and all(shown.get(s) == "suspect" for s in suspects)
    assert shown[short(st["members"][500 // 3]["peer_id"])] == "behind"
    assert shown[short(st["members"][500 // 2]["peer_id"])] == "ahead"


def test_a_flood_of_suspects_does_not_push_the_partners_out() -> None:
    st = big_swarm()
    for m in st["members"][3:]:
        m["state"] = "suspect"  # a partition: 497 suspects
    text = render_status(st, rows=10)
    names = [x.split()[0] for x in member_rows(text) if "ago" in x]
    assert len(names) == 10
    assert {short(m["peer_id"]) for m in st["members"][:3]} <= set(names)
    assert "497 suspect" in line(text, "members:")


def test_the_limit_is_an_option_and_none_shows_every_member() -> None:
    st = big_swarm()
    assert len([x for x in member_rows(render_status(st, rows=5)) if "ago" in x]) == 5
    every = render_status(st, rows=None)
    assert len([x for x in member_rows(every) if "ago" in x]) == 500 and "... and" not in every
    assert "members: 500" in every.splitlines()


def test_many_connections_are_summarised_by_path_with_partners_and_relayed_ones_first() -> None:
    st = captured()
    a, b = st["connected_peers"]
    others = [f"12D3KooWConn{i:06d}" for i in range(40)]
    st["connected_peers"] = [*others, a, b]
    st["peers"] += [{"peer_id": p, "path": "relayed" if i == 33 else "direct", "rtt_ms": 5.0}
                    for i, p in enumerate(others)]  # fmt: skip
    text = render_status(st)
    assert line(text, "  paths:") == "  paths: 41 direct, 1 relayed"
    start = text.splitlines().index(line(text, "  peer "))
    rows = text.splitlines()[start + 1 : start + 21]
    assert [r.split()[0] for r in rows[:3]] == [short(a), short(b), short(others[33])]  # a: the last partner, and most often
    assert text.splitlines()[start + 21] == "  ... and 22 more (starling status --all, or --json)"


def test_a_shattered_pairing_graph_names_a_few_islands_when_the_table_is_cut() -> None:
    st = big_swarm(200)
    trainers = [m for m in st["members"] if m["role"] == "trainer" and m["state"] == "alive"]
    for i, m in enumerate(trainers):
        m["partners"] = [trainers[i ^ 1]["peer_id"]] if i ^ 1 < len(trainers) else []
    graph = line(render_status(st), "pairing graph:")
    assert graph.count("{") == 4 and " more" in graph and len(graph) < 400


def test_status_json_is_never_cut(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    import node.ops.control
    from node.cli import main

    st = big_swarm()
    monkeypatch.setattr(node.ops.control, "request_sync", lambda *_a, **_k: {"ok": True, "status": st})
    assert main(["status", "--home", str(tmp_path), "--json", "--members", "5"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert len(printed["members"]) == 500 and printed["members"] == st["members"]
    assert main(["status", "--home", str(tmp_path), "--members", "5"]) == 0
    assert len([x for x in member_rows(capsys.readouterr().out) if "ago" in x]) == 5
    assert main(["status", "--home", str(tmp_path), "--all"]) == 0
    assert len([x for x in member_rows(capsys.readouterr().out) if "ago" in x]) == 500


def test_a_limit_below_one_row_is_a_one_line_usage_error(tmp_path: Path, capsys: Any) -> None:
    from node.cli import main

    assert main(["status", "--home", str(tmp_path), "--members", "0"]) == 2
    err = capsys.readouterr().err
    assert err.strip().endswith("--members: at least 1 row; got 0 (--all shows every member)")
    assert "Traceback" not in err


def test_a_donor_says_what_it_served_joiners_and_what_it_cost_its_own_outer_steps() -> None:
    st = captured()
    st["join"] = {"state": "not needed", "serving": 1, "served": 3, "served_live": 2, "results_held_s": 1.25,
                  "live_cut": 1}
    assert line(render_status(st), "donor:") == (
        "donor: served 3 snapshot download(s), 2 of live weights; serving 1 now; outer results held 1.2s for them; "
        "1 cut (the weights changed first; those joiners get a checkpoint next)")
    st["join"] = {"state": "not needed", "serving": 0, "served": 0}
    assert not [x for x in render_status(st).splitlines() if x.startswith("donor:")]  # nothing served: no line
