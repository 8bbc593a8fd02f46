"""`sync.compression = "auto"`: which preset (protocols/compress.py) an exchange uses; the slower side's view wins.

Why a choice at all: no preset is best everywhere. At equal outer steps `medium` (0.44 B/param) costs
about 0.21 nats against bf16 `none` (4 B/param; measured with the deferred error feedback it had before
2026-12-07, `medium-deferred` now), so on a link that moves a bf16 exchange within an outer
step compression only loses. Over a 0.4 Mbit/s link a bf16 exchange took 70-80 s against 4.6 s of compute
per outer step, each outer step stretched over ~1,000 inner steps instead of ~100, and at equal wall time
`medium` was 0.38 nats better (docs/benchmarks.md, "Compression" and "Over slow links"). What decides is the
ratio of wire time to compute time, and the daemon measures both: each partner's rate while bytes flow
(node/averaging/averager.py, `_learn_rate`; its bandwidth, the round trips of a transfer taken out by
link_model.py, since no preset changes them) and the outer step's compute period (the pace).

The rule (`choose_compression`): the least compressed preset whose predicted transfer fits in `STRETCH` (2)
periods. Why 2 and not 1: the worker never waits for a transfer (it overlaps the next outer step), so a
transfer a little longer than the period only makes that outer step a little staler, while one more level
of compression costs loss at every step. Measured at 0.4 Mbit/s (docs/benchmarks.md, "Over slow links"):
`medium`, whose exchanges took 1.2-1.5 periods, reached 2.260 where `high` (well within one period) reached
2.346 and bf16 `none` (16 periods) 2.644. A preset less compressed than the one used last with that partner
must fit in half that budget (`RELAX_SHARE`), so that a rate measured around the threshold does not flip the
preset at every step, and it comes back one preset at a time (`high`, then `medium`, then `none`): a rate
measured on a small transfer can be far too high where a token bucket lets a burst through. The rate itself
weighs each transfer by the seconds it flowed (node/averaging/admission.py, `FlowRate`), so the next, bigger
transfer corrects a burst's reading at once instead of halving it. A partner never exchanged with starts
at most one preset less compressed than any exchange this node completed (`first_ask_floor`): its preset is
chosen on our typical rate, which only those transfers measured.
Without any measured rate (a node's first exchange: no partner measured, no typical rate yet) it is the
most compressed preset, `PROBE`: the transfer that teaches the rate must not itself flood a link that may be
slow. It used to be bf16 `none` (a big transfer measures a link best), and in the network lab (bench/wan.py,
one-slow at 0.4 Mbit/s) the trainer behind the 0.08 Mbit/s link spent its first exchange on 1.9 MB each way
that could not finish in the run, and was cut. A probe costs one compressed outer step per node on a fast
link, after which its measured rate relaxes the preset (a probe that completes too fast to time still
counts, as a lower bound: averager.py `_learn_rate`). Without a known period it is `none`, as before: an
unknown period gives nothing to weigh a transfer against (in the daemon the period is known from the first
inner steps, before the first exchange). Groups of four always use `none`
(sync_config.py: a lossy preset needs pairs).

Who decides (`accepts`, `after_refusal`): the initiator names the preset, from *its* view of the link, but
the two ends of a link do not always share one. A trainer behind a slow link knows it (its typical rate
over all partners), while a fast partner that has never completed an exchange with it guesses from its own
fast partners and asks for bf16 `none`: measured in the network lab (bench/wan.py, one link of 0.08 Mbit/s
among 0.4 Mbit/s ones), 1.9 MB each way over 10 kB/s that stalled and held the slow link for minutes, and
the slow trainer averaged almost none of its outer steps. So an `auto` responder applies the same rule
(`preset_for`, on its rate with that initiator, else its typical rate, and its own period) and refuses a
request *less* compressed than its own choice, naming what it wants (`refusal_reason`: "compression
mismatch: wants medium", protocols/avg.py `AnswerCode.COMPRESSION`); anything at least as compressed it
takes. An `auto` initiator so refused asks again at once, in the same pairing window, with the named
preset, or one step more compressed where the answer names none it can read (`wanted_in` reads only a
known preset name in a fixed place), and keeps a named preset as that partner's `previous`, so the next
exchange starts there and the hysteresis above relaxes it only once the link allows (while the partner's
own rate is unmeasured, `previous` is a floor: `preset_for`). The initiator only
ever moves towards more compression within an exchange, so two `auto` nodes that disagree meet in at most
`len(ORDER) - 1` retries, and a hostile responder can make us send less, never loop us. A responder that
has measured no rate at all (and knows its period) wants `PROBE`, as it would ask for itself (a node's first exchange is a probe
whichever side asks: the slow trainer's first one used to be the bf16 a fast partner asked for); one with a
no known period takes any preset, as before; a group's second round is
`none` on both sides; fixed presets are unchanged (a responder on one takes that preset only). A 1.2.0
initiator reads the refusal by its words' prefix as a compression refusal but does not ask again: it pairs
elsewhere that step, while the slow node asking it names its own preset, which an `auto` node takes.

Pure and numpy only: the averager calls it per exchange and the tests call it alone.
"""

from __future__ import annotations

import re

from protocols.compress import PRESETS

__all__ = ["AUTO", "ORDER", "PROBE", "RELAX_SHARE", "STRETCH", "WANTS", "accepts", "after_refusal", "choose_compression",
           "first_ask_floor", "keeps_own_exact", "preset_for", "refusal_reason", "transfer_s", "wanted_in"]

AUTO = "auto"  # the `sync.compression` value that lets the initiator choose per exchange
ORDER = ("none", "medium", "high")  # least compressed first: the order the rule tries them in
PROBE = ORDER[-1]  # the preset of an exchange over a link nothing is known of (no rate measured anywhere)
# A preset fits when its transfer takes at most this many periods (overlapped with the next outer step).
STRETCH = 2.0
# A preset less compressed than the last one must fit in this share of that budget (hysteresis).
RELAX_SHARE = 0.5
# How an `auto` responder's refusal begins: the preset it wants follows at once (`refusal_reason`, `wanted_in`).
# "compression mismatch" is the text 1.2.0 peers read as `AnswerCode.COMPRESSION` (protocols/avg.py).
WANTS = "compression mismatch: wants "
_WANTED = re.compile(r"([a-z]{1,16})(?![a-z])")


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
    if group_size != 2 or numel <= 0 or period_s <= 0:
        return "none"  # (no period: nothing to weigh a transfer against, so nothing a probe would teach)
    if rate_bps is None or rate_bps <= 0:
        return PROBE  # nothing measured anywhere: the cheapest transfer teaches the rate
    last = ORDER.index(previous) if previous in ORDER else 0
    # One preset at a time back towards `none`: the rate that allows it was measured on a smaller transfer,
    # which a token bucket's burst can pass at far more than the link's rate (bench/wan.py, default queue:
    # a 37 kB probe put fast pairs on bf16 over 0.4 Mbit/s); the next preset's bigger transfer measures it.
    for rank, preset in enumerate(ORDER[max(0, last - 1):], start=max(0, last - 1)):
        budget = STRETCH * period_s * (RELAX_SHARE if rank < last else 1.0)
        if transfer_s(preset, numel, rate_bps, wire_dtype) <= budget:
            return preset
    return ORDER[-1]


def keeps_own_exact(compression: str, used: str, *, rate_bps: float | None, period_s: float, numel: int,
                    wire_dtype: str = "bf16") -> bool:
    """Whether, after an exchange under the lossy preset `used`, this node applies its own Delta in full
    instead of the wire's compressed copy plus error feedback (node/worker/trainer.py, `own_exact`): with
    `auto`, where the link as measured now (`rate_bps`, this exchange's transfer included) would relax the
    preset at once (`choose_compression`, hysteresis included). Such an exchange was lossy only because the
    link was not known yet: the probe, or a step of the way back to `none` (one preset at a time).

    Why: error feedback delays what the wire did not carry, and a delay is what a short ramp cannot afford.
    After a lossy exchange the fast weights restart from phi, which holds only the top entries of the
    Delta; the worker re-learns the rest in its next inner steps, and when the residual is finally sent in
    full (the first `none` exchange) it lands on top of that: measured in memory (bench/compression.py
    `--presets none --first high,medium`, the ramp `auto` takes on a fast link, over the Swarm section's 20
    outer steps, seeds 0 and 1), the replicas ended 0.08 nats worse than with `none` throughout (2.023 and
    2.026 against 1.941 and 1.943), and the real daemons' convergence row no better than no communication.
    With the own Delta applied in full on the ramp's exchanges (`--first-own-exact`; the partner still
    gets the compressed copy, as the wire carried it), 1.933 and 1.940: the ramp costs nothing. On a link
    slow enough that the lossy preset stays (`choose_compression` keeps it), and with a fixed preset (the
    operator's choice of a steady lossy wire), error feedback keeps what the wire has not carried yet for
    the next partner, so the residual stays; the own Delta is applied in full there too, by the presets'
    own rule (`Compression.own_in_full`, since 2026-12-07). What `own_exact` adds is no residual at all."""
    if compression != AUTO or used not in ORDER or used == ORDER[0]:
        return False
    if rate_bps is None or rate_bps <= 0 or period_s <= 0:
        return False
    relaxed = choose_compression(rate_bps=rate_bps, period_s=period_s, numel=numel, previous=used,
                                 wire_dtype=wire_dtype)
    return ORDER.index(relaxed) < ORDER.index(used)


def first_ask_floor(widest: str | None) -> str | None:
    """The least compressed preset to ask of (or take from) a partner never exchanged with, given `widest`,
    the least compressed preset of any exchange this node completed (None: none yet, so no floor; the rate
    is then unmeasured too and `choose_compression` probes): one step less compressed than `widest`.

    Why: such a partner's preset is chosen on our typical rate, and that rate was measured on transfers no
    bigger than `widest`'s. One step beyond them is what `choose_compression` allows a measured link (a
    token bucket's burst passes a small transfer at many times the link's rate); more is a guess. Measured
    in bench/wan.py (one-slow at 0.4 Mbit/s): after one `high` probe that passed in a burst, a fast trainer
    asked its next, new partner for bf16 `none`, 3.8 MB that took 54 s of a 180 s run, where `medium` took
    4-5 s."""
    if widest not in ORDER:
        return None
    return ORDER[max(0, ORDER.index(widest) - 1)]


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
    """The preset an initiator asks a partner to exchange with (and an `auto` responder wants at least,
    `accepts`): `compression` (`sync.compression`) where it is a fixed preset; with `auto`, `none` in a
    group's second round (whatever the link: a lossy preset needs pairs), else `choose_compression` on the
    partner's measured rate, or on our typical rate over all partners (`typical_rate_bps`) while the
    partner's is not measured yet. In that case `previous` (the preset last used with that partner, or
    the one it asked for when it refused ours, `after_refusal`) is a floor: our other links say nothing
    of this one, and the partner said what it needs; only a rate measured with it relaxes the preset."""
    if compression != AUTO:
        return compression
    if stage != 1:
        return "none"
    chosen = choose_compression(
        rate_bps=link_rate_bps if link_rate_bps is not None else typical_rate_bps,
        period_s=period_s,
        numel=numel,
        previous=previous,
        group_size=group_size,
        wire_dtype=wire_dtype,
    )
    if link_rate_bps is None and group_size == 2 and previous in ORDER:
        return max(chosen, previous, key=ORDER.index)
    return chosen


def accepts(compression: str, group_size: int, name: str, wants: str = "none") -> bool:
    """Whether a responder on `compression` (`sync.compression`) takes a request for preset `name`: its own
    fixed preset only; with `auto` any known preset at least as compressed as `wants`, the one it would
    choose itself for that initiator (`preset_for`: the slower side's view wins; `none` where it knows
    nothing of the link, so that it takes anything), lossy ones only where groups are pairs
    (`SyncConfig.validate` says why)."""
    if compression != AUTO:
        return name == compression
    if name not in PRESETS or (group_size != 2 and PRESETS[name].lossy):
        return False
    return name not in ORDER or wants not in ORDER or ORDER.index(name) >= ORDER.index(wants)


def refusal_reason(compression: str, group_size: int, name: str, wants: str) -> str:
    """The words of a responder's `AnswerCode.COMPRESSION` refusal of preset `name` (bounded: a preset
    name is at most 16 characters on the wire). An `auto` responder names the preset it wants first, in
    the one place `wanted_in` reads it; a fixed one says what the operator should change, as before."""
    yours = repr(name[:16])
    if compression != AUTO:
        return f"compression mismatch: yours {yours}, ours {compression!r}: set the same sync.compression on every trainer"
    if group_size != 2:
        return (f"{WANTS}{wants}; yours {yours}, ours 'auto' with sync.group_size = {group_size}: "
                "set the same sync.compression on every trainer")
    # Both causes in the words: our link to the initiator measured slow, or no link measured yet (PROBE).
    return f"{WANTS}{wants}; yours {yours} is less compressed than our link to you allows (or our first exchange's probe)"


def wanted_in(reason: str) -> str | None:
    """The preset a refusal's words name (`refusal_reason`), or None: only a known preset name, right after
    `WANTS` at the start of the text, counts. The words are a partner's free text: nothing else is read."""
    if not reason.startswith(WANTS):
        return None
    match = _WANTED.match(reason, len(WANTS), len(WANTS) + 17)
    return match.group(1) if match is not None and match.group(1) in ORDER else None


def after_refusal(asked: str, wanted: str | None) -> str | None:
    """The preset an `auto` initiator asks again with after a partner refused `asked` for its compression
    (`AnswerCode.COMPRESSION`), `wanted` the preset the refusal named (`wanted_in`; None: none readable);
    None: do not ask again. Only ever more compressed than `asked`, so that the retries of one exchange end
    within `ORDER`: the named preset where it is, one step on where nothing is named, and no retry where
    the named one is not more compressed (a group of four's responder wants `none`: a mismatch of settings
    that a retry does not mend)."""
    if asked not in ORDER:
        return None
    rank = ORDER.index(asked)
    if wanted is not None:
        return wanted if wanted in ORDER and ORDER.index(wanted) > rank else None
    return ORDER[rank + 1] if rank + 1 < len(ORDER) else None
