"""p2p/gossip.py: gossipsub without py-libp2p's signed peer record on every RPC, nor an IDONTWANT for every
small message.

Checked against two real hosts built by p2p/host.py, once patched and once with the library as shipped,
so that the test shows the library's habit (a record per RPC) and learns when an upstream release drops it.
"""

from __future__ import annotations

from typing import Any

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V12, GossipSub
from libp2p.pubsub.mcache import default_msg_id_fn
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.tools.anyio_service import background_trio_service

from p2p.gossip import IDONTWANT_MIN_BYTES, idontwant_for_large_messages_only, send_peer_record_once
from p2p.host import build_host

LOOPBACK = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
TOPIC = "starling/test/state"
MESSAGES = 5
DEADLINE_S = 20.0


async def _serve(host: Any, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    async with host.run([LOOPBACK]):
        task_status.started()
        await trio.sleep_forever()


@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched-library"])
async def test_the_signed_peer_record_goes_out_once_per_stream_and_every_message_still_arrives(patched: bool) -> None:
    """The publisher's first RPC on the stream (the hello, written outside ``write_msg``) carries its
    signed peer record, and the subscriber stores it; the RPCs that follow (5 messages, subscriptions)
    carry none, and every message arrives. The library as shipped attaches the record (about 200 bytes,
    signed) to every RPC."""
    hosts = [build_host(create_new_key_pair()) for _ in range(2)]
    written: list[bool] = []  # per RPC the publisher wrote after its hello: did it carry a record?
    async with trio.open_nursery() as nursery:
        for host in hosts:
            await nursery.start(_serve, host)
        pubsubs = []
        for host in hosts:
            router = GossipSub(protocols=[PROTOCOL_ID_V12], degree=6, degree_low=4, degree_high=12,
                               heartbeat_initial_delay=0.1, heartbeat_interval=1)
            pubsub = Pubsub(host, router)
            if patched:
                send_peer_record_once(pubsub)
            pubsubs.append(pubsub)
            await nursery.start(_run_service, pubsub, router)
        publisher, subscriber = pubsubs
        inner = publisher.write_msg

        async def recording(stream: Any, rpc: Any) -> bool:
            ok = await inner(stream, rpc)
            written.append(rpc.HasField("senderRecord"))
            return ok

        publisher.write_msg = recording
        subscription = await subscriber.subscribe(TOPIC)
        with trio.fail_after(DEADLINE_S):
            await hosts[0].connect(info_from_p2p_addr(hosts[1].get_addrs()[0]))
            while hosts[1].get_id() not in publisher.peer_topics.get(TOPIC, set()):
                await trio.sleep(0.05)
            for i in range(MESSAGES):
                await publisher.publish(TOPIC, f"record {i}".encode())
            got = [(await subscription.get()).data for _ in range(MESSAGES)]
        assert got == [f"record {i}".encode() for i in range(MESSAGES)]
        assert hosts[1].get_peerstore().get_peer_record(hosts[0].get_id()) is not None
        with_record = sum(written)
        assert len(written) >= MESSAGES
        assert with_record == (0 if patched else len(written)), written
        nursery.cancel_scope.cancel()


async def _run_service(pubsub: Pubsub, router: GossipSub, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    async with background_trio_service(pubsub), background_trio_service(router):
        await pubsub.wait_until_ready()
        task_status.started()
        await trio.sleep_forever()


async def test_no_idontwant_is_sent_for_a_message_under_a_kibibyte_and_one_is_for_a_larger_one() -> None:
    """py-libp2p sends an IDONTWANT to every mesh peer for every message it receives: for a member record of
    a few hundred bytes a control RPC per peer as large as the duplicate it might save (and 23% of an idle
    daemon's CPU with 16 daemons). go-libp2p's threshold is 1 KiB; the router's own message cache says the
    size (real GossipSub router, real message IDs)."""
    router = GossipSub(protocols=[PROTOCOL_ID_V12], degree=6, degree_low=4, degree_high=12)
    emitted: list[bytes] = []

    async def record(msg_id: bytes, topic_ids: Any) -> None:
        emitted.append(msg_id)

    router._emit_idontwant_for_message = record  # type: ignore[method-assign]
    idontwant_for_large_messages_only(router)
    ids = {}
    for name, size in (("small", 400), ("large", IDONTWANT_MIN_BYTES + 100)):
        message = rpc_pb2.Message(from_id=b"\x00\x05peer", seqno=name.encode(), data=b"x" * size, topicIDs=[TOPIC])
        router.mcache.put(message)
        ids[name] = default_msg_id_fn(message)
        await router._emit_idontwant_for_message(ids[name], [TOPIC])
    await router._emit_idontwant_for_message(b"not in the cache", [TOPIC])  # unknown size: sent as before
    assert emitted == [ids["large"], b"not in the cache"]
