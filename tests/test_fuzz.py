"""Hypothesis fuzzing of every decoder and protocol handler that its own module's tests do not fuzz.

The targets live in ``starling_testing/fuzz.py``: for each decoder, valid encodings to start from (seeds),
the harness that feeds it one input, and the exception types it documents. ``bench/fuzz.py`` runs them with
>= 100k inputs each (``make fuzz``); here hypothesis gives each a couple of hundred inputs on every test
run: random bytes, or mutations of the seeds driven by hypothesis' own random source, so that a failure
shrinks to a small input. ``p2p.wire`` and ``protocols.codec`` are fuzzed in their own test files.

An input passes when the decoder accepts it or rejects it with a documented exception type, and breaks
none of its other promises: the averager counts a garbage conversation as a failure, the dial-back
handler answers or resets, a helper cannot point a dial-back at a foreign IP, servers keep serving.
"""

from __future__ import annotations

import json
import struct

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p.wire import FRAME_HEADER, ProtocolError, Reason
from starling_testing import fuzz

TARGETS = [t for t in fuzz.TARGETS if not t.fuzzed_elsewhere]
EXAMPLES = 150


def run(target: type[fuzz.Target], data: bytes) -> list[fuzz.Outcome]:
    """One input against a fresh target, then its liveness check (for the servers)."""
    return trio.run(fuzz.check_one, target, data)


def inputs(target: type[fuzz.Target]) -> st.SearchStrategy[bytes]:
    seeds = fuzz.seeds_of(target).all
    mutated = st.randoms(use_true_random=False).map(lambda rng: fuzz.Mutator(rng).mutate(seeds))
    return st.one_of(st.binary(max_size=600), mutated, mutated, mutated)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_valid_inputs_are_accepted_and_valid_refusals_refused(target: type[fuzz.Target]) -> None:
    """The seeds are genuine, so mutations start from inputs that reach the decoder's depths."""
    seeds = fuzz.seeds_of(target)
    for seed in seeds.accepted:
        outcomes = run(target, fuzz.render(seed))
        assert [o.kind for o in outcomes] == ["accepted"], outcomes
    for seed in seeds.refused:
        outcomes = run(target, fuzz.render(seed))
        assert [o.kind for o in outcomes] == ["rejected"], outcomes


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
@given(data=st.data())
def test_garbage_ends_in_a_documented_error_and_breaks_no_promise(
    target: type[fuzz.Target], data: st.DataObject
) -> None:
    blob = data.draw(inputs(target), label="input")
    unexpected = [o for o in run(target, blob) if o.kind == "unexpected"]
    assert not unexpected, f"{target.name}: {unexpected[0].label}"


# --- inputs worth naming (the first four got through before the fixes in node/ops/control.py,
# --- node/config/load.py and protocols/avg.py) -----------------------------------------------------------


def test_a_control_request_nested_too_deeply_for_json_is_answered_and_the_socket_keeps_serving() -> None:
    # json.loads raises RecursionError (not a ValueError) on deep nesting; a 64 KiB line holds plenty.
    outcomes = run(fuzz.ControlSocket, b"[" * 50_000 + b"\n")
    assert [o.kind for o in outcomes] == ["rejected"], outcomes


def test_a_config_file_nested_too_deeply_for_toml_is_a_config_error() -> None:
    # tomllib raises RecursionError on deeply nested arrays or inline tables.
    outcomes = run(fuzz.ConfigFile, b"[node]\nlisten = " + b"[" * 5000 + b"\n")
    assert [o.kind for o in outcomes] == ["rejected"], outcomes
    assert outcomes[0].label.startswith("ConfigError"), outcomes


def _bad_frame_after(seed: fuzz.Seed, keep: int) -> bytes:
    """A recorded conversation whose first ``keep`` parts are genuine, then a frame of unknown kind."""
    return fuzz.render(seed[:keep]) + FRAME_HEADER.pack(16, 9) + bytes(16)


def test_a_malformed_frame_from_a_partner_mid_transfer_is_a_counted_protocol_offence() -> None:
    request_path_frames = fuzz.seeds_of(fuzz.AvgResponder).accepted[0]
    outcomes = run(fuzz.AvgResponder, _bad_frame_after(request_path_frames, keep=3))
    assert [(o.kind, o.label) for o in outcomes] == [("rejected", "failed:ProtocolError:malformed")], outcomes


async def test_a_malformed_frame_mid_transfer_surfaces_from_initiate_as_a_protocol_error() -> None:
    dtype_answer_frames = fuzz.seeds_of(fuzz.AvgInitiator).accepted[0]
    async with fuzz.AvgInitiator() as initiator:
        with pytest.raises(ProtocolError) as exc:
            await initiator.feed(_bad_frame_after(dtype_answer_frames, keep=2))
    assert exc.value.reason is Reason.MALFORMED


def test_a_dialback_request_naming_foreign_addresses_only_dials_the_observed_ip() -> None:
    foreign = ["/ip4/8.8.8.8/tcp/53", f"/ip4/10.1.2.3/tcp/4001/p2p/{fuzz.PEERS[2]}", "/dns4/example.org/tcp/1"]
    offered = "\n".join(["127.0.0.1", *foreign])
    outcomes = run(fuzz.DialbackTargets, offered.encode())
    assert [(o.kind, o.label) for o in outcomes] == [("accepted", "accepted:2 targets")], outcomes


def test_control_answers_one_json_line_per_request_even_for_an_oversized_line() -> None:
    outcomes = run(fuzz.ControlSocket, json.dumps({"cmd": "ping", "pad": "x" * 100_000}).encode())
    assert [(o.kind, o.label) for o in outcomes] == [("rejected", "error:bad request: message too")], outcomes


def test_a_length_prefix_past_the_limit_is_refused_by_every_stream_handler() -> None:
    huge = struct.pack(">I", 2**32 - 1) + b"\x80"
    for target in (fuzz.StateResponder, fuzz.StateInitiator):
        assert [(o.kind, o.label) for o in run(target, huge)] == [("rejected", "ProtocolError:too_large")]
    assert [o.label for o in run(fuzz.AvgResponder, huge)] == ["failed:ProtocolError:too_large"]
    assert [o.label for o in run(fuzz.DialbackHandler, huge)] == ["reset"]
