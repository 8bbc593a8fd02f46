"""One averaging exchange at a time between two network-lab hosts, its phases timed: what latency costs it.

A responder host serves protocols/avg.py's exchange (with a side-channel listener) and an initiator host
asks it `--exchanges` times over one libp2p connection, as two daemons' averagers do once paired, with the
early dial of the side channel to the port of the last answer (`avg.preconnect`) and, once the responder
confirmed the protocol, the request written with the stream's proposal (`p2p.multiselect.open_optimistic`),
as the averager does. Each exchange prints one
JSON line: its seconds from the stream's opening to the result, and the phases' ends (stream open,
answer, result). `bench/exchange_rtt.py` and tests/test_exchange_rtt.py read them; at a known RTT the
seconds over the RTT are the round trips the exchange takes.

    ip netns exec A python -m starling_testing.exchange_lab respond PORT
    ip netns exec B python -m starling_testing.exchange_lab initiate IP PORT PEER_ID NUMEL EXCHANGES
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable

import multiaddr
import numpy as np
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr

from p2p.datapath import DataPathListener
from p2p.host import build_host
from protocols import avg

try:  # the request written with the stream's proposal (a tree before it, `bench/exchange_rtt.py --before`, has none)
    from p2p.multiselect import open_optimistic, speaks
except ImportError:
    open_optimistic = speaks = None  # type: ignore[assignment]

READY = "exchange lab ready"
RESULT = "exchange result "


def tensors(numel: int, seed: int) -> avg.Tensors:
    rng = np.random.default_rng(seed)
    return avg.Tensors(rng.standard_normal(numel, dtype=np.float32), rng.standard_normal(numel, dtype=np.float32) * 0.01,
                       np.zeros(numel, np.float32), np.zeros(numel, np.float32))  # fmt: skip


def request_fields(outer_step: int) -> dict[str, object]:
    return {"outer_step": outer_step, "manifest_hash": "lab", "layout_hash": "lab", "wire_dtype": "bf16",
            "int8_block": 4096, "datapath": True, "stage": 1, "compression": "none", "fragment": 0,
            "inner_steps": 1, "samples": 1, "waited_ms": 0, "members": 1}  # fmt: skip


# This tree's `avg.initiate` / `avg.respond` take an `Ask`, a `Session` and a `Contribution` (issue #53); a tree
# from before them took loose keywords. Both are called here, for bench/exchange_rtt.py's `--before`.
TYPED = hasattr(avg, "Session")


async def initiate_one(stream: object, outer_step: int, data: avg.Tensors, local: bytes, remote: bytes, ip: str,
                       on_accept: Callable[[avg.AvgAnswer], bool], early: object) -> avg.TransferResult:
    extra = {"early": early} if early is not None else {}
    if TYPED:
        ask = avg.Ask(avg.Contribution(outer_step, inner_steps=1, samples=1), manifest_hash="lab", layout_hash="lab",
                      wire=avg.Wire("bf16"))  # fmt: skip
        session = avg.Session(local, remote, 10, avg.TransferLimits())
        return await avg.initiate(stream, ask, data, session, remote_ip=ip, on_accept=on_accept, **extra)
    return await avg.initiate(stream, request_fields(outer_step), data, local_peer_id=local, remote_peer_id=remote,
                              remote_ip=ip, handshake_timeout=10, limits=avg.TransferLimits(), on_accept=on_accept,
                              **extra)  # type: ignore[call-arg]  # fmt: skip


async def respond_one(stream: object, request: avg.AvgRequest, listener: DataPathListener, local: bytes,
                      remote: bytes) -> avg.TransferResult:
    data = tensors(request.numel, 2)
    if TYPED:
        session = avg.Session(local, remote, 10, avg.TransferLimits())
        ours = avg.Contribution(request.outer_step, inner_steps=1, samples=1)
        return await avg.respond(stream, request, data, session, ours, listener=listener)
    return await avg.respond(stream, request, data, outer_step=request.outer_step, listener=listener,  # type: ignore[call-arg]
                             local_peer_id=local, remote_peer_id=remote, handshake_timeout=10,
                             limits=avg.TransferLimits(), inner_steps=1, samples=1)  # fmt: skip


def early_dial(hint: tuple[str, int] | None) -> contextlib.AbstractAsyncContextManager:
    """`avg.preconnect` where this tree has it; nothing on a tree from before it (bench/exchange_rtt.py
    `--before` runs this file against an older checkout, for the figures before and after in one run)."""
    dial = getattr(avg, "preconnect", None)
    return dial(hint, timeout=avg.DATAPATH_CONNECT_S) if dial is not None else contextlib.nullcontext()


async def respond(port: int) -> None:
    host = build_host(create_new_key_pair())
    listener = DataPathListener("0.0.0.0", 0)
    async with host.run([multiaddr.Multiaddr(f"/ip4/0.0.0.0/tcp/{port}")]), trio.open_nursery() as nursery:
        await nursery.start(listener.serve)

        async def handle(stream) -> None:  # type: ignore[no-untyped-def]
            try:
                request = await avg.read_request(stream, 10)
                await respond_one(stream, request, listener, host.get_id().to_bytes(),
                                  stream.muxed_conn.peer_id.to_bytes())
            except Exception as e:  # one failed exchange is a line of output, not the end of the server
                print(f"responder: exchange failed: {e!r}", flush=True)
            finally:
                await stream.close()

        host.set_stream_handler(avg.PROTOCOL_ID, handle)
        print(READY, host.get_id().to_base58(), flush=True)
        await trio.sleep_forever()


async def initiate(ip: str, port: int, peer: str, numel: int, exchanges: int) -> None:
    host = build_host(create_new_key_pair())
    async with host.run([multiaddr.Multiaddr("/ip4/0.0.0.0/tcp/0")]):
        with trio.fail_after(30):
            await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(f"/ip4/{ip}/tcp/{port}/p2p/{peer}")))
        print(READY, flush=True)
        hint: tuple[str, int] | None = None
        speaks_latest = False
        for i in range(exchanges):
            await trio.sleep(0.5)  # apart, as outer steps are
            marks: dict[str, float] = {}
            began = trio.current_time()

            def accepted(answer: avg.AvgAnswer, marks: dict[str, float] = marks, began: float = began) -> bool:
                nonlocal hint
                marks["answer"] = trio.current_time() - began
                hint = (ip, answer.datapath_port) if answer.datapath_port else None
                return True

            try:
                with trio.fail_after(60):
                    async with early_dial(hint) as early:
                        if speaks_latest and open_optimistic is not None:
                            stream = await open_optimistic(host, ID.from_base58(peer), avg.PROTOCOL_ID)
                        else:
                            stream = await host.new_stream(ID.from_base58(peer), [avg.PROTOCOL_ID])
                        marks["stream"] = trio.current_time() - began
                        try:
                            result = await initiate_one(stream, i + 1, tensors(numel, 1), host.get_id().to_bytes(),
                                                        ID.from_base58(peer).to_bytes(), ip, accepted, early)
                        finally:
                            speaks_latest = speaks is not None and speaks(stream, avg.PROTOCOL_ID)
                            await stream.close()
                marks["result"] = trio.current_time() - began
                dialled = early is not None and early.address is not None
                line = {"i": i, "seconds": marks["result"], "path": result.path, "preconnected": dialled,
                        "bytes_each_way": result.bytes_sent, **{f"{k}_s": v for k, v in marks.items()}}  # fmt: skip
            except Exception as e:
                line = {"i": i, "error": repr(e)}
            print(RESULT + json.dumps(line), flush=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["respond"] and len(argv) == 2:
        trio.run(respond, int(argv[1]))
    elif argv[:1] == ["initiate"] and len(argv) == 6:
        trio.run(initiate, argv[1], int(argv[2]), argv[3], int(argv[4]), int(argv[5]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
