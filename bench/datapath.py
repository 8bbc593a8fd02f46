"""Throughput of the fast data path against a raw TCP socket, measured in the same run.

A receiver child process and this (sender) process move the same number of bytes over 127.0.0.1:

* ``raw``      -- plain trio TCP: ``send_all`` of 1 MiB buffers, ``recv_into`` on the other side.
* ``secure``   -- :class:`p2p.datapath.SecureChannel` (AES-256-GCM, 1 MiB frames), opened through a real
  :class:`~p2p.datapath.DataPathListener` handshake.
* ``tensor-*`` -- a flat fp32 array of the same byte size sent with ``send_tensor``/``recv_tensor``
  over a SecureChannel for each wire dtype (encode + encrypt + decrypt + decode), reported both as
  fp32-equivalent "model" MB/s and as MB/s on the wire.

Trials of the modes are interleaved and each is repeated, so background load hits them alike; the
median per mode is reported, with ratios against ``raw``. CPU seconds per GB (sender and receiver
process time) show what the encryption costs beyond the socket copies.

Usage: python bench/datapath.py [--mib 256] [--repeat 3] [--no-tensors]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing.connection import Connection

import numpy as np
import trio

from p2p.datapath import (
    DataPathListener,
    KeyAgreement,
    Role,
    SessionKeys,
    connect_datapath,
    new_session_id,
)
from protocols.codec import ChunkPlan, get_codec, recv_tensor, send_tensor

MiB = 1 << 20
FRAME = MiB
HOST = "127.0.0.1"


def make_keys() -> tuple[SessionKeys, SessionKeys]:
    """Both halves of a key agreement (in the daemon this runs over the libp2p control stream)."""
    a, b = KeyAgreement(), KeyAgreement()
    sid = new_session_id()
    common = dict(session_id=sid, protocol_id="/starling/avg/1.0.0")
    ki = a.derive(
        role=Role.INITIATOR, peer_public_key=b.public_key, local_peer_id=b"A", remote_peer_id=b"B", **common
    )
    kr = b.derive(
        role=Role.RESPONDER, peer_public_key=a.public_key, local_peer_id=b"B", remote_peer_id=b"A", **common
    )
    return ki, kr


# --------------------------------------------------------------------------------------------------
# Receiver (child process)
# --------------------------------------------------------------------------------------------------


def receiver_process(conn: Connection) -> None:
    while True:
        cmd = conn.recv()
        if cmd is None:
            return
        trio.run(receive_one, cmd, conn)


async def receive_one(cmd: dict, conn: Connection) -> None:
    mode, nbytes = cmd["mode"], cmd["nbytes"]
    if mode == "raw":
        listeners = await trio.open_tcp_listeners(0, host=HOST)
        conn.send(listeners[0].socket.getsockname()[1])
        stream = await listeners[0].accept()
        cpu0 = time.process_time()
        buf = memoryview(bytearray(FRAME))
        got = 0
        while got < nbytes:
            n = await stream.socket.recv_into(buf)
            if n == 0:
                raise RuntimeError("sender stopped early")
            got += n
        await stream.send_all(b"k")
        cpu = time.process_time() - cpu0
        await stream.aclose()
        await listeners[0].aclose()
        conn.send(cpu)
        return

    out = plan = None
    if mode.startswith("tensor-"):
        # Allocated and paged in before the clock starts: in the daemon this is a reused slot.
        out = np.empty(nbytes // 4, dtype=np.float32)
        out.fill(0.0)
        plan = ChunkPlan.for_frame_size(out.size, get_codec(cmd["dtype"]), FRAME)
    listener = DataPathListener(HOST, 0)
    async with trio.open_nursery() as nursery:
        await nursery.start(listener.serve)
        async with listener.expect(cmd["keys"], timeout=30) as pending:
            conn.send(listener.port)
            channel = await pending.wait()
        cpu0 = time.process_time()
        if mode == "secure":
            buf = bytearray(FRAME)
            got = 0
            while got < nbytes:
                n = await channel.recv_into(buf)
                if n == 0:
                    raise RuntimeError("sender stopped early")
                got += n
        else:
            await recv_tensor(channel, out, plan)
        await channel.send(b"k")
        cpu = time.process_time() - cpu0
        await channel.aclose()
        nursery.cancel_scope.cancel()
    conn.send(cpu)


# --------------------------------------------------------------------------------------------------
# Sender (this process)
# --------------------------------------------------------------------------------------------------


async def send_raw(port: int, nbytes: int) -> tuple[float, float]:
    payload = os.urandom(FRAME)
    stream = await trio.open_tcp_stream(HOST, port)
    cpu0, t0 = time.process_time(), time.perf_counter()
    sent = 0
    while sent < nbytes:
        await stream.send_all(payload)
        sent += len(payload)
    assert await stream.receive_some(1) == b"k"
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    await stream.aclose()
    return elapsed, cpu


async def send_secure(
    port: int, nbytes: int, keys: SessionKeys, tensor: np.ndarray | None, dtype: str | None
) -> tuple[float, float]:
    channel = await connect_datapath((HOST, port), keys, timeout=30)
    cpu0, t0 = time.process_time(), time.perf_counter()
    if tensor is None or dtype is None:
        payload = os.urandom(FRAME)
        sent = 0
        while sent < nbytes:
            await channel.send(payload)
            sent += len(payload)
    else:
        codec = get_codec(dtype)
        await send_tensor(channel, tensor, ChunkPlan.for_frame_size(tensor.size, codec, FRAME))
    assert await channel.recv() == b"k"
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    await channel.aclose()
    return elapsed, cpu


def wire_bytes(mode: str, nbytes: int) -> int:
    if not mode.startswith("tensor-"):
        return nbytes
    codec = get_codec(mode.removeprefix("tensor-"))
    return ChunkPlan.for_frame_size(nbytes // 4, codec, FRAME).total_bytes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=256, help="bytes per trial, in MiB (default 256)")
    parser.add_argument("--repeat", type=int, default=3, help="trials per mode (default 3)")
    parser.add_argument("--no-tensors", action="store_true", help="skip the tensor codec modes")
    args = parser.parse_args()
    nbytes = args.mib * MiB

    modes = ["raw", "secure"]
    tensor = None
    if not args.no_tensors:
        tensor = np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32)
        modes += ["tensor-fp32", "tensor-bf16", "tensor-int8"]

    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=receiver_process, args=(child_conn,), daemon=True)
    child.start()
    results: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
    try:
        for _ in range(args.repeat):
            for mode in modes:
                ki, kr = make_keys()
                dtype = mode.removeprefix("tensor-") if mode.startswith("tensor-") else None
                parent_conn.send({"mode": mode, "nbytes": nbytes, "keys": kr, "dtype": dtype})
                port = parent_conn.recv()
                if mode == "raw":
                    elapsed, cpu = trio.run(send_raw, port, nbytes)
                else:
                    elapsed, cpu = trio.run(send_secure, port, nbytes, ki, tensor, dtype)
                child_cpu = parent_conn.recv()
                results[mode].append((elapsed, cpu, child_cpu))
        parent_conn.send(None)
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.terminate()

    print(
        f"data path throughput, {args.mib} MiB per trial over {HOST}, median of {args.repeat}, {os.cpu_count()} CPUs"
    )
    print(
        f"{'mode':<13} {'model MB/s':>11} {'wire MB/s':>10} {'vs raw':>7} {'send CPU s/GB':>14} {'recv CPU s/GB':>14}"
    )
    raw_rate = statistics.median(nbytes / e for e, _, _ in results["raw"]) / 1e6
    for mode in modes:
        runs = results[mode]
        rate = statistics.median(nbytes / e for e, _, _ in runs) / 1e6
        wire = statistics.median(wire_bytes(mode, nbytes) / e for e, _, _ in runs) / 1e6
        send_cpu = statistics.median(c for _, c, _ in runs) / (nbytes / 1e9)
        recv_cpu = statistics.median(c for _, _, c in runs) / (nbytes / 1e9)
        print(
            f"{mode:<13} {rate:>11.0f} {wire:>10.0f} {rate / raw_rate:>7.2f} {send_cpu:>14.2f} {recv_cpu:>14.2f}"
        )


if __name__ == "__main__":
    main()
