"""node.ops.metrics: status snapshot -> Prometheus families, round events, and the trio /metrics server."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from node.ops.metrics import MAX_REQUEST_HEAD, Metrics, serve_metrics

SAMPLE_STATUS: dict[str, Any] = {
    "peer_id": "12D3KooWSelf",
    "swarm": "demo",
    "version": "0.1.0",
    "uptime_s": 42.5,
    "addrs": ["/ip4/127.0.0.1/tcp/4001"],
    "connected_peers": ["12D3KooWAlice", "12D3KooWBob", "12D3KooWCarol"],
    "training": {
        "step": 1200,
        "outer_step": 12,
        "loss": 2.5,
        "val_loss": 2.75,
        "samples_per_s": 96.0,
        "device": "cpu",
        "task": "tiny-lm",
        "restarts": 1,
    },
    "sync": {
        "rounds": 10,
        "solo_rounds": 2,
        "failures": 3,
        "distinct_partners": 2,
        "last_duration_s": 1.25,
        "last_bytes": 4096,
        "bytes_sent": 40960,
        "bytes_received": 50000,
        "wire_dtype": "bfloat16",
        "per_peer": {
            "12D3KooWAlice": {"bytes_sent": 30000, "bytes_received": 31000},
            "12D3KooWBob": {"bytes_sent": 10960, "bytes_received": 19000},
        },
    },
    "peers": [
        {"peer_id": "12D3KooWAlice", "path": "direct", "rtt_ms": 2.0},
        {"peer_id": "12D3KooWBob", "path": "hole-punched", "rtt_ms": 40.0},
        {"peer_id": "12D3KooWCarol", "path": "direct", "rtt_ms": 5.0},
    ],
    "members": [
        {"peer_id": "12D3KooWAlice", "state": "alive", "outer_step": 12, "loss": 2.4, "last_seen": 1.0},
        {"peer_id": "12D3KooWBob", "state": "alive", "outer_step": 11, "loss": 2.6, "last_seen": 1.0},
        {"peer_id": "12D3KooWDave", "state": "suspect", "outer_step": 9, "loss": 2.9, "last_seen": 30.0},
        {"peer_id": "12D3KooWEve", "state": "left", "outer_step": 3, "loss": 3.5, "last_seen": 300.0},
    ],
    "reachability": "public",
}


def samples_of(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample in an exposition, keyed by (name, labels)."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def rendered(metrics: Metrics) -> dict:
    body, _ = metrics.render()
    return samples_of(body.decode())


def test_status_snapshot_exports_training_sync_paths_members_and_reachability() -> None:
    metrics = Metrics()
    metrics.update_from_status(SAMPLE_STATUS)
    s = rendered(metrics)

    assert value(s, "starling_node_info", peer_id="12D3KooWSelf", swarm="demo", version="0.1.0") == 1
    assert value(s, "starling_uptime_seconds") == 42.5
    assert value(s, "starling_connected_peers") == 3
    assert value(s, "starling_training_step") == 1200
    assert value(s, "starling_training_outer_step") == 12
    assert value(s, "starling_training_loss") == 2.5
    assert value(s, "starling_training_val_loss") == 2.75
    assert value(s, "starling_training_samples_per_second") == 96
    assert value(s, "starling_worker_restarts_total") == 1
    assert value(s, "starling_sync_rounds_total") == 10
    assert value(s, "starling_sync_solo_rounds_total") == 2
    assert value(s, "starling_sync_failures_total") == 3
    assert value(s, "starling_sync_peer_sent_bytes_total", peer_id="12D3KooWAlice") == 30000
    assert value(s, "starling_sync_peer_received_bytes_total", peer_id="12D3KooWBob") == 19000
    assert value(s, "starling_connections", path="direct") == 2
    assert value(s, "starling_connections", path="hole-punched") == 1
    assert value(s, "starling_connections", path="relayed") == 0
    assert value(s, "starling_peer_rtt_seconds", peer_id="12D3KooWBob", path="hole-punched") == pytest.approx(0.04)
    assert value(s, "starling_members", state="alive") == 2
    assert value(s, "starling_members", state="suspect") == 1
    assert value(s, "starling_members", state="gone") == 0
    assert value(s, "starling_members", state="left") == 1
    assert value(s, "starling_reachability", state="public") == 1


def test_network_only_status_without_training_or_sync_exports_only_what_it_has() -> None:
    metrics = Metrics()
    metrics.update_from_status({"peer_id": "12D3KooWBoot", "swarm": "demo", "version": "0.1.0",
                                "uptime_s": 3, "addrs": [], "connected_peers": []})
    names = {name for name, _ in rendered(metrics)}

    assert "starling_connected_peers" in names
    assert not any(name.startswith(("starling_training", "starling_worker", "starling_members")) for name in names)


def test_a_newer_status_replaces_the_old_one_so_departed_peers_disappear() -> None:
    metrics = Metrics()
    metrics.update_from_status(SAMPLE_STATUS)
    later = {**SAMPLE_STATUS, "sync": {**SAMPLE_STATUS["sync"], "rounds": 11,
                                       "per_peer": {"12D3KooWBob": {"bytes_sent": 1, "bytes_received": 2}}}}
    metrics.update_from_status(later)
    s = rendered(metrics)

    assert value(s, "starling_sync_rounds_total") == 11
    assert ("starling_sync_peer_sent_bytes_total", frozenset({("peer_id", "12D3KooWAlice")})) not in s


def test_mistyped_and_missing_fields_are_skipped_without_raising() -> None:
    metrics = Metrics()
    metrics.update_from_status({
        "uptime_s": "soon",                                  # wrong type
        "connected_peers": None,
        "training": {"step": True, "loss": None, "val_loss": float("nan"), "restarts": -1},
        "sync": {"rounds": "ten", "per_peer": {"x": "not a dict", "": {"bytes_sent": 5}}},
        "peers": ["junk", {"path": None}],
        "members": [{"state": 7}],
        "reachability": {"state": "private", "confirmed_by": 2},
    })
    s = rendered(metrics)

    assert math.isnan(value(s, "starling_training_val_loss"))   # a diverged loss is worth seeing
    assert value(s, "starling_reachability", state="private") == 1
    assert value(s, "starling_members", state="alive") == 0
    names = {name for name, _ in s}
    assert not names & {"starling_uptime_seconds", "starling_training_step", "starling_training_loss",
                        "starling_worker_restarts_total", "starling_sync_rounds_total",
                        "starling_sync_peer_sent_bytes_total"}


def test_recent_mixing_pace_and_pairing_islands_are_exported_from_a_captured_status() -> None:
    status = json.loads((Path(__file__).parent / "data" / "status_three_trainers.json").read_text())
    status["sync"]["mixing"].update(outer_steps=20, solo=3, averaged=17, solo_share=0.15, distinct_partners=2)
    status["training"].update(period_s=1.8, last_inner_steps=14)
    metrics = Metrics()
    metrics.update_from_status(status)
    s = rendered(metrics)

    assert value(s, "starling_sync_recent_outer_steps") == 20
    assert value(s, "starling_sync_recent_solo_share") == pytest.approx(0.15)
    assert value(s, "starling_sync_recent_distinct_partners") == 2
    assert value(s, "starling_training_pace_seconds") == pytest.approx(1.8)
    assert value(s, "starling_training_last_inner_steps") == 14
    assert value(s, "starling_swarm_pairing_islands") == 1
    assert value(s, "starling_swarm_unpaired_trainers") == 0


def test_two_disjoint_pairs_of_trainers_export_two_islands_and_the_unpaired_count() -> None:
    def trainer(peer: str, *partners: str) -> dict[str, Any]:
        return {"peer_id": peer, "state": "alive", "role": "trainer", "partners": list(partners)}

    members = [trainer("a", "b"), trainer("b"), trainer("c", "d"), trainer("d", "c"), trainer("e"),
               {"peer_id": "r", "state": "alive", "role": "network-only", "partners": ["a", "c"]}]  # fmt: skip
    metrics = Metrics()
    metrics.update_from_status({**SAMPLE_STATUS, "members": members})
    s = rendered(metrics)

    assert value(s, "starling_swarm_pairing_islands") == 2
    assert value(s, "starling_swarm_unpaired_trainers") == 1


def test_missing_mixing_and_pace_values_are_skipped_without_raising() -> None:
    metrics = Metrics()
    metrics.update_from_status({
        "training": {"period_s": None, "last_inner_steps": "many"},
        "sync": {"mixing": {"outer_steps": 0, "solo_share": None, "distinct_partners": None}},
        "members": [{"peer_id": "a", "state": "alive", "role": "trainer", "partners": None}, None],
    })
    s = rendered(metrics)

    assert value(s, "starling_sync_recent_outer_steps") == 0
    assert value(s, "starling_swarm_pairing_islands") == 0
    assert value(s, "starling_swarm_unpaired_trainers") == 1
    names = {name for name, _ in s}
    assert not names & {"starling_sync_recent_solo_share", "starling_sync_recent_distinct_partners",
                        "starling_training_pace_seconds", "starling_training_last_inner_steps"}
    metrics.update_from_status({"sync": {"mixing": "broken"}, "training": {}})
    assert "starling_sync_recent_outer_steps" not in {name for name, _ in rendered(metrics)}


def test_non_mapping_status_is_ignored_and_keeps_the_previous_snapshot() -> None:
    metrics = Metrics()
    metrics.update_from_status(SAMPLE_STATUS)
    metrics.update_from_status(["not", "a", "dict"])  # type: ignore[arg-type]

    assert value(rendered(metrics), "starling_sync_rounds_total") == 10


def test_observe_round_fills_duration_and_bytes_histograms_by_result() -> None:
    metrics = Metrics()
    metrics.observe_round(0.3, 1_000_000, "12D3KooWAlice", True)
    metrics.observe_round(7.0, 2_000_000, "12D3KooWAlice", True)
    metrics.observe_round(45.0, 0, "12D3KooWBob", False)
    s = rendered(metrics)

    assert value(s, "starling_sync_round_duration_seconds_count", result="ok") == 2
    assert value(s, "starling_sync_round_duration_seconds_sum", result="ok") == pytest.approx(7.3)
    assert value(s, "starling_sync_round_duration_seconds_bucket", result="ok", le="0.5") == 1
    assert value(s, "starling_sync_round_duration_seconds_bucket", result="ok", le="10.0") == 2
    assert value(s, "starling_sync_round_duration_seconds_count", result="failed") == 1
    assert value(s, "starling_sync_round_bytes_sum", result="ok") == 3_000_000
    assert value(s, "starling_sync_partner_rounds_total", peer_id="12D3KooWAlice", result="ok") == 2
    assert value(s, "starling_sync_partner_rounds_total", peer_id="12D3KooWBob", result="failed") == 1


def test_observe_round_drops_nonsense_values_instead_of_raising() -> None:
    metrics = Metrics()
    metrics.observe_round(float("nan"), 10, "p", True)
    metrics.observe_round(-1.0, 10, "p", True)
    metrics.observe_round(1.0, -5, "p", True)

    assert value(rendered(metrics), "starling_sync_round_duration_seconds_count", result="ok") == 0


def test_partner_series_are_capped_by_dropping_the_least_recent_partner() -> None:
    metrics = Metrics(max_peer_labels=2)
    for peer in ("p1", "p2", "p1", "p3"):  # p2 is now the least recently seen
        metrics.observe_round(1.0, 10, peer, True)
    partners = {dict(labels)["peer_id"] for name, labels in rendered(metrics)
                if name == "starling_sync_partner_rounds_total"}

    assert partners == {"p1", "p3"}


async def http_get(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send a raw request and read the whole response (the server closes after one)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        data = bytearray()
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                data += chunk
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, val = line.partition(":")
        headers[name.strip().lower()] = val.strip()
    return int(lines[0].split(" ")[1]), headers, body


async def test_serve_metrics_answers_a_scrape_with_the_current_status() -> None:
    metrics = Metrics()
    metrics.update_from_status(SAMPLE_STATUS)
    metrics.observe_round(2.0, 4096, "12D3KooWAlice", True)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_metrics, metrics, "127.0.0.1", 0)
        status, headers, body = await http_get(
            port, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: test\r\n\r\n")
        nursery.cancel_scope.cancel()

    assert status == 200
    assert headers["content-type"].startswith("text/plain")
    assert int(headers["content-length"]) == len(body)
    s = samples_of(body.decode())
    assert value(s, "starling_training_loss") == 2.5
    assert value(s, "starling_members", state="alive") == 2
    assert value(s, "starling_sync_round_duration_seconds_count", result="ok") == 1


async def test_serve_metrics_speaks_openmetrics_when_the_scraper_asks_for_it() -> None:
    metrics = Metrics()
    metrics.update_from_status(SAMPLE_STATUS)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_metrics, metrics, "127.0.0.1", 0)
        status, headers, body = await http_get(
            port, b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text; version=1.0.0\r\n\r\n")
        nursery.cancel_scope.cancel()

    assert status == 200
    assert headers["content-type"].startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")


@pytest.mark.parametrize(
    ("request_bytes", "expected_status"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", 404),
        (b"GET /metrics/../etc HTTP/1.1\r\n\r\n", 404),
        (b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 405),
        (b"hello\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * (MAX_REQUEST_HEAD + 10), 431),
    ],
    ids=["root", "other-path", "post", "garbage", "oversized-head"],
)
async def test_serve_metrics_refuses_other_requests_with_a_status_code(request_bytes: bytes,
                                                                       expected_status: int) -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_metrics, Metrics(), "127.0.0.1", 0)
        status, _, _ = await http_get(port, request_bytes)
        nursery.cancel_scope.cancel()

    assert status == expected_status


async def test_serve_metrics_head_request_has_headers_but_no_body() -> None:
    metrics = Metrics()
    metrics.update_from_status(SAMPLE_STATUS)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_metrics, metrics, "127.0.0.1", 0)
        status, headers, body = await http_get(port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
        nursery.cancel_scope.cancel()

    assert status == 200
    assert int(headers["content-length"]) > 0
    assert body == b""


async def test_serve_metrics_closes_a_client_that_never_finishes_its_request(autojump_clock: trio.abc.Clock) -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_metrics, Metrics(), "127.0.0.1", 0)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"GET /metrics HTTP/1.1\r\n")  # no blank line: the head never ends
            with trio.fail_after(60):
                leftover = await stream.receive_some(1024)
        nursery.cancel_scope.cancel()

    assert leftover == b""  # the server gave up and closed without answering


async def test_serve_metrics_reports_a_port_in_use_at_start() -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_metrics, Metrics(), "127.0.0.1", 0)
        with pytest.raises(OSError):
            await nursery.start(serve_metrics, Metrics(), "127.0.0.1", port)
        nursery.cancel_scope.cancel()


def test_refused_and_clipped_partner_updates_are_counted_by_reason() -> None:
    status = json.loads(json.dumps(SAMPLE_STATUS))
    status["sync"]["rejections"] = {"phi_distance": 3, "non_finite": 1}
    status["sync"]["clipped"] = {"delta": 5, "phi": 2}
    metrics = Metrics()
    metrics.update_from_status(status)
    s = rendered(metrics)
    assert value(s, "starling_sync_refused_updates_total", reason="phi_distance") == 3
    assert value(s, "starling_sync_refused_updates_total", reason="non_finite") == 1
    assert value(s, "starling_sync_clipped_updates_total", reason="delta") == 5
    assert value(s, "starling_sync_clipped_updates_total", reason="phi") == 2


def test_the_configured_compression_the_last_rounds_preset_and_its_bytes_per_param_are_exported() -> None:
    """With `sync.compression = auto` the setting alone does not say what crossed the wire: the preset of the
    latest round is its own info metric, beside that round's bytes per parameter."""
    metrics = Metrics()
    metrics.update_from_status({**SAMPLE_STATUS, "sync": {**SAMPLE_STATUS["sync"], "compression": "auto",
                                                          "last_compression": "medium", "last_bytes_per_param": 0.4392}})
    s = rendered(metrics)
    assert value(s, "starling_sync_compression_info", preset="auto") == 1
    assert value(s, "starling_sync_last_compression_info", preset="medium") == 1
    assert value(s, "starling_sync_last_bytes_per_param") == pytest.approx(0.4392)
    metrics.update_from_status({**SAMPLE_STATUS, "sync": {**SAMPLE_STATUS["sync"], "last_compression": None}})
    assert not any(name == "starling_sync_last_compression_info" for name, _ in rendered(metrics))


def test_the_phases_of_the_latest_asked_exchange_are_a_gauge_per_phase() -> None:
    phases = {"open": 0.1, "answer": 0.11, "connect": 0.1, "transfer": 0.7, "result": 0.01}
    metrics = Metrics()
    metrics.update_from_status({**SAMPLE_STATUS, "sync": {**SAMPLE_STATUS["sync"], "last_asked": {
        "partner": "p", "phases_s": phases, "rtt_ms": 100.0, "phases_rtt": None}}})
    s = rendered(metrics)
    for name, seconds in phases.items():
        assert value(s, "starling_sync_last_asked_phase_seconds", phase=name) == pytest.approx(seconds)
    metrics.update_from_status({**SAMPLE_STATUS, "sync": {**SAMPLE_STATUS["sync"], "last_asked": None}})
    assert not any(name == "starling_sync_last_asked_phase_seconds" for name, _ in rendered(metrics))


async def test_a_scrape_shows_every_refusal_kind_muxer_offences_capped_clocks_and_partners_sitting_out() -> None:
    """What a node refused to peers reaches Prometheus: `refusals` as one counter family labelled by kind
    (zeros included, so an alert's rate() starts from a series), the muxer's offences, the records whose
    clock was not followed, and the trainers sitting out after missed rounds."""
    from node.ops.refusals import KINDS

    status = json.loads(json.dumps(SAMPLE_STATUS))
    status["refusals"] = {kind: 0 for kind in KINDS} | {"state_sessions_peer_share": 12, "clocks_capped": 2}
    status["muxer"] = {"window_overruns": 4, "dropped_bytes": 9_000_000, "offenders": 1}
    status["swarm_totals"] = {"clock_capped": 2, "crowd_evictions": 0}
    status["sync"]["sitting_out"] = {"count": 3, "exclusions": 5, "peers": {"12D3KooWFake": 12.5}}
    metrics = Metrics()
    metrics.update_from_status(status)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_metrics, metrics, "127.0.0.1", 0)
        code, _, body = await http_get(port, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        nursery.cancel_scope.cancel()

    assert code == 200
    s = samples_of(body.decode())
    refused = {dict(labels)["kind"]: v for (name, labels), v in s.items() if name == "starling_refusals_total"}
    assert refused == {kind: float(n) for kind, n in status["refusals"].items()}
    assert value(s, "starling_muxer_window_overruns_total") == 4
    assert value(s, "starling_muxer_dropped_bytes_total") == 9_000_000
    assert value(s, "starling_muxer_offenders") == 1
    assert value(s, "starling_swarm_clock_capped_total") == 2
    assert value(s, "starling_sync_partners_sitting_out") == 3
    assert value(s, "starling_sync_partner_exclusions_total") == 5


def test_refusal_sections_that_are_absent_or_mistyped_export_nothing_of_theirs() -> None:
    metrics = Metrics()
    metrics.update_from_status({**SAMPLE_STATUS, "refusals": {"clocks_capped": "two", "handshakes_refused": 1},
                                "muxer": None, "swarm_totals": {"clock_capped": -1}})
    s = rendered(metrics)
    names = {name for name, _ in s}
    assert value(s, "starling_refusals_total", kind="handshakes_refused") == 1
    assert ("starling_refusals_total", frozenset({("kind", "clocks_capped")})) not in s
    assert not names & {"starling_muxer_window_overruns_total", "starling_swarm_clock_capped_total",
                        "starling_sync_partners_sitting_out"}
