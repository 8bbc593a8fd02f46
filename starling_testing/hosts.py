"""Real py-libp2p hosts on 127.0.0.1 for tests and benches that need a protocol over a real connection."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import multiaddr
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr

from p2p.host import build_host

LOOPBACK = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]


async def connected_pair(stack: AsyncExitStack, handlers: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """A server host (serving `handlers`: protocol id -> stream handler) and a client host connected to it,
    both running until `stack` closes."""
    server, client = build_host(create_new_key_pair()), build_host(create_new_key_pair())
    for h in (server, client):
        await stack.enter_async_context(h.run(LOOPBACK))
    for protocol, handler in (handlers or {}).items():
        server.set_stream_handler(protocol, handler)
    await client.connect(info_from_p2p_addr(server.get_addrs()[0]))
    return server, client
