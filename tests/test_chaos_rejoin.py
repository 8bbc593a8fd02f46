"""bench/chaos.py --wipe (issue #55): a killed trainer comes back with an empty HOME and must rejoin from the
swarm's weights; check (b) judges each rejoin by its late join and its outer steps before it averaged."""

from __future__ import annotations

from pathlib import Path

import bench.chaos as chaos


def test_wipe_is_a_flag_of_the_plan_and_the_issues_run_is_four_trainers_a_kill_a_minute_for_ten() -> None:
    plan, _ = chaos.parse_args(["--wipe", "--nodes", "4", "--interval", "60", "--minutes", "10"])
    assert plan.wipe and (plan.nodes, plan.interval, plan.seconds) == (4, 60, 600)
    assert not chaos.parse_args([])[0].wipe


def test_a_rejoin_passes_only_after_a_late_join_and_averaging_within_five_own_outer_steps(tmp_path: Path) -> None:
    run = chaos.ChaosRun(chaos.ChaosPlan(nodes=2, wipe=True), tmp_path)

    def kill(join: str | None, steps: int | None) -> chaos.Kill:
        return chaos.Kill(at_s=60, node="n0", pids=[1], disk_step=None, wiped=True, join=join,
                          steps_before_averaging=steps)

    run.kills = [kill("done", 0), kill("done", chaos.REJOIN_WITHIN)]
    assert run.rejoin_check().passed
    for bad in (kill("done", chaos.REJOIN_WITHIN + 1),  # averaged, but too late
                kill("no donors: starting a fresh model", 1),  # a fresh model, not the swarm's
                kill("done", None)):  # never averaged
        run.kills = [kill("done", 0), bad]
        check = run.rejoin_check()
        assert not check.passed and "1/2 rejoins" in check.figures
    run.kills = []
    assert not run.rejoin_check().passed  # a run with no kill proves nothing
