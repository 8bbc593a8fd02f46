"""`sync.compression = "auto"`: which preset (protocols/compress.py) the initiator of an exchange uses.

Why a choice at all: no preset is best everywhere. At equal outer steps `medium` (0.44 B/param) costs
about 0.21 nats against bf16 `none` (4 B/param), so on a link that moves a bf16 exchange within an outer
step compression only loses. Over a 0.4 Mbit/s link a bf16 exchange took 70-80 s against 4.6 s of compute
per outer step, each outer step stretched over ~1,000 inner steps instead of ~100, and at equal wall time
`medium` was 0.38 nats better (docs/benchmarks.md, "Compression" and "Over slow links"). What decides is the
ratio of wire time to compute time, and the daemon measures both: each partner's rate while bytes flow
(node/averaging/averager.py, `_learn_rate`) and the outer step's compute period (the pace).

The rule (`choose_compression`): the least compressed preset whose predicted transfer fits in `STRETCH` (2)
periods. Why 2 and not 1: the worker never waits for a transfer (it overlaps the next outer step), so a
transfer a little longer than the period only makes that outer step a little staler, while one more level
of compression costs loss at every step. Measured at 0.4 Mbit/s (docs/benchmarks.md, "Over slow links"):
`medium`, whose exchanges took 1.2-1.5 periods, reached 2.260 where `high` (well within one period) reached
2.346 and bf16 `none` (16 periods) 2.644. A preset less compressed than the one used last with that partner
must fit in half that budget (`RELAX_SHARE`), so that a rate measured around the threshold does not flip the
preset at every step.
Without a measured rate, or without a known period, it is `none`: a bf16 transfer is what measures a link
best (small compressed transfers underestimate it where latency dominates), and an unknown period gives
nothing to compare against. Groups of four always use `none` (sync_config.py: a lossy preset needs pairs).

Pure and numpy only: the averager calls it per exchange and the tests call it alone.
"""

from __future__ import annotations

from protocols.compress import PRESETS

__all__ = ["AUTO", "ORDER", "RELAX_SHARE", "STRETCH", "accepts", "choose_compression", "preset_for", "transfer_s"]

AUTO = "auto"  # the `sync.compression` value that lets the initiator choose per exchange
ORDER = ("none", "medium", "high")  # least compressed first: the order the rule tries them in
# A preset fits when its transfer takes at most this many periods (overlapped with the next outer step).
STRETCH = 2.0
# A preset less compressed than the last one must fit in this share of that budget (hysteresis).
RELAX_SHARE = 0.5


def transfer_s(preset: str, numel: int, rate_bps: float, wire_dtype: str = "bf16") -> float:
    """Predicted seconds for one exchange's transfer under `preset`: each side sends
    `bytes_per_param x numel` while the other sends as much, and `rate_bps` is the partner's rate *each way*
    (node/averaging/averager.py, `_learn_rate`: the bytes of both directions over the time they flowed, halved), so
    the transfer takes one side's bytes over that rate. Framing and the handshake are left out."""
    return PRESETS[preset].bytes_per_param(numel, wire_dtype) * numel / rate_bps


def choose_compression(
    *,
    rate_bps: float | None,
    period_s: float,
    numel: int,
    previous: str | None = None,
    group_size: int = 2,
    wire_dtype: str = "bf16",
) -> str:
    """The preset for the next exchange with one partner.

    `rate_bps`: the partner's measured rate each way (or our typical one; None: never measured).
    `period_s`: compute seconds of an outer step (H inner steps; 0 or less: unknown).
    `previous`: the preset of the last exchange this node chose for that partner (None: none yet).
    """
    if group_size != 2 or rate_bps is None or rate_bps <= 0 or period_s <= 0 or numel <= 0:
        return "none"
    last = ORDER.index(previous) if previous in ORDER else 0
    for rank, preset in enumerate(ORDER):
        budget = STRETCH * period_s * (RELAX_SHARE if rank < last else 1.0)
        if transfer_s(preset, numel, rate_bps, wire_dtype) <= budget:
            return preset
    return ORDER[-1]


def preset_for(
    compression: str,
    *,
    stage: int,
    link_rate_bps: float | None,
    typical_rate_bps: float | None,
    period_s: float,
    numel: int,
    previous: str | None,
    group_size: int,
    wire_dtype: str,
) -> str:
    """The preset an initiator asks a partner to exchange with: `compression` (`sync.compression`) where it
    is a fixed preset; with `auto`, `none` in a group's second round (whatever the link: a lossy preset
    needs pairs), else `choose_compression` on the partner's measured rate, or on our typical rate over all
    partners (`typical_rate_bps`) while the partner's is not measured yet."""
    if compression != AUTO:
        return compression
    if stage != 1:
        return "none"
    return choose_compression(
        rate_bps=link_rate_bps if link_rate_bps is not None else typical_rate_bps,
        period_s=period_s,
        numel=numel,
        previous=previous,
        group_size=group_size,
        wire_dtype=wire_dtype,
    )


def accepts(compression: str, group_size: int, name: str) -> bool:
    """Whether a responder on `compression` (`sync.compression`) takes a request for preset `name`: its own
    fixed preset only; with `auto` any known preset the initiator chose (it measured the same link: the
    pair's bottleneck), lossy ones only where groups are pairs (`SyncConfig.validate` says why)."""
    if compression != AUTO:
        return name == compression
    return name in PRESETS and (group_size == 2 or not PRESETS[name].lossy)
