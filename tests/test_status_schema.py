"""The status schema (node/status_schema.py) against a real training node's status, and its readers on it.

mypy (`make lint`) checks that the builders write what the schema says and that the readers read keys it
has; what it cannot see is the value that reaches a reader at run time (a section that is cast, an
integer where a float was promised, a key added without a word in the schema). So two trainers on
127.0.0.1 average a tiny model, and the status of one of them must match the schema key for key and
type for type, then go through metrics, doctor's status checks and the status view with no missing-key
fallback: every field a training node has ends up in a gauge, a verdict, sd_notify's line or a number on
the screen.
"""

from __future__ import annotations

import re
import types
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints, is_typeddict

import pytest

from node.ops import doctor_findings, doctor_status
from node.ops.metrics import Metrics
from node.ops.sdnotify import summarize_status
from node.ops.status_view import render_status
from node.status_schema import (
    ConnectionPath,
    MixingStatus,
    MuxerStatus,
    NodeStatus,
    RefusalsStatus,
    SittingOutStatus,
    SwarmTotals,
    SwimStatus,
    SyncStatus,
    TrainingStatus,
)
from starling_testing.daemon import TINY, DaemonGroup

# --- a checker of a JSON value against the schema's types ----------------------------------------------------


def schema_errors(value: Any, tp: Any, path: str = "status") -> list[str]:
    """Where `value` departs from `tp` (a TypedDict of the schema, or a type in one): [] when it matches.

    A TypedDict must have its required keys, no key it does not declare, and each value of its type."""
    if is_typeddict(tp):
        if not isinstance(value, dict):
            return [f"{path}: {type(value).__name__}, not an object"]
        hints = get_type_hints(tp)  # NotRequired stripped; tp.__required_keys__ says which are required
        errors = [f"{path}.{key}: missing" for key in sorted(tp.__required_keys__ - value.keys())]
        errors += [f"{path}.{key}: not in {tp.__name__}" for key in sorted(value.keys() - hints.keys())]
        for key in sorted(value.keys() & hints.keys()):
            errors += schema_errors(value[key], hints[key], f"{path}.{key}")
        return errors
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:  # a closed set of strings (e.g. a peer's path)
        return [] if value in args else [f"{path}: {value!r} is not one of {', '.join(map(repr, args))}"]
    if origin in (Union, types.UnionType):
        tried = [schema_errors(value, option, path) for option in args]
        return [] if any(not errors for errors in tried) else min(tried, key=len)
    if origin is list:
        if not isinstance(value, list):
            return [f"{path}: {value!r} is not a list"]
        return [e for i, item in enumerate(value) for e in schema_errors(item, args[0], f"{path}[{i}]")]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{path}: {value!r} is not an object"]
        return [e for k, v in value.items() for e in [*schema_errors(k, args[0], f"{path} key"),
                                                        *schema_errors(v, args[1], f"{path}[{k!r}]")]]
    if tp is type(None):
        return [] if value is None else [f"{path}: {value!r} is not null"]
    if tp is float:  # JSON has one number type: an integral float may come back as an int
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp in (str, bool):
        ok = isinstance(value, tp)
    else:
        raise TypeError(f"{path}: the checker does not know {tp!r}")
    return [] if ok else [f"{path}: {value!r} is not {tp.__name__}"]


def test_the_checker_finds_a_missing_key_an_unknown_key_and_a_mistyped_value() -> None:
    mixing: dict[str, Any] = {"window": 8, "outer_steps": 2, "averaged": 1, "solo": 1, "solo_share": 0.5,
                              "scheduled": 1, "partners": {"QmA": 1}, "distinct_partners": 1}
    assert schema_errors(mixing, MixingStatus) == []
    assert schema_errors({**mixing, "solo_share": None}, MixingStatus) == []
    del mixing["solo"]
    mixing["extra"] = 1
    mixing["partners"] = {"QmA": "one"}
    assert schema_errors(mixing, MixingStatus, "mixing") == [
        "mixing.solo: missing", "mixing.extra: not in MixingStatus", "mixing.partners['QmA']: 'one' is not int",
    ]
    assert schema_errors("direct", ConnectionPath) == []
    assert schema_errors("carrier pigeon", ConnectionPath, "path") == [
        "path: 'carrier pigeon' is not one of 'direct', 'hole-punched', 'relayed', 'none'"]


# --- metrics: every numeric field of these sections is exported, or deliberately not --------------------------

# (section, key) -> the metric family (without the `starling_` prefix) that carries its value.
EXPORTED: dict[tuple[str, str], str] = {
    ("", "uptime_s"): "uptime_seconds",
    ("training", "step"): "training_step",
    ("training", "outer_step"): "training_outer_step",
    ("training", "loss"): "training_loss",
    ("training", "val_loss"): "training_val_loss",
    ("training", "samples_per_s"): "training_samples_per_second",
    ("training", "period_s"): "training_pace_seconds",
    ("training", "last_inner_steps"): "training_last_inner_steps",
    ("training", "restarts"): "worker_restarts",
    ("training", "checkpoint_failures"): "training_checkpoint_failures",
    ("sync", "rounds"): "sync_rounds",
    ("sync", "solo_rounds"): "sync_solo_rounds",
    ("sync", "failures"): "sync_failures",
    ("sync", "distinct_partners"): "sync_distinct_partners",
    ("sync", "last_duration_s"): "sync_last_duration_seconds",
    ("sync", "last_bytes"): "sync_last_bytes",
    ("sync", "last_bytes_per_param"): "sync_last_bytes_per_param",
    ("sync", "bytes_sent"): "sync_sent_bytes",
    ("sync", "bytes_received"): "sync_received_bytes",
    ("mixing", "outer_steps"): "sync_recent_outer_steps",
    ("mixing", "solo_share"): "sync_recent_solo_share",
    ("mixing", "distinct_partners"): "sync_recent_distinct_partners",
    ("sitting_out", "count"): "sync_partners_sitting_out",
    ("sitting_out", "exclusions"): "sync_partner_exclusions",
    ("muxer", "window_overruns"): "muxer_window_overruns",
    ("muxer", "dropped_bytes"): "muxer_dropped_bytes",
    ("muxer", "offenders"): "muxer_offenders",
    ("swarm_totals", "clock_capped"): "swarm_clock_capped",
    ("swim", "probes"): "swim_probes",
    ("swim", "indirect_probes"): "swim_indirect_probes",
    ("swim", "acks"): "swim_acks",
    ("swim", "alive_by_traffic"): "swim_alive_by_traffic",
    ("swim", "waits_stretched"): "swim_waits_stretched",
    ("swim", "slow_members"): "swim_slow_members",
    ("swim", "answer_wait_s"): "swim_answer_wait_seconds",
    ("swim", "suspects_raised"): "swim_suspects_raised",
    ("swim", "suspects_seen"): "swim_suspects_seen",
    ("swim", "no_evidence"): "swim_probes_no_evidence",
    ("swim", "refutations"): "swim_refutations",
    ("swim", "declared_dead"): "swim_declared_dead",
    ("swim", "messages_sent"): "swim_messages_sent",
    ("swim", "messages_received"): "swim_messages_received",
    ("swim", "messages_dropped"): "swim_messages_dropped",
    ("swim", "bytes_sent"): "swim_sent_bytes",
    ("swim", "bytes_received"): "swim_received_bytes",
    ("swim", "names"): "swim_names",
    ("swim", "local_health"): "swim_local_health",
    ("swim", "loop_lag_max_s"): "swim_loop_lag_max_seconds",
}
# `refusals` is one family labelled by kind (starling_refusals_total), checked key by key below.
# Numeric fields left out of the metrics on purpose: identifiers, or what a dashboard gets elsewhere.
NOT_EXPORTED = {
    ("training", "pid"), ("training", "resumed_step"), ("training", "checkpoint_step"), ("training", "lr"),
    ("training", "last_group_size"), ("sync", "unpaired_rounds"), ("sync", "declined"), ("sync", "datapath_port"),
    ("sync", "catch_ups"), ("sync", "catch_up_follows"), ("sync", "fragments"), ("sync", "fragment"), ("mixing", "window"), ("mixing", "averaged"), ("mixing", "solo"), ("mixing", "scheduled"),
    ("swarm_totals", "samples"), ("swarm_totals", "tokens"), ("swarm_totals", "crowd_evictions"),
}  # fmt: skip
SECTIONS = {"": NodeStatus, "training": TrainingStatus, "sync": SyncStatus, "mixing": MixingStatus,
            "sitting_out": SittingOutStatus, "muxer": MuxerStatus, "swarm_totals": SwarmTotals, "swim": SwimStatus}


def _numeric(tp: Any) -> bool:
    """A number, or a number or null (not a collection of numbers)."""
    union = get_origin(tp) in (Union, types.UnionType)
    return tp in (int, float) or (union and any(a in (int, float) for a in get_args(tp)))


def test_every_numeric_field_of_the_schema_is_exported_or_listed_as_not() -> None:
    numeric = {(name, key) for name, td in SECTIONS.items() for key, tp in get_type_hints(td).items() if _numeric(tp)}
    assert numeric - EXPORTED.keys() - NOT_EXPORTED == set(), "a new status field: export it in node/ops/metrics.py"
    assert (EXPORTED.keys() | NOT_EXPORTED) - numeric == set(), "a field gone from the schema"


# --- a real training node ---------------------------------------------------------------------------------


def _averaged(s: dict[str, Any]) -> bool:
    """Averaged with its partner, and reports everything a trainer has once it did (the pair's records
    included: they name each other as partners)."""
    tr, sy = s.get("training") or {}, s.get("sync") or {}
    return (
        tr.get("state") == "training" and tr.get("loss") is not None and tr.get("val_loss") is not None
        and tr.get("period_s") is not None and sy.get("rounds", 0) >= 1
        and all(m.get("loss") is not None and m.get("partners") for m in s.get("members", []))
        and all(p.get("rtt_ms") is not None for p in s.get("peers", []))
    )


def test_a_network_only_nodes_status_matches_the_schema_and_says_what_it_refused(group: DaemonGroup) -> None:
    """The quick check of the same contract (one daemon, no training): every refusal kind is in `refusals`,
    and the readable status has its line."""
    relay = group.start("relay", "--no-train", "--listen", "/ip4/127.0.0.1/tcp/0")
    st = relay.wait_status(lambda s: bool(s.get("addrs")), timeout=60)
    assert schema_errors(st, NodeStatus) == []
    assert set(st["refusals"]) == set(get_type_hints(RefusalsStatus))
    assert "refused: nothing" in render_status(st).splitlines()
    families = _families(st)
    assert _refusal_samples(families) == st["refusals"]
    for name in ("muxer_window_overruns", "muxer_dropped_bytes", "muxer_offenders", "swarm_clock_capped"):
        assert families[name].samples[0].value == 0, name


def test_a_swim_nodes_status_has_the_swim_counters_in_the_schema_and_in_the_metrics(group: DaemonGroup) -> None:
    """node.membership = swim: ``swim`` (SWIM's counters) is in the status, typed as the schema says, and every
    numeric field of it is a metric with the status's value."""
    boot = group.start("a", "--no-train", "--listen", "/ip4/127.0.0.1/tcp/0", "--set", "node.membership=swim")
    group.start("b", "--no-train", "--listen", "/ip4/127.0.0.1/tcp/0", "--set", "node.membership=swim",
                "--bootstrap", boot.addr())
    st = boot.wait_status(lambda s: s.get("swim", {}).get("acks", 0) >= 2, timeout=60, interval=1)
    assert schema_errors(st, NodeStatus) == []
    swim = st["swim"]
    assert swim["probes"] >= swim["acks"] >= 2 and swim["messages_sent"] >= 2 and swim["bytes_received"] > 0
    assert swim["members"]["alive"] == 2 and swim["names"] == 2
    families = _families(st)
    for (section, key), name in EXPORTED.items():
        if section == "swim":
            assert families[name].samples[0].value == pytest.approx(swim[key]), name  # type: ignore[literal-required]


def _families(st: NodeStatus) -> dict[str, Any]:
    """The metric families Metrics exports for `st`, by name without the `starling_` prefix."""
    from prometheus_client.parser import text_string_to_metric_families

    metrics = Metrics()
    metrics.update_from_status(st)
    body, _ = metrics.render()
    return {f.name.removeprefix("starling_"): f for f in text_string_to_metric_families(body.decode())}


def _refusal_samples(families: dict[str, Any]) -> dict[str, int]:
    return {s.labels["kind"]: int(s.value) for s in families["refusals"].samples if s.name.endswith("_total")}


@pytest.fixture
def trained_status(group: DaemonGroup) -> NodeStatus:
    """The status of a trainer that has averaged with another one (two tiny daemons on 127.0.0.1)."""
    boot = group.start("n0", *TINY, "--swarm", "schema")
    group.start("n1", *TINY, "--swarm", "schema", "--bootstrap", boot.addr())
    return boot.wait_status(_averaged, timeout=90, interval=1)


@pytest.mark.slow
def test_a_training_nodes_status_matches_the_schema_and_feeds_every_reader(trained_status: NodeStatus) -> None:
    st = trained_status
    assert schema_errors(st, NodeStatus) == []
    assert {"training", "sync", "join"} <= st.keys()

    # metrics: a family for every exported field, with the status's value
    families = _families(st)
    sections: dict[str, Any] = {"": st, "training": st["training"], "sync": st["sync"],
                                "mixing": st["sync"]["mixing"], "sitting_out": st["sync"]["sitting_out"],
                                "muxer": st["muxer"], "swarm_totals": st["swarm_totals"], "swim": st.get("swim")}
    for (section, key), name in EXPORTED.items():
        if sections[section] is None:  # swim's counters: only in node.membership = swim
            assert not any(n.startswith(name) for n in families), f"{name} exported without its section"
            continue
        value = sections[section][key]
        if value is None:
            assert name not in families, f"{name} exported for a null {section}.{key}"
            continue
        assert name in families, f"{section}.{key} = {value!r} is not exported as starling_{name}"
        assert families[name].samples[0].value == pytest.approx(value), name
    labels = {name: families[name].samples[0].labels for name in ("node_info", "training_info", "sync_wire_dtype_info")}
    assert labels["node_info"] == {"peer_id": st["peer_id"], "swarm": st["swarm"], "version": st["version"]}
    assert labels["training_info"] == {"device": st["training"]["device"], "task": st["training"]["task"]}
    assert labels["sync_wire_dtype_info"] == {"dtype": st["sync"]["wire_dtype"]}
    assert families["connected_peers"].samples[0].value == len(st["connected_peers"]) == 1
    assert [s.labels["state"] for s in families["reachability"].samples] == [st["reachability"]]
    by_path = {s.labels["path"]: s.value for s in families["connections"].samples}
    assert sum(by_path.values()) == len(st["peers"])
    alive = {s.labels["state"]: s.value for s in families["members"].samples}["alive"]
    assert alive == sum(m["state"] == "alive" for m in st["members"]) == 2
    sent = {s.labels["peer_id"] for s in families["sync_peer_sent_bytes"].samples}
    assert sent == set(st["sync"]["per_peer"]) and sent
    assert {s.labels["peer_id"] for s in families["peer_rtt_seconds"].samples} == {p["peer_id"] for p in st["peers"]}
    assert families["swarm_pairing_islands"].samples[0].value == 1
    assert families["swarm_unpaired_trainers"].samples[0].value == 0
    assert _refusal_samples(families) == st["refusals"]

    # doctor: every status check has a verdict (none skipped for want of a key), none is an error
    checks = [doctor_status.check_reachability, doctor_status.check_clock_skew, doctor_status.check_versions, doctor_status.check_manifest,
              doctor_status.check_training, doctor_status.check_pairing]
    findings = [f for check in checks for f in check(st)]
    assert {f.check for f in findings} >= {"reachability", "clock", "versions", "manifest", "training", "pairing"}
    assert [f for f in findings if f.level in (doctor_findings.SKIP, doctor_findings.ERROR) or "?" in f.message] == []
    training = next(f for f in findings if f.check == "training")
    assert training.level == doctor_findings.OK
    assert training.message.startswith(f"training: step {st['training']['step']}, outer step ")
    pairing = next(f for f in findings if f.check == "pairing")  # a warning if the first node mostly stepped solo
    assert pairing.level == doctor_findings.WARN or pairing.message.startswith("pairing graph: one island of 2 trainers")

    # sd_notify's one line for `systemctl status`
    tr, sy = st["training"], st["sync"]
    assert summarize_status(st) == (
        f"peers 1 | step {tr['step']} outer {tr['outer_step']} loss {tr['loss']:.3f}"
        f" | sync {sy['rounds']} rounds ({sy['solo_rounds']} solo, {sy['failures']} failed)"
    )

    # the status view: no "?" (a missing key) and no "-" (a missing value) outside the free-text fields
    text = render_status(st)
    checked = text
    for free_text in (st["nat"]["reason"], st["discovery"]["last_error"]):
        checked = checked.replace(free_text, "") if free_text else checked
    assert "?" not in checked, text
    assert not re.search(r"(?<!\S)-s?(?!\S)", checked), text
    for needle in (f"training: {st['training']['task']} on {st['training']['device']}  state training",
                   f"sync: {st['sync']['rounds']} rounds", "mixing: ", "pace: ", "members: 2",
                   "pairing graph: one island of 2 trainers"):
        assert needle in text, (needle, text)
