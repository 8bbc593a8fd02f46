"""Per-protocol byte counters for bench/membership.py, loaded into each daemon it starts.

Python imports ``sitecustomize`` at start-up from the path, so bench/membership.py puts this folder first
on the daemons' PYTHONPATH and names an output file in ``STARLING_TRAFFIC_OUT``; without that variable
this module does nothing. It wraps, at class level and only in that process:

* ``NetStream.write``: bytes and writes per negotiated protocol (what each protocol hands to its stream);
* ``Yamux._write_frame``: muxer frames (each one Noise message, in practice one TCP segment on a quiet
  link) and, of those, WINDOW_UPDATE frames;
* ``RawConnection.write``: bytes on the TCP connection (after Noise and Yamux framing);
* for gossipsub, the RPCs that carry the sender's signed peer record;
* ``BasicHost.new_stream`` and ``Multiselect.negotiate``: streams this daemon opened, and those peers opened
  that it negotiated, per protocol, and how many of each failed (bench/scale.py sums them over a join: at
  64 daemons the streams queued at the busiest nodes were what slowed the join, issue #24).

The counters are written to the output file every second (atomically, as JSON).

With ``STARLING_PROFILE_OUT`` set (bench/scale.py ``--profile``), it also profiles the daemon's main thread
(the trio loop: everything but the threads trio hands blocking work to) with cProfile on CPU time over a window that the
bench chooses: SIGUSR1 starts the profiler, SIGUSR2 stops it and writes the stats to that file
(``pstats`` format). Nothing is profiled outside the window, so start-up does not dilute the figures.
"""

from __future__ import annotations

import collections
import json
import os
import struct
import threading
import time

OUT = os.environ.get("STARLING_TRAFFIC_OUT")
PROFILE_OUT = os.environ.get("STARLING_PROFILE_OUT")


def _install(out: str) -> None:
    from libp2p.host import basic_host
    from libp2p.network.connection import raw_connection
    from libp2p.network.stream import net_stream
    from libp2p.protocol_muxer import multiselect
    from libp2p.stream_muxer.yamux import yamux

    counts: collections.Counter[str] = collections.Counter()
    stream_write = net_stream.NetStream.write
    frame_write = yamux.Yamux._write_frame
    raw_write = raw_connection.RawConnection.write

    async def counted_stream_write(self, data):  # type: ignore[no-untyped-def]
        protocol = str(self.get_protocol())
        counts[f"bytes {protocol}"] += len(data)
        counts[f"writes {protocol}"] += 1
        if "meshsub" in protocol and b"\x22" in data:  # field 4 (senderRecord), length-delimited
            counts["gossip rpcs with a peer record"] += _has_peer_record(data)
        return await stream_write(self, data)

    async def counted_frame(self, data):  # type: ignore[no-untyped-def]
        counts["frames"] += 1
        if len(data) >= yamux.HEADER_SIZE and struct.unpack(yamux.YAMUX_HEADER_FORMAT, data[:yamux.HEADER_SIZE])[1] \
                == yamux.TYPE_WINDOW_UPDATE:
            counts["window updates"] += 1
        return await frame_write(self, data)

    async def counted_raw(self, data):  # type: ignore[no-untyped-def]
        counts["tcp bytes"] += len(data)
        return await raw_write(self, data)

    new_stream = basic_host.BasicHost.new_stream
    negotiate = multiselect.Multiselect.negotiate

    async def counted_new_stream(self, peer_id, protocol_ids, *args, **kwargs):  # type: ignore[no-untyped-def]
        protocol = str(protocol_ids[0]) if protocol_ids else "?"
        try:
            stream = await new_stream(self, peer_id, protocol_ids, *args, **kwargs)
        except BaseException:
            counts[f"streams opened {protocol} failed"] += 1
            raise
        counts[f"streams opened {protocol}"] += 1
        return stream

    async def counted_negotiate(self, communicator, *args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            protocol, handler = await negotiate(self, communicator, *args, **kwargs)
        except BaseException:
            counts["streams accepted failed"] += 1
            raise
        counts[f"streams accepted {protocol}"] += 1
        return protocol, handler

    basic_host.BasicHost.new_stream = counted_new_stream
    multiselect.Multiselect.negotiate = counted_negotiate
    net_stream.NetStream.write = counted_stream_write
    yamux.Yamux._write_frame = counted_frame
    raw_connection.RawConnection.write = counted_raw

    def dump() -> None:
        while True:
            time.sleep(1.0)
            tmp = out + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"t": time.monotonic(), "counts": dict(counts)}, f)
            os.replace(tmp, out)

    threading.Thread(target=dump, name="traffic-probe", daemon=True).start()


def _has_peer_record(data: bytes) -> int:
    """1 if the varint-prefixed gossipsub RPC in ``data`` carries ``senderRecord``."""
    try:
        from libp2p.pubsub.pb import rpc_pb2

        size, shift, i = 0, 0, 0
        while True:
            b = data[i]
            size |= (b & 0x7F) << shift
            i += 1
            if not b & 0x80:
                break
            shift += 7
        return int(rpc_pb2.RPC.FromString(bytes(data[i:i + size])).HasField("senderRecord"))
    except Exception:
        return 0


def _install_profiler(out: str) -> None:
    import cProfile
    import signal

    # On CPU time, not wall time: on a saturated machine a function preempted would be charged for the time
    # other processes ran.
    profiler = cProfile.Profile(time.process_time)

    def start(signum, frame):  # type: ignore[no-untyped-def]
        profiler.enable()

    def stop(signum, frame):  # type: ignore[no-untyped-def]
        profiler.disable()
        profiler.dump_stats(out + ".tmp")
        os.replace(out + ".tmp", out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    if os.environ.get("STARLING_PROFILE_FROM_START"):
        profiler.enable()  # bench/scale.py --profile-join: the start and the join, to SIGUSR2


if OUT:
    _install(OUT)
if PROFILE_OUT:
    _install_profiler(PROFILE_OUT)
