"""p2p.wire: framing, strict message validation, frame channels, stream adapters."""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field
from typing import ClassVar

import msgpack
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p.wire import (
    ByteStream,
    FrameChannel,
    LibP2PByteStream,
    PlainFrameChannel,
    ProtocolError,
    Reason,
    TrioByteStream,
    decode_msg,
    encode_msg,
    from_map,
    read_exactly,
    recv_as,
    recv_msg,
    send_msg,
    spec,
    to_map,
)
from starling_testing.conformance import FRAME_CHANNEL_CHECKS, Check
from starling_testing.fakes import FakeNetStream, ScriptedStream

# ---------------------------------------------------------------------------------------------
# Test doubles (starling_testing.fakes) and sample messages
# ---------------------------------------------------------------------------------------------


def stream_pair() -> tuple[TrioByteStream, TrioByteStream]:
    a, b = trio.testing.memory_stream_pair()
    return TrioByteStream(a), TrioByteStream(b)


class Color(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Entry:
    name: str = spec(min_len=1, max_len=16)
    shape: tuple[int, ...] = spec(max_len=8)


@dataclass(frozen=True)
class Header:
    KIND: ClassVar[str] = "header"
    VERSION: ClassVar[int] = 2
    outer_step: int = spec(ge=0)
    digest: bytes = spec(min_len=4, max_len=4)
    lr: float = spec(ge=0.0, le=1.0)
    layout: list[Entry] = spec(max_len=4)
    color: Color = Color.RED
    note: str | None = None
    tags: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.outer_step == 13:
            raise ValueError("unlucky step")


@dataclass(frozen=True)
class Refuse:
    KIND: ClassVar[str] = "refuse"
    VERSION: ClassVar[int] = 1
    why: str = spec(max_len=64)


def sample_header(**overrides: object) -> Header:
    values: dict[str, object] = dict(
        outer_step=7, digest=b"\x01\x02\x03\x04", lr=0.5, layout=[Entry("w", (2, 3)), Entry("b", (3,))]
    )
    values.update(overrides)
    return Header(**values)  # type: ignore[arg-type]


def wire_map(**overrides: object) -> dict[str, object]:
    data = to_map(sample_header())
    data.update(overrides)
    return data


def reason_of(excinfo: pytest.ExceptionInfo[ProtocolError]) -> Reason:
    return excinfo.value.reason


# ---------------------------------------------------------------------------------------------
# Framing
# ---------------------------------------------------------------------------------------------


async def test_dataclass_message_roundtrips_over_a_trio_stream() -> None:
    left, right = stream_pair()
    msg = sample_header(note="hi", tags={"a": 1}, color=Color.BLUE)
    await send_msg(left, msg)
    assert await recv_as(right, Header) == msg


async def test_plain_dict_message_roundtrips() -> None:
    left, right = stream_pair()
    await send_msg(left, {"x": [1, 2], "y": b"z"})
    assert await recv_msg(right) == {"x": [1, 2], "y": b"z"}


async def test_oversized_length_is_refused_before_the_payload_is_read() -> None:
    stream = ScriptedStream(struct.pack(">I", 1 << 31) + b"\x80" * 64)
    with pytest.raises(ProtocolError) as exc:
        await recv_msg(stream, max_bytes=1024)
    assert reason_of(exc) is Reason.TOO_LARGE
    assert stream.pos == 4  # only the length prefix was consumed


async def test_message_cut_inside_the_payload_is_truncated() -> None:
    payload = msgpack.packb({"a": 1})
    stream = ScriptedStream(struct.pack(">I", len(payload)) + payload[:-1], chunk=1)
    with pytest.raises(ProtocolError) as exc:
        await recv_msg(stream)
    assert reason_of(exc) is Reason.TRUNCATED


async def test_message_cut_right_after_the_length_is_truncated() -> None:
    with pytest.raises(ProtocolError) as exc:
        await recv_msg(ScriptedStream(struct.pack(">I", 5)))
    assert reason_of(exc) is Reason.TRUNCATED


async def test_clean_end_of_stream_before_a_message_is_closed() -> None:
    with pytest.raises(ProtocolError) as exc:
        await recv_msg(ScriptedStream(b""))
    assert reason_of(exc) is Reason.CLOSED


async def test_read_exactly_assembles_short_reads() -> None:
    stream = ScriptedStream(b"abcdefgh", chunk=3)
    assert await read_exactly(stream, 8, limit=8) == b"abcdefgh"


async def test_read_exactly_refuses_sizes_over_its_limit() -> None:
    with pytest.raises(ProtocolError) as exc:
        await read_exactly(ScriptedStream(b"abc"), 3, limit=2)
    assert reason_of(exc) is Reason.TOO_LARGE


def test_encode_refuses_a_message_the_peer_would_refuse() -> None:
    with pytest.raises(ValueError):
        encode_msg({"blob": b"x" * 2048}, max_bytes=1024)


@pytest.mark.parametrize(
    "payload",
    [
        msgpack.packb([1, 2, 3]),  # not a map
        b"\xc1",  # never-used msgpack byte
        msgpack.packb({"a": 1}) + b"\x00",  # trailing bytes
        msgpack.packb({1: 2}),  # non-string key
        msgpack.packb({"a": msgpack.ExtType(1, b"x")}),  # extension types are not allowed
        b"\x91" * 5000,  # nesting deeper than the decoder allows
        b"\xa2\xff\xfe",  # invalid UTF-8 string
    ],
)
def test_undecodable_payloads_are_malformed(payload: bytes) -> None:
    with pytest.raises(ProtocolError) as exc:
        decode_msg(payload)
    assert reason_of(exc) is Reason.MALFORMED


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_recv_msg_on_garbage_raises_only_protocol_errors(data: bytes) -> None:
    async def main() -> None:
        try:
            await recv_msg(ScriptedStream(data, chunk=7), max_bytes=256)
        except ProtocolError:
            pass

    trio.run(main)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_recv_msg_on_length_prefixed_garbage_raises_only_protocol_errors(body: bytes) -> None:
    async def main() -> None:
        try:
            msg = await recv_msg(ScriptedStream(struct.pack(">I", len(body)) + body))
        except ProtocolError:
            return
        assert isinstance(msg, dict)

    trio.run(main)


# ---------------------------------------------------------------------------------------------
# Strict validation
# ---------------------------------------------------------------------------------------------


def expect_field_error(data: object, cls: type = Header, reason: Reason = Reason.BAD_FIELD) -> str:
    with pytest.raises(ProtocolError) as exc:
        from_map(cls, data)
    assert exc.value.reason is reason
    return exc.value.detail


def test_validation_rebuilds_nested_dataclasses_tuples_and_enums() -> None:
    msg = from_map(Header, wire_map(color="blue", note=None, tags={"k": 3}))
    assert msg.layout[0] == Entry("w", (2, 3))
    assert isinstance(msg.layout[0].shape, tuple)
    assert msg.color is Color.BLUE


def test_missing_required_field_is_refused() -> None:
    data = wire_map()
    del data["digest"]
    assert "digest" in expect_field_error(data)


def test_absent_optional_field_takes_its_default() -> None:
    data = wire_map()
    del data["color"], data["note"], data["tags"]
    assert from_map(Header, data).color is Color.RED


def test_unknown_field_is_refused() -> None:
    assert "surprise" in expect_field_error(wire_map(surprise=1))


@pytest.mark.parametrize(
    "overrides",
    [
        {"outer_step": True},  # bool is not an int on the wire
        {"outer_step": 1.0},
        {"outer_step": -1},
        {"digest": "abcd"},
        {"digest": b"abc"},
        {"lr": 1.5},
        {"lr": float("nan")},
        {"lr": "0.1"},
        {"layout": [{"name": "", "shape": []}]},
        {"layout": [{"name": "w", "shape": [1, "2"]}]},
        {"layout": [{"name": "w"}]},
        {"layout": [{"name": "w", "shape": []}] * 5},
        {"layout": {"name": "w"}},
        {"color": "green"},
        {"note": 5},
        {"tags": {"a": "b"}},
        {"tags": []},
    ],
)
def test_mistyped_or_out_of_range_field_is_refused(overrides: dict[str, object]) -> None:
    expect_field_error(wire_map(**overrides))


def test_int_is_accepted_for_a_float_field() -> None:
    assert from_map(Header, wire_map(lr=1)).lr == 1.0


def test_unknown_version_is_refused() -> None:
    expect_field_error(wire_map(v=3), reason=Reason.BAD_VERSION)
    data = wire_map()
    del data["v"]
    expect_field_error(data, reason=Reason.BAD_VERSION)


def test_wrong_message_kind_is_refused() -> None:
    expect_field_error(wire_map(t="refuse"), reason=Reason.BAD_KIND)


def test_a_tuple_of_classes_dispatches_on_the_kind() -> None:
    assert from_map((Header, Refuse), to_map(Refuse("busy"))) == Refuse("busy")
    assert isinstance(from_map((Header, Refuse), wire_map()), Header)
    expect_field_error({"t": "other", "v": 1}, cls=(Header, Refuse), reason=Reason.BAD_KIND)  # type: ignore[arg-type]


def test_dataclass_invariants_become_field_errors() -> None:
    assert "unlucky" in expect_field_error(wire_map(outer_step=13))


def test_non_map_input_is_malformed() -> None:
    expect_field_error([1, 2], reason=Reason.MALFORMED)


def test_reserved_envelope_names_cannot_be_fields() -> None:
    @dataclass
    class Bad:
        t: int = 0

    with pytest.raises(TypeError):
        from_map(Bad, {"t": 1})


json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["t", "v", "outer_step", "digest", "lr", "layout", "note", "x"]), json_like
    )
)
def test_validation_of_arbitrary_maps_raises_only_protocol_errors(data: dict[str, object]) -> None:
    try:
        from_map((Header, Refuse), data)
    except ProtocolError:
        pass


# ---------------------------------------------------------------------------------------------
# Plain frame channel (the fallback data path)
# ---------------------------------------------------------------------------------------------


async def test_plain_frames_roundtrip_and_close_cleanly() -> None:
    left, right = stream_pair()
    sender, receiver = PlainFrameChannel(left), PlainFrameChannel(right)
    assert isinstance(sender, FrameChannel)
    await sender.send(b"one")
    await sender.send(memoryview(b"two!"))
    buf = bytearray(16)
    assert await receiver.recv() == b"one"
    assert await receiver.recv_into(buf) == 4 and buf[:4] == b"two!"
    await sender.aclose()
    assert await receiver.recv() == b""
    assert await receiver.recv_into(buf) == 0
    assert sender.bytes_sent == receiver.bytes_received == 3 * 5 + 3 + 4


def plain_pair(max_frame_size: int) -> tuple[PlainFrameChannel, PlainFrameChannel]:
    left, right = stream_pair()
    return (PlainFrameChannel(left, max_frame_size=max_frame_size),
            PlainFrameChannel(right, max_frame_size=max_frame_size))


@pytest.mark.parametrize("check", FRAME_CHANNEL_CHECKS, ids=lambda c: c.__name__)
async def test_the_plain_frame_channel_meets_the_frame_channel_contract(check: Check) -> None:
    await check(plain_pair)


async def test_plain_frame_over_the_limit_is_refused_from_its_header() -> None:
    stream = ScriptedStream(struct.pack(">IB", 1 << 30, 0))
    with pytest.raises(ProtocolError) as exc:
        await PlainFrameChannel(stream, max_frame_size=1024).recv()
    assert reason_of(exc) is Reason.TOO_LARGE


async def test_plain_frame_larger_than_the_buffer_is_refused_before_reading() -> None:
    stream = ScriptedStream(struct.pack(">IB", 100, 0) + b"x" * 100)
    with pytest.raises(ProtocolError) as exc:
        await PlainFrameChannel(stream).recv_into(bytearray(10))
    assert reason_of(exc) is Reason.BAD_SIZE
    assert stream.pos == 5


async def test_plain_frame_cut_short_is_truncated() -> None:
    with pytest.raises(ProtocolError) as exc:
        await PlainFrameChannel(ScriptedStream(struct.pack(">IB", 10, 0) + b"abc")).recv()
    assert reason_of(exc) is Reason.TRUNCATED


async def test_plain_stream_ending_without_close_marker_is_closed_not_clean() -> None:
    with pytest.raises(ProtocolError) as exc:
        await PlainFrameChannel(ScriptedStream(b"")).recv()
    assert reason_of(exc) is Reason.CLOSED


async def test_plain_frame_of_unknown_kind_is_malformed() -> None:
    with pytest.raises(ProtocolError) as exc:
        await PlainFrameChannel(ScriptedStream(struct.pack(">IB", 3, 9) + b"abc")).recv()
    assert reason_of(exc) is Reason.MALFORMED


async def test_plain_send_refuses_empty_and_oversized_frames() -> None:
    channel = PlainFrameChannel(ScriptedStream(b""), max_frame_size=8)
    with pytest.raises(ValueError):
        await channel.send(b"")
    with pytest.raises(ValueError):
        await channel.send(b"x" * 9)


# ---------------------------------------------------------------------------------------------
# Adapters
# ---------------------------------------------------------------------------------------------


async def test_trio_adapter_turns_a_broken_stream_into_a_protocol_error() -> None:
    a, b = trio.testing.memory_stream_pair()
    await b.aclose()
    stream = TrioByteStream(a)
    assert isinstance(stream, ByteStream)
    with pytest.raises(ProtocolError) as exc:
        for _ in range(3):  # the memory stream notices the closed peer on the next pump
            await stream.write(b"x")
    assert reason_of(exc) is Reason.BROKEN


async def test_libp2p_adapter_maps_eof_to_empty_read_and_reset_to_broken() -> None:
    payload = encode_msg({"a": 1})
    adapter = LibP2PByteStream(FakeNetStream([payload[:3], payload[3:]]))
    assert await recv_msg(adapter) == {"a": 1}
    with pytest.raises(ProtocolError) as exc:
        await recv_msg(adapter)
    assert reason_of(exc) is Reason.CLOSED

    broken = LibP2PByteStream(FakeNetStream([payload[:3]], reset_at_end=True))
    with pytest.raises(ProtocolError) as exc:
        await recv_msg(broken)
    assert reason_of(exc) is Reason.BROKEN


async def test_libp2p_adapter_writes_bytes_and_closes_the_stream() -> None:
    fake = FakeNetStream([])
    adapter = LibP2PByteStream(fake)
    await send_msg(adapter, {"a": 1})
    await adapter.write(memoryview(b"xyz"))
    await adapter.aclose()
    assert fake.writes[0] == encode_msg({"a": 1}) and fake.writes[1] == b"xyz" and fake.closed
