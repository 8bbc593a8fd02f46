"""The `starling` command: init | run | status.

Exit codes are part of the contract operators' scripts rely on: 0 success, 1 "no daemon" for status,
2 bad input or a start-up problem the operator must fix (bad option, port in use, corrupt identity,
second daemon on the same home). User errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_NO_DAEMON, EXIT_USAGE = 0, 1, 2
SHUTDOWN_GRACE_S = 9.0

log = logging.getLogger("starling.cli")


def _die(msg: str, code: int = EXIT_USAGE) -> int:
    print(f"starling: error: {msg}", file=sys.stderr)
    return code


def _parse_set(values: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise ValueError(f"--set {item!r}: expected SECTION.OPTION=VALUE")
        out[key.strip()] = value
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="starling", description="Decentralized peer-to-peer training daemon.")
    sub = p.add_subparsers(dest="command", required=True)

    def home_arg(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--home", help="node directory (default: $STARLING_HOME, else ~/.starling)")

    sp = sub.add_parser("init", help="create the node's identity and a commented config.toml")
    home_arg(sp)
    sp.add_argument("--swarm", help="swarm name to write into config.toml")
    sp.add_argument("--swarm-key", metavar="FILE", help="copy this swarm key into HOME/swarm.key (private swarm)")

    sp = sub.add_parser("swarm-key", help="generate a new swarm key (32 random bytes) for a private swarm")
    sp.add_argument("--out", metavar="FILE", help="write it to FILE (mode 0600) instead of printing it")

    sp = sub.add_parser("run", help="run the daemon in the foreground (systemd-friendly)")
    home_arg(sp)
    sp.add_argument("--listen", action="append", default=None, metavar="MULTIADDR")
    sp.add_argument("--announce", action="append", default=None, metavar="MULTIADDR")
    sp.add_argument("--bootstrap", action="append", default=None, metavar="MULTIADDR")
    sp.add_argument("--bootstrap-file", action="append", default=None, metavar="PATH",
                    help="file of bootstrap multiaddrs, one per line; waited for and re-read")
    sp.add_argument("--addr-file", metavar="PATH", help="write this node's multiaddrs here once listening")
    sp.add_argument("--swarm")
    sp.add_argument("--no-train", action="store_true", help="network-only node (bootstrap/relay host)")
    sp.add_argument("--metrics-port", type=int, default=None)
    sp.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default=None)
    sp.add_argument("--set", action="append", default=[], metavar="SECTION.OPTION=VALUE",
                    help="any config option, e.g. --set train.inner_steps=20")

    sp = sub.add_parser("status", help="show what the local daemon is doing")
    home_arg(sp)
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                    help="refresh the readable view in place (default every 2 s) until Ctrl+C")
    sp = sub.add_parser("doctor", help="check identity, config, ports, bootstrap peers, clocks, versions; print fixes")
    home_arg(sp)
    sp.add_argument("--json", action="store_true", help="print one JSON object")

    sp = sub.add_parser("plot", help="draw loss against step for every member this node has heard of")
    home_arg(sp)
    sp.add_argument("--out", default="loss.png", help="PNG file to write (default: loss.png)")
    return p


# --- init -------------------------------------------------------------------------------------------------


def cmd_init(args: argparse.Namespace) -> int:
    from node.config import CONFIG_FILE, ConfigError, NodeConfig, render_config_file, resolve_home
    from p2p.identity import IDENTITY_FILE, IdentityError, load_or_create_identity, peer_id_of

    home = resolve_home(args.home)
    try:
        home.mkdir(parents=True, exist_ok=True)
        os.chmod(home, 0o700)
        key_pair, created = load_or_create_identity(home / IDENTITY_FILE)
    except IdentityError as e:
        return _die(str(e))
    except OSError as e:
        return _die(f"{home}: {e.strerror or e}")
    config_path = home / CONFIG_FILE
    if args.swarm is not None:
        try:
            NodeConfig(swarm=args.swarm).validate()
        except ValueError as e:
            return _die(str(e))
    if not config_path.exists():
        overrides = {"node": {"swarm": args.swarm}} if args.swarm else {}
        config_path.write_text(render_config_file(overrides))
    elif args.swarm is not None:
        print(f"note: {config_path} exists and was left unchanged", file=sys.stderr)
    try:
        from node.config import load_config

        load_config(home)
    except ConfigError as e:
        return _die(str(e))
    if args.swarm_key:
        from p2p.auth import SWARM_KEY_FILE, SwarmKeyError, read_swarm_key, write_swarm_key

        try:
            key_hex = read_swarm_key(Path(args.swarm_key))
            target = home / SWARM_KEY_FILE
            if target.exists():
                if read_swarm_key(target) != key_hex:
                    return _die(f"{target} already holds a different swarm key; remove it first to change swarms")
            else:
                write_swarm_key(target, key_hex)
        except SwarmKeyError as e:
            return _die(str(e))
    if created:
        print(f"created identity in {home / IDENTITY_FILE}", file=sys.stderr)
    print(peer_id_of(key_pair))
    return EXIT_OK


def cmd_swarm_key(args: argparse.Namespace) -> int:
    from p2p.auth import format_swarm_key, generate_swarm_key, write_swarm_key

    key_hex = generate_swarm_key()
    if args.out:
        try:
            write_swarm_key(Path(args.out), key_hex)
        except FileExistsError:
            return _die(f"{args.out} already exists; refusing to overwrite a swarm key")
        except OSError as e:
            return _die(f"{args.out}: {e.strerror or e}")
        print(f"wrote a new swarm key to {args.out}; give it to every node with `starling init --swarm-key`",
              file=sys.stderr)
    else:
        sys.stdout.write(format_swarm_key(key_hex))
    return EXIT_OK


# --- run --------------------------------------------------------------------------------------------------


def _run_overrides(args: argparse.Namespace) -> dict[str, Any]:
    o: dict[str, Any] = _parse_set(args.set)
    if args.listen is not None:
        o["node.listen"] = args.listen
    if args.announce is not None:
        o["node.announce"] = args.announce
    if args.bootstrap is not None:
        o["node.bootstrap"] = args.bootstrap
    if args.bootstrap_file is not None:
        o["node.bootstrap_files"] = args.bootstrap_file
    if args.addr_file is not None:
        o["node.addr_file"] = args.addr_file
    if args.swarm is not None:
        o["node.swarm"] = args.swarm
    if args.metrics_port is not None:
        o["node.metrics_port"] = args.metrics_port
    if args.log_level is not None:
        o["node.log_level"] = args.log_level
    return o


def cmd_run(args: argparse.Namespace) -> int:
    from node.config import ConfigError, load_config, resolve_home
    from node.lock import HomeLock, LockError
    from node.logs import setup_logging
    from p2p.identity import IDENTITY_FILE, IdentityError, load_or_create_identity

    home = resolve_home(args.home)
    try:
        overrides = _run_overrides(args)
        home.mkdir(parents=True, exist_ok=True)
        cfg = load_config(home, overrides=overrides)
    except (ConfigError, ValueError) as e:
        return _die(str(e))
    except OSError as e:
        return _die(f"{home}: {e.strerror or e}")
    setup_logging(cfg.node.log_level)
    lock = HomeLock(home)
    try:
        lock.acquire()
    except LockError as e:
        return _die(str(e))
    try:
        try:
            key_pair, created = load_or_create_identity(home / IDENTITY_FILE)
        except IdentityError as e:
            return _die(str(e))
        if created:
            log.info("created a new identity in %s", home / IDENTITY_FILE)
        import trio

        from node.daemon import Daemon, StartupError

        train = not args.no_train
        try:
            daemon = Daemon(cfg, home, key_pair, train=train)
        except (ValueError, StartupError) as e:
            return _die(str(e))
        try:
            trio.run(_run_until_signal, daemon)
        except KeyboardInterrupt:
            pass
        except BaseException as e:
            startup = _find_exception(e, StartupError)
            if startup is None:
                raise
            return _die(str(startup))
        log.info("stopped")
        return EXIT_OK
    finally:
        lock.release()


async def _run_until_signal(daemon: Any) -> None:
    """Run the daemon until SIGTERM/SIGINT, then cancel it and give it a bounded time to drain."""
    import trio

    from node.daemon import StartupError

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                async for signum in signals:
                    log.info("received %s, stopping", signal.Signals(signum).name)
                    _arm_hard_stop()
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(watch)
            try:
                await daemon.run()
            except StartupError:
                nursery.cancel_scope.cancel()
                raise


def _find_exception(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first `kind` inside `exc`, looking through trio's exception groups."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _find_exception(inner, kind)
            if found is not None:
                return found
    return None


def _arm_hard_stop() -> None:
    """If a graceful stop overruns its budget (a wedged library task), exit anyway, and say so."""

    def stop() -> None:
        time.sleep(SHUTDOWN_GRACE_S)
        log.warning("graceful stop took longer than %.0fs; exiting now", SHUTDOWN_GRACE_S)
        logging.shutdown()
        os._exit(EXIT_OK)

    threading.Thread(target=stop, daemon=True, name="hard-stop").start()


# --- status -----------------------------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    from node.config import resolve_home
    from node.control import SOCKET_FILE, ControlError, request_sync
    from node.status_view import render_status

    home = resolve_home(args.home)
    if args.watch is not None:
        if args.json:
            return _die("--watch and --json cannot be combined")
        return _watch_status(home, max(0.2, args.watch))
    try:
        answer = request_sync(home / SOCKET_FILE, {"cmd": "status"})
    except ControlError as e:
        if args.json:
            print(json.dumps({"running": False, "error": str(e)}))
        else:
            print(f"starling: {e}", file=sys.stderr)
        return EXIT_NO_DAEMON
    if not answer.get("ok"):
        return _die(f"daemon error: {answer.get('error')}", EXIT_NO_DAEMON)
    status = answer["status"]
    if args.json:
        print(json.dumps(status, indent=None, sort_keys=True))
    else:
        print(render_status(status))
    return EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    from node.doctor import doctor_main

    return doctor_main(args.home, args.json)


def cmd_plot(args: argparse.Namespace) -> int:
    from node.config import resolve_home
    from node.plot import plot_main  # matplotlib is imported only when plotting

    return plot_main(resolve_home(args.home), Path(args.out))


def _watch_status(home: Path, interval: float) -> int:
    """Redraw the readable status in place; a daemon that goes away is shown, not fatal."""
    from node.control import SOCKET_FILE, ControlError, request_sync
    from node.status_view import render_status

    clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
    try:
        while True:
            try:
                answer = request_sync(home / SOCKET_FILE, {"cmd": "status"})
                body = render_status(answer["status"]) if answer.get("ok") else f"daemon error: {answer.get('error')}"
            except ControlError as e:
                body = f"starling: {e}"
            stamp = time.strftime("%H:%M:%S")
            sys.stdout.write(f"{clear}{body}\n\n(refreshing every {interval:g}s at {stamp}; Ctrl+C to quit)\n")
            sys.stdout.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {
        "init": cmd_init,
        "run": cmd_run,
        "status": cmd_status,
        "plot": cmd_plot,
        "swarm-key": cmd_swarm_key,
        "doctor": cmd_doctor,
    }
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `starling status | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
