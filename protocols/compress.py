"""`sync.compression`: what of phi and Delta crosses the wire at each outer step, by named preset.

A preset fixes three things, which both partners of an exchange must share (the request names the preset
and the responder refuses another one, node/averaging/averager.py):

* **Delta**: the wire dtype (``none``: ``sync.wire_dtype``, bf16 by default), or blockwise top-k
  (:class:`protocols.codec.TopKCodec`: the ``delta_keep`` largest of every 4096 entries, int8 values).
  What top-k drops is not lost: the worker keeps it in an error-feedback buffer and adds it to its next
  Delta (node/worker/trainer.py, `Trainer.publish`).
* **phi**, for the NoLoCo pull ``gamma * (phi_i - mean phi)``: with ``fragments`` = K > 1 only one
  fragment of the flat model (a contiguous, block-aligned range, fragment ``outer_step mod K`` of the
  initiator, named in the request) crosses the wire, in blockwise int8, and the pull applies on that
  fragment only; the Delta average applies everywhere. Every coordinate is pulled once every K outer steps.
* nothing else: the chunking, the side channel and the bounds (node/averaging/robust.py) are those of every exchange,
  applied to the decoded values.

numpy only: the daemon (which sends) and the worker (which reproduces what was sent, for its error feedback
and its pull) both use these.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocols.codec import DEFAULT_INT8_BLOCK, TensorCodec, get_codec
from protocols.lowbit import TopKLowBitCodec

__all__ = ["BLOCK", "EXPERIMENTAL", "Compression", "MAX_FRAGMENTS", "PRESETS", "get_compression",
           "stream_fragment_range"]

BLOCK = DEFAULT_INT8_BLOCK  # elements per top-k and int8 block; fragment boundaries fall on multiples of it
# `sync.fragments`' most (streaming fragments, issue #23): the request header's bound too (protocols/avg.py).
# 64 cuts even a 1B model into fragments of some 16 M parameters, where one more fragment saves little peak.
MAX_FRAGMENTS = 64


@dataclass(frozen=True)
class Compression:
    """One preset: Delta's top-k (0: the wire dtype, uncompressed), and how many fragments phi is cut into."""

    name: str
    delta_keep: int = 0  # top-k entries kept per BLOCK of Delta (0: no top-k, the wire dtype)
    fragments: int = 1  # phi crosses the wire for one of this many fragments per outer step
    phi_dtype: str = "int8"  # phi's encoding when compressed (fragments > 1 or delta_keep > 0)
    delta_bits: int = 8  # bits per kept Delta value: 8, int8 (TopKCodec); fewer, protocols/lowbit.py's codec
    # The worker applies its own Delta in full and the partner's as the wire carried it; error feedback still
    # keeps what the wire has not carried yet, for the next partner (node/worker/trainer.py,
    # `feed_back_own_in_full`). Nothing on the wire changes: a worker-side rule.
    own_in_full: bool = False

    @property
    def lossy(self) -> bool:
        """Whether this preset replaces the wire dtype (and so needs error feedback and the exact pull)."""
        return self.delta_keep > 0 or self.fragments > 1

    def delta_codec(self, wire_dtype: str) -> TensorCodec:
        if self.delta_keep and self.delta_bits < 8:
            return TopKLowBitCodec(BLOCK, self.delta_keep, self.delta_bits)
        if self.delta_keep:
            return get_codec("topk", int8_block=BLOCK, topk_keep=self.delta_keep)
        return get_codec(wire_dtype, int8_block=BLOCK)

    def phi_codec(self, wire_dtype: str) -> TensorCodec:
        return get_codec(self.phi_dtype if self.lossy else wire_dtype, int8_block=BLOCK)

    def fragment_of(self, outer_step: int) -> int:
        """The fragment an initiator at `outer_step` exchanges (rotates, so every coordinate gets its turn)."""
        return outer_step % self.fragments

    def fragment_range(self, numel: int, index: int) -> tuple[int, int]:
        """Elements [lo, hi) of fragment `index`: K contiguous ranges of whole blocks (the last may be short,
        or empty for a model of fewer blocks than fragments). ``ValueError`` for an index out of range."""
        if not 0 <= index < self.fragments:
            raise ValueError(f"fragment {index} out of range for {self.fragments} fragments")
        blocks = -(-numel // BLOCK)
        per = -(-blocks // self.fragments) * BLOCK
        lo = min(numel, index * per)
        return lo, min(numel, lo + per)

    def bytes_per_param(self, numel: int, wire_dtype: str = "bf16") -> float:
        """Payload bytes per parameter one side sends per outer step (phi and Delta; framing excluded),
        for the fragment of average size."""
        delta = self.delta_codec(wire_dtype).encoded_size(numel)
        phi = sum(self.phi_codec(wire_dtype).encoded_size(hi - lo)
                  for lo, hi in (self.fragment_range(numel, f) for f in range(self.fragments))) / self.fragments
        return (delta + phi) / max(numel, 1)


#: The presets: ``none`` is the exchange as it was (both tensors in ``sync.wire_dtype``, bf16 by default, 4 B/param);
#: ``medium`` sends the top 1/16 of Delta and a quarter of phi (0.44 B/param); ``high`` the top 1/64 of Delta and
#: a 32nd of phi (0.08 B/param). Both apply our own Delta in full (`Compression.own_in_full`): plain error
#: feedback, which deferred all but the top entries of it, trained worse than a replica alone (docs/benchmarks.md,
#: "phi for compressed NoLoCo"). docs/benchmarks.md ("Compression") has the losses they reach.
PRESETS: dict[str, Compression] = {
    "none": Compression("none"),
    "medium": Compression("medium", delta_keep=256, fragments=4, own_in_full=True),
    "high": Compression("high", delta_keep=64, fragments=32, own_in_full=True),
}

#: Presets on trial: judged by bench/compression_long.py (which adds one to PRESETS in its own process) before
#: any becomes a `sync.compression` choice; a daemon neither offers nor accepts them. SparseLoCo's Delta (the
#: top 64 or 128 of every 4096 entries, 1.6% or 3.1%, at 2 bits with 12-bit indices: 0.029 or 0.057 B/param)
#: with `high`'s phi (int8 on 1 of 32 fragments, 0.031): 0.060 and 0.088 B/param each way in all; `k64q2` and
#: `k128q2` with plain error feedback, the `-own` ones applying our own Delta in full as `medium` and `high` do;
#: `-f16`, `-f8` and `-f4` spend more of the bytes on phi's pull (1 of 16, 8 or 4 fragments: 0.092, 0.154 and
#: 0.279 B/param; `-f4` to read beside `medium`'s 0.44).
#: `k64q2-own-f1` and `frag16-only` are `k64q2-own-f16`'s two halves apart (its Delta with phi whole in int8; its
#: phi with Delta whole in the wire dtype), to tell what each costs over the long run.
#: `topk-only` and `frag-only` are the two halves of `medium` (docs/benchmarks.md, "Compression": its ablation).
#: `medium-deferred` and `high-deferred` are `medium` and `high` as they were until the own Delta in full
#: became theirs (plain error feedback): the rows recorded before it, kept so that they can be rerun.
EXPERIMENTAL: dict[str, Compression] = {
    "k64q2": Compression("k64q2", delta_keep=64, fragments=32, delta_bits=2),
    "k128q2": Compression("k128q2", delta_keep=128, fragments=32, delta_bits=2),
    "k64q2-own": Compression("k64q2-own", delta_keep=64, fragments=32, delta_bits=2, own_in_full=True),
    "k128q2-own": Compression("k128q2-own", delta_keep=128, fragments=32, delta_bits=2, own_in_full=True),
    "k64q2-own-f16": Compression("k64q2-own-f16", delta_keep=64, fragments=16, delta_bits=2, own_in_full=True),
    "k64q2-own-f8": Compression("k64q2-own-f8", delta_keep=64, fragments=8, delta_bits=2, own_in_full=True),
    "k64q2-own-f4": Compression("k64q2-own-f4", delta_keep=64, fragments=4, delta_bits=2, own_in_full=True),
    "k64q2-own-f1": Compression("k64q2-own-f1", delta_keep=64, fragments=1, delta_bits=2, own_in_full=True),
    "frag16-only": Compression("frag16-only", delta_keep=0, fragments=16),
    "topk-only": Compression("topk-only", delta_keep=256, fragments=1),
    "frag-only": Compression("frag-only", delta_keep=0, fragments=4),
    "medium-deferred": Compression("medium-deferred", delta_keep=256, fragments=4),
    "high-deferred": Compression("high-deferred", delta_keep=64, fragments=32),
}


def stream_fragment_range(numel: int, index: int, count: int) -> tuple[int, int]:
    """Elements [lo, hi) of streaming fragment `index` of `count` (`sync.fragments`): the same cut as a
    preset's phi fragments (contiguous runs of whole blocks), so a fragment's top-k blocks are the whole
    vector's, and the one rule the worker (node/worker/trainer.py, `set_fragments`) and the daemon
    (node/bridge/supervisor.py) both cut the model by. ``ValueError`` for an index out of range."""
    if not 1 <= count <= MAX_FRAGMENTS:
        raise ValueError(f"{count} streaming fragments: between 1 and {MAX_FRAGMENTS}")
    return Compression("fragments", fragments=count).fragment_range(numel, index)


def get_compression(name: str) -> Compression:
    """The preset called `name`; ``ValueError`` naming the known ones otherwise (config, requests)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown compression {name!r}; expected one of {', '.join(PRESETS)}") from None
