"""bench/swim_transport.py's smoke run: real protocols/swim.py pings and acks, every claim signed and checked,
over the libp2p carriers the daemon could use (structure, not speeds)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocols import swim

ROOT = Path(__file__).resolve().parent.parent
ROUND_TRIPS = 5
WARMUP = 3  # round trips each carrier runs before it measures


def _bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("swim_transport", ROOT / "bench" / "swim_transport.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["swim_transport"] = module
    spec.loader.exec_module(module)
    return module


async def test_a_new_stream_and_a_long_lived_stream_each_carry_signed_pings_and_acks_that_are_verified() -> None:
    """(a) and (b) between two hosts built by p2p.host.build_host: every round trip is a full ping and
    ack (15 signed claims each, ~2 KiB), and every claim's signature was checked on arrival."""
    bench = _bench()
    codec = bench.Codec("full")
    claims = 1 + len(codec.relayed)
    assert claims == 15 and 1800 < len(codec.ping()) <= 2048 + 100
    results, idle = await bench.libp2p_carriers(codec, ROUND_TRIPS, connects=0, idle_s=0)
    assert [r.name[:3] for r in results] == ["(a)", "(b)"]
    for result in results:
        assert result.round_trips == ROUND_TRIPS and len(result.wall_s) == ROUND_TRIPS
        assert result.cpu_s > 0 and result.p50_ms <= result.p99_ms
    # both carriers, warm-up included: a ping and an ack per round trip, each claim verified once
    assert codec.names.verified == 2 * (ROUND_TRIPS + WARMUP) * 2 * claims
    assert idle == 0.0


def test_a_claim_signed_by_someone_else_is_refused_by_the_codec_s_verify() -> None:
    """The benchmark's verify is a real check: a claim whose signature is not its author's is dropped by
    protocols.swim.decode, so the measured cost is that of verification that can fail."""
    bench = _bench()
    codec = bench.Codec("bare")
    names = codec.names
    forged = swim.Alive(0, 1, Ed25519PrivateKey.generate().sign(swim.claim_bytes(swim.Alive(0, 1), names.name_of)))
    data = swim.encode(swim.Ping(0, 1, 1, (forged,)), names.name_of)
    assert swim.decode(data, 0, names.id_of, names.verify).updates == ()
    genuine = bench.signed(swim.Alive(0, 1), names, codec.identities[0])
    data = swim.encode(swim.Ping(0, 1, 1, (genuine,)), names.name_of)
    assert swim.decode(data, 0, names.id_of, names.verify).updates == (genuine,)


@pytest.mark.parametrize("payload", ["full", "bare"])
def test_the_report_prices_every_option_per_node_per_minute(payload: str) -> None:
    """The rendered section has a row per carrier and per option, with the command and the machine."""
    bench = _bench()
    fake = [bench.Result(name, 10, cpu, [0.001] * 10) for name, cpu in
            (("(a) x", 0.010), ("(b) x", 0.005), ("(c) x", 0.030), ("(d) x", 0.004))]
    report = bench.Report(4e-5, 1e-4, bench.Result("codec", 10, 0.004, [0.001] * 10), fake, 0.001, 2000,
                          15 if payload == "full" else 1, 137.0, 0.33)
    text = bench.render(report, "python bench/swim_transport.py")
    assert text.startswith(bench.SECTION + "\n") and "cores" in text
    rows = [line for line in text.splitlines() if line.startswith("| (")]
    assert len(rows) == 4 + 5
    # (b) for connected members and (c) for the rest: 68.5 round trips, a third at (c)'s price
    expected = 68.5 * (0.67 * 0.005 + 0.33 * 0.030)
    assert any(row.startswith("| (b) for connected members, (c)") and f"| {expected:.2f} |" in row for row in rows)
