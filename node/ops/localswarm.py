"""`make run`: a local swarm on 127.0.0.1 — one bootstrap node and N peers — with a live status view.

Each node is a real `starling run` process with its own home under `--root` (default `./run/`), so what
you watch is exactly what a multi-host swarm does, minus the network. Ctrl+C (or `--seconds`) stops every
node with SIGTERM, which is the same graceful stop systemd uses.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from node.config.home import Home
from node.ops.launcher import DaemonProcess
from node.status_schema import NodeStatus, SyncStatus, TrainingStatus


def _trainer_available() -> bool:
    """Whether this Python can run the torch worker; without torch the local swarm runs network-only.
    Asked of the import system, not by importing: this room imports nothing of the daemon's side."""
    return importlib.util.find_spec("torch") is not None


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def render(names: list[str], statuses: Sequence[NodeStatus | None], started: float) -> str:
    ids = {s["peer_id"] for s in statuses if s}
    lines = [f"Starling local swarm — {len(names)} nodes — {time.monotonic() - started:.0f}s (Ctrl+C to stop)", ""]
    lines.append(f"{'node':<6} {'peer':<16} {'peers':>5} {'step':>7} {'outer':>6} {'loss':>8} {'val':>8} {'smp/s':>7} {'sync':>10} {'partners':>8}")
    for name, st in zip(names, statuses, strict=True):
        if st is None:
            lines.append(f"{name:<6} (starting...)")
            continue
        tr: TrainingStatus | dict[str, Any] = st.get("training") or {}
        sy: SyncStatus | dict[str, Any] = st.get("sync") or {}
        connected = len(set(st.get("connected_peers", [])) & ids)
        sync = f"{sy.get('rounds', 0)}/{sy.get('solo_rounds', 0)}s" if sy else "-"
        # Distinct partners over the last outer steps: one means fixed pairs, none means it never averages.
        partners = _fmt((sy.get("mixing") or {}).get("distinct_partners"), "d") if sy else "-"
        lines.append(
            f"{name:<6} {st['peer_id'][-16:]:<16} {connected:>2}/{len(ids) - 1:<2} {_fmt(tr.get('step'), 'd'):>7}"
            f" {_fmt(tr.get('outer_step'), 'd'):>6} {_fmt(tr.get('loss'), '.4f'):>8} {_fmt(tr.get('val_loss'), '.4f'):>8}"
            f" {_fmt(tr.get('samples_per_s'), '.1f'):>7} {sync:>10} {partners:>8}"
        )
    all_connected = all(st and ids - {st['peer_id']} <= set(st.get("connected_peers", [])) for st in statuses)
    lines.append("")
    lines.append("every node is connected to every other node" if all_connected and len(ids) == len(names)
                 else "connecting...")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m node.ops.localswarm", description=__doc__, allow_abbrev=False)
    p.add_argument("--peers", type=int, default=3, help="peers besides the bootstrap node")
    p.add_argument("--seconds", type=float, default=0, help="stop after this long (0 = until Ctrl+C)")
    p.add_argument("--root", default="run", help="directory for the nodes' homes")
    p.add_argument("--fresh", action="store_true", help="delete previous homes first")
    p.add_argument("--no-train", action="store_true", help="network-only peers")
    p.add_argument("--swarm", default="local")
    p.add_argument("--set", action="append", default=[], help="passed to every trainer's `starling run`")
    args = p.parse_args(argv)
    if not 1 <= args.peers <= 16:
        print("starling: error: --peers must be between 1 and 16", file=sys.stderr)
        return 2

    root = Path(args.root).resolve()
    if args.fresh and root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    train = not args.no_train and _trainer_available()
    daemons: list[DaemonProcess] = []
    names = ["boot"] + [f"peer{i}" for i in range(1, args.peers + 1)]
    homes = [root / n for n in names]
    interactive = sys.stdout.isatty()
    started = time.monotonic()

    def spawn(home: Path, extra: list[str]) -> None:
        home.mkdir(parents=True, exist_ok=True)
        os.chmod(home, 0o700)  # as `starling init` makes a home: identity key and checkpoints live there
        argv = ["--swarm", args.swarm, "--listen", "/ip4/127.0.0.1/tcp/0", *extra]
        # Its own session: a Ctrl+C in the terminal reaches only this launcher, which stops every node.
        daemons.append(DaemonProcess(home, argv).start(new_session=True))

    stop = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    founder: list[str] = []
    if train:
        # peer1 founds the run: every node is told its PeerID (node.founder), so no other key's run manifest
        # is ever adopted (README: Threat model). Its identity is made here, as `starling run` would.
        from p2p.identity import IdentityError, load_or_create_identity, peer_id_of

        homes[1].mkdir(parents=True, exist_ok=True)
        try:
            founder = ["--founder", str(peer_id_of(load_or_create_identity(Home(homes[1]).identity)[0]))]
        except (IdentityError, OSError) as e:
            print(f"starling: error: {e}", file=sys.stderr)
            return 2
    try:
        spawn(homes[0], ["--no-train", *founder])
        boot_addr = None
        while boot_addr is None and not stop:
            st = daemons[0].status(timeout=15)
            if st and st.get("addrs"):
                boot_addr = st["addrs"][0]
            elif daemons[0].exited():
                print(Home(homes[0]).log.read_text()[-2000:], file=sys.stderr)
                return 1
            else:
                time.sleep(0.3)
        if boot_addr is None:
            return 0  # Ctrl+C before the bootstrap node answered: nothing else was started
        print(f"bootstrap node: {boot_addr}")
        print(f"starting {args.peers} {'training' if train else 'network-only'} peers; logs in {root}/*/daemon.log")
        extra = ["--bootstrap", boot_addr, *founder] + ([] if train else ["--no-train"])
        if train:  # each trainer's curve under its home: `tensorboard --logdir ROOT` shows them side by side
            extra += ["--set", "train.tensorboard_dir=tensorboard"]
            print(f"TensorBoard: tensorboard --logdir {root}")
        for s in args.set:  # the user's own --set come last, and win
            extra += ["--set", s]
        for home in homes[1:]:
            spawn(home, extra)
        while not stop:
            if args.seconds and time.monotonic() - started >= args.seconds:
                break
            statuses = [d.status(timeout=15) for d in daemons]
            view = render(names, statuses, started)
            if interactive:
                sys.stdout.write("\x1b[H\x1b[2J" + view + "\n")
            else:
                print(view + "\n")
            sys.stdout.flush()
            dead = [n for n, d in zip(names, daemons, strict=True) if d.exited()]
            if dead:
                print(f"nodes exited: {', '.join(dead)} (see their daemon.log)", file=sys.stderr)
                return 1
            for _ in range(10 if interactive else 50):
                if stop:
                    break
                time.sleep(0.2)
        return 0
    finally:
        print("stopping the swarm...")
        for d in daemons:
            d.signal(signal.SIGTERM)
        for d in daemons:
            try:
                d.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(d.proc.pid, signal.SIGKILL)  # its own process group: the worker too
        if train:
            try:
                from node.ops.plot import plot_homes  # noqa: PLC0415 (optional: loss plot at the end)
            except ImportError:
                pass
            else:
                out = root / "loss.png"
                if plot_homes(homes, out):
                    print(f"loss plot written to {out}")
        print("stopped")


if __name__ == "__main__":
    sys.exit(main())
