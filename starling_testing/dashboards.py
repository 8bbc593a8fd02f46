"""Reading back what the daemon wrote for the dashboards, as the tools would: TensorBoard's event files with
tensorboard's own reader, an offline W&B run by decoding its `.wandb` file."""

from __future__ import annotations

import struct
from pathlib import Path

# A `.wandb` file: a 7-byte header (":W&B", a magic and a version), then LevelDB log blocks of 32 KiB; each
# record is a 7-byte header (CRC, length, type: 1 full, 2 first, 3 middle, 4 last) and a protobuf `Record`.
_HEADER = 7
_BLOCK = 32 * 1024


def wandb_history(directory: Path) -> list[tuple[int, dict[str, float]]]:
    """(step, {key: value}) of every history record of the one offline run under `directory`/wandb."""
    from wandb.proto import wandb_internal_pb2 as pb

    [path] = list(directory.glob("wandb/offline-run-*/run-*.wandb"))
    raw = path.read_bytes()
    assert raw[:4] == b":W&B", f"{path} is not a W&B run file"
    records, pending, pos = [], b"", _HEADER
    while pos + _HEADER <= len(raw):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + _HEADER])
        if kind == 0:  # the zero padding at a block's end
            pos += left
            continue
        data = raw[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 1:
            records.append(data)
        elif kind == 2:
            pending = data
        elif kind == 3:
            pending += data
        elif kind == 4:
            records.append(pending + data)
    out = []
    for data in records:
        record = pb.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            values = {item.key or "/".join(item.nested_key): float(item.value_json) for item in record.history.item
                      if not (item.key or "/".join(item.nested_key)).startswith("_")}
            out.append((record.history.step.num, values))
    return out
