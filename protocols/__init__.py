"""protocols: the wire protocols on the transport, the middle of p2p <- protocols <- node.

Each module is one protocol (its messages, both sides of its exchange), or what they share; a protocol is
used as a module (``from protocols import avg``; ``avg.initiate``, ``avg.respond``):

    avg.py       /starling/avg: one pairwise averaging exchange of (phi, Delta); AvgRequest, TransferResult
    avg_call.py  Ask, Session, Contribution, TransferLimits: what a caller hands avg.initiate and avg.respond
    codec.py     get_codec, WireDtype, TensorCodec: how a flat fp32 array travels (fp32, bf16, int8 blocks)
    lowbit.py    TopKLowBitCodec: top-k with packed indices and 2-bit values (SparseLoCo's class), for Delta
    compress.py  get_compression, Compression: the `sync.compression` presets (top-k Delta, phi fragments)
    state.py     /starling/state: anti-entropy of the swarm state; Replica, LocalInfo, SessionResult
    record.py    MemberRecord, CounterRecord, ManifestRecord, Manifest, SignedRecord: the state's signed records
    hlc.py       HybridLogicalClock, Timestamp: the order of those records
    snapshot.py  /starling/snapshot: a late joiner downloads a donor's weights; SnapshotServer, JoinDownload
    dialback.py  /starling/dialback: reachability checked by peers dialling back; DialbackService, Verdict
    swim.py      /starling/swim: SWIM membership messages (Ping, Ack, Alive, Suspect, ...) and their codec

The names below are importable from the package itself (``from protocols import MemberRecord``); each
module is imported on first use, so ``import protocols`` loads neither numpy (avg, codec, snapshot) nor
libp2p. No module here imports torch: tensors travel as numpy float32 arrays, and torch stays in the
worker process (tests/test_codec.py checks it).
"""

from __future__ import annotations

from p2p.lazy import lazy_exports

_EXPORTS = {
    "AvgRequest": "protocols.avg",
    "TransferResult": "protocols.avg",
    "TensorCodec": "protocols.codec",
    "WireDtype": "protocols.codec",
    "get_codec": "protocols.codec",
    "LocalInfo": "protocols.state",
    "Replica": "protocols.state",
    "SessionResult": "protocols.state",
    "CounterRecord": "protocols.record",
    "Manifest": "protocols.record",
    "ManifestRecord": "protocols.record",
    "MemberRecord": "protocols.record",
    "RecordError": "protocols.record",
    "SignedRecord": "protocols.record",
    "HybridLogicalClock": "protocols.hlc",
    "Timestamp": "protocols.hlc",
    "JoinDownload": "protocols.snapshot",
    "Snapshot": "protocols.snapshot",
    "SnapshotServer": "protocols.snapshot",
    "DialbackService": "protocols.dialback",
    "Verdict": "protocols.dialback",
}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
