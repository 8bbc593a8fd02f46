"""The punched side channel (p2p/punch.py) in the network lab: two hosts, each behind its own NAT, open one
TCP connection by connecting to each other at once, authenticate it as a data-path session and move a
tensor both ways over it; where the NATs do not allow it, both give up within the deadline with a clear
reason (the exchange then keeps the libp2p stream)."""

from __future__ import annotations

import pytest

from starling_testing.netlab import Host, Lab, NatStyle, Proc

PEER = r"""
import sys, trio, torch
from p2p.datapath import Role, SessionKeys, open_punched
from p2p.punch import PunchSocket, simultaneous_open
from protocols.codec import ChunkPlan, get_codec, recv_tensor_blocking, send_tensor_blocking
from p2p.wire import ProtocolError

role, my_port, peer_ip, peer_port, seconds = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
torch.set_num_threads(1)
sid, k_ir, k_ri = b"s" * 16, b"i" * 32, b"r" * 32
keys = (SessionKeys(sid, Role.INITIATOR, k_ir, k_ri) if role == "initiator"
        else SessionKeys(sid, Role.RESPONDER, k_ri, k_ir))

async def main():
    with PunchSocket(my_port) as local:
        print("bound", local.port, flush=True)
        try:
            stream = await simultaneous_open(local, (peer_ip, peer_port), timeout=seconds)
        except ProtocolError as e:
            print("no-punch", e.reason.value, e, flush=True)
            return
        channel = await open_punched(stream, keys, timeout=10)
        mine = torch.arange(300_000, dtype=torch.float32) * (1 if role == "initiator" else -1)
        theirs = torch.empty_like(mine)
        plan = ChunkPlan.for_frame_size(mine.numel(), get_codec("fp32"))
        await channel.run_in_threads(lambda io: send_tensor_blocking(io.send, mine, plan),
                                     lambda io: recv_tensor_blocking(io.recv_into, theirs, plan))
        await channel.aclose()
        expected = torch.arange(300_000, dtype=torch.float32) * (-1 if role == "initiator" else 1)
        print("punched", "intact" if torch.equal(theirs, expected) else "corrupt", flush=True)

trio.run(main)
"""


def start(host: Host, role: str, port: int, peer_ip: str, peer_port: int, seconds: float) -> Proc:
    proc = host.spawn_python(PEER, role, str(port), peer_ip, str(peer_port), str(seconds))
    proc.wait_for(r"^bound", timeout=30)
    return proc


def outcome(proc: Proc) -> str:
    proc.wait(40)
    return proc.output().strip().splitlines()[-1]


@pytest.mark.parametrize("style", ["home", "hostile"])
def test_a_punched_side_channel_connects_through_home_nats_only(lab: Lab, style: NatStyle) -> None:
    nat1, nat2 = lab.nat("nat1", style=style), lab.nat("nat2", style=style)
    a, b = lab.private_host("a", nat1), lab.private_host("b", nat2)
    seconds = 8.0 if style == "home" else 2.0  # a success ends early; a failure waits out its deadline
    pa = start(a, "initiator", 41001, nat2.ip, 41002, seconds)  # home NATs keep the source port
    pb = start(b, "responder", 41002, nat1.ip, 41001, seconds)
    if style == "home":
        assert (outcome(pa), outcome(pb)) == ("punched intact", "punched intact")
    else:
        for proc in (pa, pb):
            last = outcome(proc)
            assert last.startswith("no-punch broken") and "hole punch from port 4100" in last, proc.output()
