"""The `starling` command: init | run | status | doctor | plot | export | swarm-key.

Exit codes are part of the contract operators' scripts rely on: 0 success, 1 "no daemon" for status,
2 bad input or a start-up problem the operator must fix (bad option, port in use, corrupt identity,
second daemon on the same home, a read-only home, a task or device the worker cannot load), 3 for status
when the daemon runs but its training has failed for good (so health checks see it); `run` exits 1 when it
stopped but could not write its final checkpoint (a full disk: the work since the previous one is lost).
User errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_NO_DAEMON, EXIT_USAGE, EXIT_TRAINING_FAILED = 0, 1, 2, 3
EXIT_CHECKPOINT_LOST = 1  # `run` stopped but its final checkpoint could not be written (a full disk)
SHUTDOWN_GRACE_S = 9.0

log = logging.getLogger("starling.cli")


def _die(msg: str, code: int = EXIT_USAGE) -> int:
    from node.ops.logs import journal_prefix  # `<3>` under systemd, so the journal shows it as an error

    print(f"{journal_prefix(logging.ERROR)}starling: error: {msg}", file=sys.stderr)
    return code


def _parse_set(values: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise ValueError(f"--set {item!r}: expected SECTION.OPTION=VALUE")
        out[key.strip()] = value
    return out


def _version() -> str:
    """The installed package's version (without importing the daemon, which is slow to import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("starling")
    except PackageNotFoundError:
        return "0+unknown"


class _Parser(argparse.ArgumentParser):
    """A command's parser: options are never abbreviated (see build_parser)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)


EXPORT_FORMATS = ("safetensors", "torch", "hf")  # node/worker/export.py's FORMATS, known here without importing torch


def build_parser() -> argparse.ArgumentParser:
    """The parser; each command's namespace carries its own parser as `_parser`, so that an option the
    command does not know is reported with that command's usage (see `main`)."""
    # allow_abbrev=False everywhere: argparse would otherwise read `run --hom /srv/x` as `--home /srv/x`, or
    # a typo that happens to be a prefix of some option as that option.
    p = argparse.ArgumentParser(prog="starling", description="Decentralized peer-to-peer training daemon.",
                                allow_abbrev=False)
    p.add_argument("--version", action="version", version=f"starling {_version()}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def home_arg(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--home", help="node directory (default: $STARLING_HOME, else ~/.starling)")

    sp = sub.add_parser("init", help="create the node's identity and a commented config.toml")
    home_arg(sp)
    sp.add_argument("--swarm", help="swarm name to write into config.toml")
    sp.add_argument("--swarm-key", metavar="FILE", help="copy this swarm key into HOME/swarm.key (private swarm)")
    sp.add_argument("--founder", metavar="PEERID",
                    help="write node.founder: only this PeerID's run manifest is adopted (the founder's init prints it)")

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
    sp.add_argument("--founder", metavar="PEERID", help="node.founder: only this PeerID's run manifest is adopted")
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
    rows = sp.add_mutually_exclusive_group()
    rows.add_argument("--members", type=int, default=None, metavar="N",
                      help="rows per list of members or connections (default 20); a longer list is summarised "
                           "(counts by state and role) and shows this node, its partners, suspect members and "
                           "the trainers furthest behind and ahead first. --json is never cut")
    rows.add_argument("--all", action="store_true", help="show every member and connection, however many")
    sp = sub.add_parser("doctor", help="check identity, config, ports, bootstrap peers, clocks, versions; print fixes")
    home_arg(sp)
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.add_argument("--bootstrap", action="append", default=None, metavar="MULTIADDR",
                    help="check these bootstrap peers, as `run --bootstrap` would use them (default: the running "
                         "daemon's, else the config's)")
    sp.add_argument("--bootstrap-file", action="append", default=None, metavar="PATH",
                    help="check the peers listed in this file, as `run --bootstrap-file` would")

    sp = sub.add_parser("plot", help="draw loss against step for every member this node has heard of")
    home_arg(sp)
    sp.add_argument("--out", default="loss.png", help="PNG file to write (default: loss.png)")

    sp = sub.add_parser("export", help="write the slow weights of the latest checkpoint as a plain state dict")
    home_arg(sp)
    sp.add_argument("--out", required=True, metavar="DIR", help="directory to write into (created if missing)")
    sp.add_argument("--format", default="safetensors", metavar="FORMAT",
                    help="safetensors (default: DIR/model.safetensors) | torch (DIR/model.pt) | hf (save_pretrained); "
                         "every file written is private (mode 0600)")
    sp.add_argument("--evaluate", action="store_true", help="also measure the exported weights' validation loss")
    sp.add_argument("--set", action="append", default=[], metavar="SECTION.OPTION=VALUE",
                    help="a config option over what the trainer last ran with (HOME/run-config.toml: the task "
                         "and its [task] options fix the model)")
    for command_parser in sub.choices.values():
        command_parser.set_defaults(_parser=command_parser)
    return p


# --- init -------------------------------------------------------------------------------------------------


def cmd_init(args: argparse.Namespace) -> int:
    """Create HOME's identity, config.toml and swarm.key, or nothing at all.

    Every input (swarm name, swarm key, an existing config, the environment) is checked before the first
    file is written, and a write that fails removes what this run created: a half-made home would keep an
    identity the operator never meant to create, and a retry should start from the same state.
    An existing config.toml is never rewritten, so `--swarm` naming another swarm than it does is refused.
    """
    from node.config.home import Home
    from node.config.load import (
        ConfigError,
        load_config,
        render_config_file,
        resolve_home,
        unknown_environment,
    )
    from p2p.auth import SwarmKeyError, read_swarm_key, write_swarm_key
    from p2p.identity import IdentityError, load_or_create_identity, peer_id_of

    home = resolve_home(args.home)
    config_path, key_path, identity_path = Home(home).config, Home(home).swarm_key, Home(home).identity
    key_hex: str | None = None
    try:
        overrides = {"node.swarm": args.swarm} if args.swarm is not None else {}
        if args.founder is not None:
            overrides["node.founder"] = args.founder
        cfg = load_config(home, overrides=overrides)  # the file, the environment and flags, as `run` sees them
        if args.swarm is not None and config_path.exists():
            configured = load_config(home, environ={}).node.swarm
            if configured != args.swarm:
                return _die(f"{config_path} already names swarm {configured!r}; init does not rewrite an existing "
                            f"config.toml: edit node.swarm there to move this node to swarm {args.swarm!r}")
        if args.founder is not None and config_path.exists():
            configured = load_config(home, environ={}).node.founder
            if configured != args.founder:
                return _die(f"{config_path} already names founder {configured or 'none'!r}; init does not rewrite an "
                            f"existing config.toml: edit node.founder there")
        if args.swarm_key:
            key_hex = read_swarm_key(Path(args.swarm_key))
            if key_path.exists() and read_swarm_key(key_path) != key_hex:
                return _die(f"{key_path} already holds a different swarm key; remove it first to change swarms")
    except (ConfigError, SwarmKeyError) as e:
        return _die(str(e))
    except OSError as e:
        return _die(f"{home}: {e.strerror or e}")
    for warning in unknown_environment():
        print(f"starling: warning: {warning}", file=sys.stderr)
    home_existed = home.exists()
    made: list[Path] = []  # files this run creates, listed before writing so that a partial write is undone
    try:
        home.mkdir(parents=True, exist_ok=True)
        os.chmod(home, 0o700)
        if not identity_path.exists():
            made.append(identity_path)
        key_pair, created = load_or_create_identity(identity_path)
        if not config_path.exists():
            made.append(config_path)
            written = {"swarm": args.swarm} if args.swarm else {}
            if args.founder:
                written["founder"] = args.founder
            config_path.write_text(render_config_file({"node": written} if written else {}))
        elif args.swarm is not None:
            print(f"note: {config_path} exists and was left unchanged", file=sys.stderr)
        if key_hex is not None and not key_path.exists():
            made.append(key_path)
            write_swarm_key(key_path, key_hex)
    except (IdentityError, OSError) as e:
        for path in made:
            path.unlink(missing_ok=True)
        if not home_existed:
            with contextlib.suppress(OSError):
                home.rmdir()
        return _die(str(e) if isinstance(e, IdentityError) else f"{home}: {e.strerror or e}")
    if created:
        print(f"created identity in {identity_path}", file=sys.stderr)
    peer_id = str(peer_id_of(key_pair))
    print(peer_id)
    if cfg.node.founder in ("", peer_id):
        # What to share: with it every other node adopts no run manifest but this node's (README: Threat model).
        print(f"to make this node the swarm's founder, give the other nodes --founder {peer_id} "
              f"(or node.founder = \"{peer_id}\" in their config.toml)", file=sys.stderr)
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


def run_overrides(args: argparse.Namespace) -> dict[str, Any]:
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
    if args.founder is not None:
        o["node.founder"] = args.founder
    if args.metrics_port is not None:
        o["node.metrics_port"] = args.metrics_port
    if args.log_level is not None:
        o["node.log_level"] = args.log_level
    return o


def cmd_run(args: argparse.Namespace) -> int:
    from node.config.home import Home
    from node.config.load import ConfigError, load_config, resolve_home, unknown_environment
    from node.ops.lock import HomeLock, LockError
    from node.ops.logs import setup_logging
    from p2p.fsutil import free_space_problem, unwritable_reason
    from p2p.identity import IdentityError, load_or_create_identity

    home = resolve_home(args.home)
    identity_path = Home(home).identity
    try:
        overrides = run_overrides(args)
        if not home.is_dir():
            home.mkdir(parents=True)
            os.chmod(home, 0o700)  # as `init` makes it: the identity key and the swarm key live here
        problem = unwritable_reason(home)
        if problem:
            return _die(f"{home}: cannot be this node's home: {problem} (the daemon writes its lock, control "
                        "socket, state and checkpoints there; fix the permissions or pick another --home)")
        cfg = load_config(home, overrides=overrides)
    except (ConfigError, ValueError) as e:
        return _die(str(e))
    except OSError as e:
        return _die(f"{home}: {e.strerror or e}")
    setup_logging(cfg.node.log_level)
    for warning in unknown_environment():
        log.warning("%s", warning)
    low = free_space_problem(home, Home(home).checkpoints) if not args.no_train else None
    if low:
        log.warning("%s: checkpoints may fail (the daemon keeps training, and says so in `starling status`); "
                    "free space there or move HOME", low)
    lock = HomeLock(home)
    try:
        lock.acquire()
    except LockError as e:
        return _die(str(e))
    except OSError as e:
        return _die(f"{lock.path}: {e.strerror or e}")
    try:
        try:
            key_pair, created = load_or_create_identity(identity_path)
        except IdentityError as e:
            return _die(str(e))
        except OSError as e:
            return _die(f"{identity_path}: {e.strerror or e}")
        if created:
            log.info("created a new identity in %s", identity_path)
        import trio

        from node.daemon import Daemon, StartupError, find_exception

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
            startup = find_exception(e, StartupError)
            if startup is None:
                raise
            return _die(str(startup))
        lost = getattr(daemon.supervisor, "final_checkpoint_error", None)
        if lost:
            # The work since the last checkpoint is lost: say so, and exit non-zero so that a supervisor sees it.
            log.warning("stopped, but %s; a restart resumes from the previous checkpoint: free space on the file "
                        "system of %s", lost, home)
            return EXIT_CHECKPOINT_LOST
        log.info("stopped")
        return EXIT_OK
    finally:
        lock.release()


async def _run_until_signal(daemon: Any) -> None:
    """Run the daemon until SIGTERM/SIGINT, then stop it gracefully within a bounded time to drain.

    The first signal asks the daemon to stop (its components clean up while the host still carries their
    goodbyes); a second one cancels everything at once."""
    import trio

    from node.daemon import StartupError

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                first = True
                async for signum in signals:
                    if first:
                        log.info("received %s, stopping", signal.Signals(signum).name)
                        _arm_hard_stop()
                        daemon.stop()
                        first = False
                    else:
                        log.info("received %s again, stopping now", signal.Signals(signum).name)
                        nursery.cancel_scope.cancel()
                        return

            nursery.start_soon(watch)
            try:
                await daemon.run()
            except StartupError:
                nursery.cancel_scope.cancel()
                raise
            nursery.cancel_scope.cancel()


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
    from node.config.home import Home
    from node.config.load import resolve_home
    from node.ops.control import ControlError, request_sync
    from node.ops.status_view import DEFAULT_ROWS, render_status

    home = resolve_home(args.home)
    if args.members is not None and args.members < 1:
        return _die(f"--members: at least 1 row; got {args.members} (--all shows every member)")
    rows = None if args.all else (DEFAULT_ROWS if args.members is None else args.members)
    if args.watch is not None:
        if args.json:
            return _die("--watch and --json cannot be combined")
        return _watch_status(home, max(0.2, args.watch), rows)
    try:
        answer = request_sync(Home(home).control_socket, {"cmd": "status"})
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
        # `running` as in the no-daemon answer ({"running": false, "error": ...}), so scripts test one key.
        # Never cut: scripts and monitoring read every member (--members / --all only shape the readable view).
        print(json.dumps({**status, "running": True}, indent=None, sort_keys=True))
    else:
        print(render_status(status, rows))
    # The daemon answers, but a trainer that cannot train is not healthy: Docker's HEALTHCHECK and other
    # monitors run this command and only see its exit code.
    if (status.get("training") or {}).get("state") == "failed":
        return EXIT_TRAINING_FAILED
    return EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    from node.ops.doctor import doctor_main
    from p2p.addrs import AddrError, parse_bootstrap

    overrides: dict[str, Any] = {}
    if args.bootstrap is not None:
        for text in args.bootstrap:  # doctor's own flag: a bad one is a usage error, as for `run`
            try:
                parse_bootstrap(text)
            except AddrError as e:
                return _die(f"--bootstrap: {e}")
        overrides["node.bootstrap"] = args.bootstrap
    if args.bootstrap_file is not None:
        overrides["node.bootstrap_files"] = args.bootstrap_file
    return doctor_main(args.home, args.json, overrides)


def cmd_plot(args: argparse.Namespace) -> int:
    from node.config.load import resolve_home
    from node.ops.plot import plot_main  # matplotlib is imported only when plotting

    return plot_main(resolve_home(args.home), Path(args.out))


def cmd_export(args: argparse.Namespace) -> int:
    """`starling export`: one line on stdout saying what was written; every failure one line, exit 2."""
    from node.config.load import ConfigError, load_config, resolve_home

    if args.format not in EXPORT_FORMATS:  # before anything slow is loaded (the task, torch)
        return _die(f"--format: one of {', '.join(EXPORT_FORMATS)}; got {args.format!r}")
    home = resolve_home(args.home)
    if not home.is_dir():
        return _die(f"{home}: no such node home (pass --home or set STARLING_HOME)")
    try:
        # The options the trainer ran with (HOME/run-config.toml): no `--set` of `run` to repeat.
        cfg = load_config(home, overrides=_parse_set(args.set), run_config=True)
    except (ConfigError, ValueError) as e:
        return _die(str(e))
    from node.worker.export import ExportError, export_weights  # imports torch: only now
    from node.worker.task import TaskError

    try:
        result = export_weights(home, Path(args.out).expanduser(), args.format, cfg, evaluate=args.evaluate)
    except (ExportError, TaskError) as e:
        return _die(str(e))
    recorded = "none yet" if result.val_loss is None else f"{result.val_loss:.4f}"
    measured = "" if result.eval_loss is None else f", {result.eval_loss:.4f} measured on the exported weights"
    print(f"exported the slow weights of {result.checkpoint} (step {result.step}, outer step {result.outer_step}; "
          f"validation loss {recorded} as recorded{measured}) to {', '.join(str(f) for f in result.files)}")
    return EXIT_OK


def _watch_status(home: Path, interval: float, rows: int | None) -> int:
    """Redraw the readable status in place; a daemon that goes away is shown, not fatal."""
    from node.ops.control import ControlError, request_status
    from node.ops.status_view import render_status

    clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
    try:
        while True:
            try:
                body = render_status(request_status(home), rows)
            except ControlError as e:
                body = f"starling: {e}"
            stamp = time.strftime("%H:%M:%S")
            sys.stdout.write(f"{clear}{body}\n\n(refreshing every {interval:g}s at {stamp}; Ctrl+C to quit)\n")
            sys.stdout.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        return EXIT_OK


def _abbreviation_hint(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """' (options are not abbreviated: did you mean --home?)' when an unknown option begins a known one."""
    for token in unknown:
        name = token.split("=", 1)[0]
        if not name.startswith("--"):
            continue
        options = sorted(o for o in parser._option_string_actions if o.startswith(name) and o != name)
        if options:
            return f" (options are not abbreviated: did you mean {' or '.join(options)}?)"
    return ""


def home_problem(home: Path) -> str | None:
    """Why `home` can never be a node directory (a regular file, or under one), else None."""
    if home.exists() and not home.is_dir():
        return f"{home} is not a directory (--home or STARLING_HOME must name the node's directory)"
    for parent in home.parents:
        if parent.exists():
            if not parent.is_dir():
                return f"{home}: {parent} is not a directory (--home or STARLING_HOME must name the node's directory)"
            break
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse would blame the top-level parser and print its usage, not the command's
        tokens = list(sys.argv[1:] if argv is None else argv)
        before_command = tokens.index(unknown[0]) < tokens.index(args.command) if unknown[0] in tokens else False
        blamed = parser if before_command else args._parser
        blamed.error(f"unrecognized arguments: {' '.join(unknown)}{_abbreviation_hint(blamed, unknown)}")
    if hasattr(args, "home"):
        from node.config.load import resolve_home

        problem = home_problem(resolve_home(args.home))
        if problem:
            return _die(problem)
    handlers = {
        "init": cmd_init,
        "run": cmd_run,
        "status": cmd_status,
        "plot": cmd_plot,
        "swarm-key": cmd_swarm_key,
        "doctor": cmd_doctor,
        "export": cmd_export,
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
