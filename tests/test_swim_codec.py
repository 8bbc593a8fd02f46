"""/starling/swim/1.0.0's codec (protocols/swim.py): every message round-trips; garbage, mutated messages and
out-of-range fields are a ProtocolError and nothing else; claims with a refused signature or about a peer this
node will not hold are skipped; the byte counts the benchmarks use stay close to the real encoding."""

from __future__ import annotations

import random

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p.wire import ProtocolError, Reason
from protocols import swim
from protocols.swim import (
    MAX_MESSAGE_BYTES,
    MAX_UPDATES,
    Ack,
    Alive,
    Dead,
    Ping,
    PingReq,
    Progress,
    Suspect,
    SyncReply,
    SyncRequest,
    claim_bytes,
    decode,
    encode,
)
from starling_testing import fuzz

NAMES = [bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20]) + bytes([i]) * 32 for i in range(20)]  # 38-byte peer IDs
IDS = {name: i for i, name in enumerate(NAMES)}
SIG = bytes(range(64))


def name_of(pid: int) -> bytes:
    return NAMES[pid]


def id_of(name: bytes) -> int | None:
    return IDS.get(name)


CLAIMS = [Alive(1, 3, SIG), Suspect(2, 0, 4, SIG), Dead(5, 7, 5, SIG), Progress(6, 9, 120, 2.5, 310.0, SIG)]
MESSAGES = [
    Ping(3, 1, 0, tuple(CLAIMS)),
    PingReq(3, 2, 7, (Alive(1, 3, SIG),)),
    Ack(3, 3, ()),
    SyncRequest(3, 4, -1, (Alive(3, 0, SIG), Dead(8, 2, 3, SIG)), Suspect(0, 0, 3, SIG)),
    SyncReply(3, 5, 17, tuple(Alive(i, i, SIG) for i in range(10)), None, False),
    SyncReply(3, 6, 0, (), Alive(0, 1, SIG), True),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_and_its_counted_size_is_close_to_the_encoding(message: swim.Message) -> None:
    data = encode(message, name_of)
    back = decode(data, message.sender, id_of)
    assert back == message
    assert all(getattr(a, "sig", None) == getattr(b, "sig", None)
               for a, b in zip(_claims_of(back), _claims_of(message), strict=True))
    # The benchmarks count `size` without encoding: it must not flatter the wire.
    assert len(data) <= message.size * 1.1 + 16


def _claims_of(message: swim.Message) -> list[swim.Update]:
    if isinstance(message, Ping | PingReq | Ack):
        return list(message.updates)
    return [*message.entries, *([message.view_of_you] if message.view_of_you else [])]


def test_claims_with_a_refused_signature_or_an_unheld_peer_are_skipped_not_fatal() -> None:
    data = encode(Ping(3, 1, 0, tuple(CLAIMS)), name_of)
    signed_by: list[bytes] = []

    def verify(signer: bytes, body: bytes, sig: bytes) -> bool:
        signed_by.append(signer)
        return signer != NAMES[4]  # the accuser of the Suspect claim

    back = decode(data, 3, id_of, verify)
    assert isinstance(back, Ping) and Suspect(2, 0, 4) not in back.updates and len(back.updates) == 3
    # Each claim is checked against its author: the member for alive and progress, the accuser otherwise.
    assert signed_by == [NAMES[1], NAMES[4], NAMES[5], NAMES[6]]
    assert claim_bytes(Suspect(2, 0, 4), name_of).startswith(swim.PROTOCOL_ID.encode())
    unheld = decode(data, 3, lambda name: None if name == NAMES[6] else IDS.get(name))
    assert isinstance(unheld, Ping) and len(unheld.updates) == 3


def test_a_signature_covers_the_claim_as_encoded() -> None:
    seen: dict[bytes, bytes] = {}

    def verify(signer: bytes, body: bytes, sig: bytes) -> bool:
        seen[signer] = body
        return True

    decode(encode(Ping(3, 1, 0, (Alive(1, 3, SIG),)), name_of), 3, id_of, verify)
    assert seen[NAMES[1]] == claim_bytes(Alive(1, 3), name_of)


def _raises_protocol_error(data: bytes, reason: Reason | None = None) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(data, 3, id_of)
    if reason is not None:
        assert info.value.reason == reason


def test_limits_and_out_of_range_fields_are_protocol_errors() -> None:
    good = msgpack.unpackb(encode(Ping(3, 1, 0, (Alive(1, 3, SIG),)), name_of))

    def variant(**changes: object) -> bytes:
        return msgpack.packb({**good, **changes}, use_bin_type=True)

    _raises_protocol_error(b"\x00" * (MAX_MESSAGE_BYTES + 1), Reason.TOO_LARGE)
    _raises_protocol_error(variant(v=2), Reason.BAD_VERSION)
    _raises_protocol_error(variant(t=99), Reason.BAD_KIND)
    _raises_protocol_error(variant(extra=1), Reason.BAD_KIND)
    _raises_protocol_error(variant(s=-1), Reason.BAD_FIELD)
    _raises_protocol_error(variant(s=True), Reason.BAD_FIELD)
    _raises_protocol_error(variant(u=[[1, NAMES[1], 3, SIG]] * (MAX_UPDATES + 1)), Reason.BAD_FIELD)
    _raises_protocol_error(variant(u=[[1, NAMES[1], 2**33, SIG]]), Reason.BAD_FIELD)
    _raises_protocol_error(variant(u=[[1, b"x" * 65, 3, SIG]]), Reason.BAD_FIELD)
    _raises_protocol_error(variant(u=[[4, NAMES[1], 1, 1, float("nan"), 1.0, SIG]]), Reason.BAD_FIELD)
    _raises_protocol_error(variant(u=[[2, NAMES[1], 1, SIG]]), Reason.BAD_FIELD)  # a suspect without accuser
    _raises_protocol_error(variant(u=[[[1], NAMES[1], 3, SIG]]), Reason.BAD_FIELD)  # an unhashable kind
    _raises_protocol_error(msgpack.packb([1, 2, 3]), Reason.MALFORMED)
    _raises_protocol_error(b"\xc1", Reason.MALFORMED)
    sync = msgpack.unpackb(encode(MESSAGES[3], name_of))
    _raises_protocol_error(msgpack.packb({**sync, "e": [[4, NAMES[1], 1, 1, 1.0, 1.0, SIG]]}), Reason.BAD_FIELD)


SEEDS = [[("doc", msgpack.unpackb(encode(m, name_of)))] for m in MESSAGES]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32))
def test_mutated_messages_decode_or_raise_a_protocol_error_and_nothing_else(seed: int) -> None:
    data = fuzz.Mutator(random.Random(seed)).mutate(SEEDS)
    try:
        message = decode(data, 3, id_of)
    except ProtocolError:
        return
    assert isinstance(message, Ping | PingReq | Ack | SyncRequest | SyncReply)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_decode_or_raise_a_protocol_error_and_nothing_else(data: bytes) -> None:
    try:
        decode(data, 3, id_of)
    except ProtocolError:
        pass
