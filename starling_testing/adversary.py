"""What a hostile averaging partner can do to a victim: phi and Delta attacks, measured against honest training.

A victim `Trainer` (the real worker's training and outer step) averages over real libp2p hosts and the real
`Averager` with a partner built from the same modules: an honest `Trainer` whose values are tampered with
just before they go on the wire (and whose header may lie about the steps and samples it covers). The
victim applies what its averager leaves in the sums, exactly as the worker does. Each attack runs for
ROUNDS outer steps; the yardstick is how far 20 honest rounds (the same victim, an honest partner) move the
victim's weights. tests/test_adversary_avg.py asserts the bounds; `python bench/adversary.py --write-docs`
records the figures in docs/reliability.md.

Attacks (from issue #13's review; the attacker knows the rules and picks the largest offsets they let
through):
- phi_plus_1000: +1000 added to every value of the phi it sends;
- phi_1e30: a phi of 1e30 everywhere;
- phi_drift: its phi moved 9 of its own Delta norms along a fixed direction u each round (under the
  refusal ratio of 10);
- delta_drift: its Delta plus 9.9 of its own Delta norms along u, claiming a million inner steps and a
  billion samples (to win a larger bound and all of the sample weight);
- norm_ratchet: its Delta along u, 1.2x longer every round (the old reference took accepted partners'
  norms and let this lift the bound 1,300x in 35 rounds);
- combined: phi_drift and delta_drift at once.

Directions (`measure_directions`, `python bench/adversary.py --scenario directions`): whether a check
beside the clip could tell a partner that pushes one direction round after round from an honest one. Per
round the victim's view: was the partner's Delta (its phi's offset from ours) clipped, and how aligned was
it with the same partner's the round before (cosine). Honest pairs are measured in step (the same start)
and far apart (one side trained DIRECTION_PRETRAIN outer steps alone first, as a late starter meets a
trained swarm); docs/reliability.md says what the figures mean for such a check.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

import multiaddr
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr

from node.averaging.averager import Averager
from node.bridge.exchange import ExchangeOutcome, ExchangeRequest
from node.config.sync import SyncConfig
from node.config.train import TrainConfig
from node.worker.trainer import Trainer
from p2p.host import build_host
from starling_testing.averaging import FakeSwarm, exchange_both

ROOT = Path(__file__).resolve().parent.parent  # the repository

ROUNDS = 40
HONEST_ROUNDS = 20
DOCS = ROOT / "docs" / "reliability.md"
SECTION = "## Hostile averaging partners"
LISTEN = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]


def train_config(inner_steps: int = 5, rounds: int = ROUNDS) -> TrainConfig:
    """The default task at a size that trains 2 x 40 outer steps in seconds on one core (`rounds`: the most
    outer steps one trainer takes, its schedule's length)."""
    cfg = TrainConfig(device="cpu", inner_steps=inner_steps, batch_size=4, seq_len=32, d_model=32, n_layers=1,
                      n_heads=2, warmup=4, total_steps=rounds * inner_steps * 2, data_bytes=200_000,
                      eval_batches=2, overlap=False, max_lag=0, seed=0)
    cfg.validate()
    return cfg


Attack = Callable[[ExchangeRequest, torch.Tensor, int, float], None]
"""attack(request about to go out, direction u, round, the attacker's own honest Delta norm)."""


def phi_plus_1000(req: ExchangeRequest, u: torch.Tensor, r: int, norm: float) -> None:
    req.phi.add_(1000.0)


def phi_1e30(req: ExchangeRequest, u: torch.Tensor, r: int, norm: float) -> None:
    req.phi.fill_(1e30)


def phi_drift(req: ExchangeRequest, u: torch.Tensor, r: int, norm: float) -> None:
    req.phi.add_(u, alpha=9.0 * norm)


def delta_drift(req: ExchangeRequest, u: torch.Tensor, r: int, norm: float) -> None:
    req.delta.add_(u, alpha=9.9 * norm)
    req.inner_steps, req.samples = 1_000_000, 1_000_000_000


def norm_ratchet(req: ExchangeRequest, u: torch.Tensor, r: int, norm: float) -> None:
    req.delta.copy_(u).mul_(norm * 1.2**r)


def combined(req: ExchangeRequest, u: torch.Tensor, r: int, norm: float) -> None:
    phi_drift(req, u, r, norm)
    delta_drift(req, u, r, norm)


ATTACKS: dict[str, Attack] = {f.__name__: f for f in (phi_plus_1000, phi_1e30, phi_drift, delta_drift, norm_ratchet,
                                                       combined)}


@dataclass
class Outcome:
    name: str
    rounds: int
    along_u: float  # the victim's displacement along the attack direction over the run
    moved: float  # |phi_end - phi_start|
    moved_honest_span: float  # |phi - phi_start| after HONEST_ROUNDS (the yardstick, from an honest run)
    finite: bool
    val_loss: float
    averaged: int  # victim's exchanges that reached its outer step
    rejections: dict[str, int] = field(default_factory=dict)
    clipped: dict[str, int] = field(default_factory=dict)
    banned: bool = False
    # From the second round on, as the victim saw the partner: (its Delta clipped, its phi clipped, cosine of
    # its Delta to its Delta the round before, cosine of its phi's offset from ours to the one before).
    directions: list[tuple[bool, bool, float, float]] = field(default_factory=list)

    def aligned_run(self, phi: bool = False, cos: float = 0.9) -> int:
        """The most rounds in a row in which the partner's Delta (phi offset) was clipped and pointed within
        `cos` of its direction the round before: what a persistent-direction check would count."""
        best = run = 0
        for d_clipped, p_clipped, d_cos, p_cos in self.directions:
            hit = (p_clipped and p_cos >= cos) if phi else (d_clipped and d_cos >= cos)
            run = run + 1 if hit else 0
            best = max(best, run)
        return best

    def highest_cos(self, phi: bool = False) -> float:
        """The highest cosine between two consecutive rounds' Deltas (phi offsets) of the partner."""
        return max((c for c in (p if phi else d for _, _, d, p in self.directions) if not math.isnan(c)),
                   default=math.nan)


def _request(trainer: Trainer, outer_step: int) -> ExchangeRequest:
    """What the supervisor hands the averager (node/bridge/exchange.py), with the worker's layout hash."""
    n = trainer.numel
    return ExchangeRequest(outer_step, torch.empty(n), torch.empty(n), torch.empty(n), torch.empty(n), trainer.layout,
                           trainer.layout_hash)


def _train_alone(trainer: Trainer, outer_steps: int) -> None:
    """Solo outer steps, as a node that trained before the other one came."""
    for r in range(outer_steps):
        while not trainer.publish_due():
            trainer.inner_step()
        req = _request(trainer, r)
        trainer.publish(req.phi, req.delta)
        trainer.apply_result(ExchangeOutcome(1))


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    """Their cosine; NaN where one is zero (an honest pair's phis are equal right after an exchange)."""
    if not bool(a.any()) or not bool(b.any()):
        return math.nan
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


async def duel(home: Path, attack: Attack | None, rounds: int, name: str = "honest", *, pre_victim: int = 0,
               pre_partner: int = 0) -> Outcome:
    """`rounds` outer steps of a victim with one partner (honest when `attack` is None); `pre_victim` and
    `pre_partner`: outer steps each trains alone first."""
    cfg = train_config(rounds=rounds + max(pre_victim, pre_partner))
    # A pairing window long enough for a loaded machine (every round must pair); once the victim has banned
    # the attacker there is nobody else, so its rounds are solo at once (`anyone_else` below).
    sync = SyncConfig(wire_dtype="fp32", pair_window_s=5, backoff_s=0.1)
    victim, partner = Trainer(cfg, home / "victim", "victim"), Trainer(cfg, home / "partner", "partner")
    u = torch.randn(victim.numel, generator=torch.Generator().manual_seed(7))
    u /= u.norm()
    # In a thread: other duels of the same run share this event loop, and their handshakes would time out.
    await trio.to_thread.run_sync(_train_alone, victim, pre_victim)
    await trio.to_thread.run_sync(_train_alone, partner, pre_partner)
    start = victim.phi.clone()
    async with AsyncExitStack() as stack:
        hosts = [build_host(create_new_key_pair()) for _ in range(2)]
        for h in hosts:
            await stack.enter_async_context(h.run(LISTEN))
        nursery = await stack.enter_async_context(trio.open_nursery())
        # The attacker runs the same averager with its own checks off: it accepts whatever the victim sends.
        lax = SyncConfig(wire_dtype="fp32", pair_window_s=5, backoff_s=0.1, clip_ratio=1e6, clip_phi_ratio=1e6,
                         max_delta_ratio=1e6)
        ids = [str(h.get_id()) for h in hosts]
        avs: list[Averager] = []

        def banned() -> bool:
            return bool(avs[0].status()["banned"])

        # Each side's only possible partner is the other, until the victim bans the attacker: from then on
        # both step solo at once instead of waiting out every pairing window (the attacker is told, as it
        # would learn from the refusals).
        avs += [Averager(hosts[0], sync, FakeSwarm(hosts[0], manifest="m", partners=lambda: [] if banned() else [ids[1]],
                                                   others=lambda: not banned()), max_inner_steps=cfg.inner_steps),
                Averager(hosts[1], sync if attack is None else lax,
                         FakeSwarm(hosts[1], manifest="m", partners=lambda: [] if banned() else [ids[0]],
                                   others=lambda: not banned()))]
        for a in avs:
            await nursery.start(a.run)
        await hosts[0].connect(info_from_p2p_addr(hosts[1].get_addrs()[0]))
        averaged, moved_honest_span = 0, math.nan
        directions: list[tuple[bool, bool, float, float]] = []
        before: tuple[torch.Tensor, torch.Tensor] | None = None
        for r in range(rounds):
            reqs = []
            for t in (victim, partner):
                while not t.publish_due():
                    t.inner_step()
                req = _request(t, r)
                pub = t.publish(req.phi, req.delta)
                req.inner_steps, req.samples = pub.inner_steps, pub.samples
                reqs.append(req)
            honest_phi, honest_delta = reqs[1].phi.clone(), reqs[1].delta.clone()
            if attack is not None:
                attack(reqs[1], u, r, float(honest_delta.norm()))
            sent = (reqs[1].delta.clone(), reqs[1].phi - reqs[0].phi)  # what the victim is sent, its phi offset
            clipped = avs[0].status()["clipped"]
            results = await exchange_both(avs, reqs)
            if before is not None:
                now_clipped = avs[0].status()["clipped"]
                directions.append((now_clipped["delta"] > clipped["delta"], now_clipped["phi"] > clipped["phi"],
                                   _cos(sent[0], before[0]), _cos(sent[1], before[1])))
            before = sent
            v = reqs[0]
            # The victim's outcome as its daemon's averager returned it (an ExchangeOutcome), whole.
            used = victim.apply_result(results[0], v.phi_out, v.delta_out)
            averaged += used >= 2
            if r + 1 == HONEST_ROUNDS:
                moved_honest_span = float((victim.phi - start).norm())
            if results[1].group_size >= 2:
                # The attacker trains on as an honest replica would have: its own true values in the sums.
                p = reqs[1]
                p.phi_out.sub_(p.phi).add_(honest_phi)
                p.delta_out.sub_(p.delta).add_(honest_delta)
                partner.apply_result(ExchangeOutcome(2, partner_samples=reqs[0].samples), p.phi_out,
                                     p.delta_out)
            else:
                partner.apply_result(ExchangeOutcome(1))
        st = avs[0].status()
        nursery.cancel_scope.cancel()
    moved = victim.phi - start
    finite = bool(torch.isfinite(victim.phi).all())
    return Outcome(name, rounds, float(moved @ u) if finite else math.inf, float(moved.norm()), moved_honest_span,
                   finite, victim.evaluate(), averaged, st["rejections"], st["clipped"], bool(st["banned"]), directions)


async def measure(names: list[str], home: Path) -> tuple[Outcome, list[Outcome]]:
    """The honest duel and every attack's, side by side (each is mostly waiting on its exchanges)."""
    runs: dict[str, Outcome] = {}

    async def one(name: str) -> None:
        runs[name] = await duel(home / name, ATTACKS.get(name), ROUNDS, name)

    async with trio.open_nursery() as nursery:
        for name in ["honest", *names]:
            nursery.start_soon(one, name)
    return runs["honest"], [runs[name] for name in names]


DIRECTION_PRETRAIN = 100  # outer steps one side of a "far apart" honest pair trained alone first
DIRECTION_RUNS: dict[str, tuple[str | None, int, int]] = {  # row: (attack, pre_victim, pre_partner)
    "honest, in step (same start)": (None, 0, 0),
    f"honest, fresh partner (victim trained {DIRECTION_PRETRAIN} outer steps alone)": (None, DIRECTION_PRETRAIN, 0),
    f"honest, trained partner ({DIRECTION_PRETRAIN} outer steps alone; fresh victim)": (None, 0, DIRECTION_PRETRAIN),
    "delta_drift": ("delta_drift", 0, 0),
    "phi_drift": ("phi_drift", 0, 0),
    "combined": ("combined", 0, 0),
}
DIRECTION_COS = (0.9, 0.95)  # the alignments a check might call persistent


async def measure_directions(home: Path) -> list[Outcome]:
    """The DIRECTION_RUNS duels side by side (each is mostly waiting on its exchanges)."""
    runs: dict[str, Outcome] = {}

    async def one(i: int, row: str) -> None:
        attack, pre_victim, pre_partner = DIRECTION_RUNS[row]
        runs[row] = await duel(home / f"d{i}", ATTACKS[attack] if attack else None, ROUNDS, row,
                               pre_victim=pre_victim, pre_partner=pre_partner)

    async with trio.open_nursery() as nursery:
        for i, row in enumerate(DIRECTION_RUNS):
            nursery.start_soon(one, i, row)
    return [runs[row] for row in DIRECTION_RUNS]


def direction_table(outcomes: list[Outcome]) -> str:
    cos = " / ".join(str(c) for c in DIRECTION_COS)
    rows = [f"| partner ({ROUNDS} rounds) | Delta clipped | of them in a row, each aligned with the round before (cos >= "
            f"{cos}) | highest cos of consecutive Deltas | phi clipped | of them in a row, aligned ({cos}) | highest "
            "cos of consecutive phi offsets |",
            "|---|---|---|---|---|---|---|"]
    for o in outcomes:
        runs = [" / ".join(str(o.aligned_run(phi, c)) for c in DIRECTION_COS) for phi in (False, True)]
        rows.append(f"| {o.name} | {o.clipped.get('delta', 0)} | {runs[0]} | "
                    f"{_figure(o.highest_cos(False))} | {o.clipped.get('phi', 0)} | {runs[1]} | "
                    f"{_figure(o.highest_cos(True))} |")
    return "\n".join(rows)


def _figure(cos: float) -> str:
    return "- (the phis were equal)" if math.isnan(cos) else f"{cos:.3f}"


def table(honest: Outcome, outcomes: list[Outcome]) -> str:
    rows = [f"| attack | victim moved along it ({ROUNDS} rounds) | / honest {HONEST_ROUNDS}-round move | victim val "
            "loss | victim outer steps averaged | refused | clipped (Delta, phi) | partner banned |",
            "|---|---|---|---|---|---|---|---|",
            f"| none (honest partner) | {honest.along_u:+.3f} | {HONEST_ROUNDS} rounds moved it "
            f"{honest.moved_honest_span:.3f} in all | {honest.val_loss:.3f} | {honest.averaged}/{honest.rounds} | "
            f"{sum(honest.rejections.values())} | {honest.clipped.get('delta', 0)}, {honest.clipped.get('phi', 0)} | no |"]
    for o in outcomes:
        refused = sum(o.rejections.values())
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(o.rejections.items()))
        rows.append(f"| {o.name} | {o.along_u:+.3f} | {o.along_u / honest.moved_honest_span:.2f}x | {o.val_loss:.3f} | "
                    f"{o.averaged}/{o.rounds} | {refused}{f' ({reasons})' if reasons else ''} | "
                    f"{o.clipped.get('delta', 0)}, {o.clipped.get('phi', 0)} | {'yes' if o.banned else 'no'} |")
    return "\n".join(rows)


def write_table(text: str, path: Path = DOCS, header: str = "| attack") -> None:
    """Replace the table of the section SECTION in docs/reliability.md whose first line starts with `header`
    (its prose stays as written)."""
    doc = path.read_text()
    if SECTION not in doc:
        raise SystemExit(f"{path} has no section '{SECTION}' to update")
    head, section = doc.split(SECTION, 1)
    lines = section.split("\n")
    first = next((i for i, x in enumerate(lines) if x.startswith(header)), None)
    if first is None:
        raise SystemExit(f"{path}'s section '{SECTION}' has no table starting with '{header}' to update")
    last = first
    while last + 1 < len(lines) and lines[last + 1].startswith("|"):
        last += 1
    lines[first:last + 1] = text.split("\n")
    path.write_text(head + SECTION + "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated: " + ", ".join(ATTACKS))
    ap.add_argument("--write-docs", action="store_true", help=f"replace the table of '{SECTION}' in {DOCS}")
    args = ap.parse_args(argv)
    names = [a for a in args.attacks.split(",") if a]
    unknown = [a for a in names if a not in ATTACKS]
    if unknown:
        print(f"unknown attack(s): {', '.join(unknown)} (known: {', '.join(ATTACKS)})", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        honest, outcomes = trio.run(measure, names, Path(tmp))
    text = table(honest, outcomes)
    print(text)
    if args.write_docs:
        write_table(text)
    print(f"({time.monotonic() - began:.0f} s)")
    return 0


def directions_main(write_docs: bool = False) -> int:
    """Print the directions table (`bench/adversary.py --scenario directions`); `write_docs`: record it."""
    torch.set_num_threads(1)
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        outcomes = trio.run(measure_directions, Path(tmp))
    text = direction_table(outcomes)
    print(text)
    if write_docs:
        write_table(text, header="| partner (")
    print(f"({time.monotonic() - began:.0f} s)")
    return 0



if __name__ == "__main__":
    raise SystemExit(main())
