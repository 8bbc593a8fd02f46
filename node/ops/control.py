"""The local control socket: `HOME/control.sock`, mode 0600, one JSON request and one JSON answer per line.

Why a Unix socket: only the node's own user can reach it (the file mode is the access control), it needs
no port, and `starling status` works even when the node's network is wedged. Each client gets a deadline
and a bounded request size, so a stuck or hostile local client cannot hold the daemon.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import trio

from node.config.home import Home

if TYPE_CHECKING:
    from node.status_schema import NodeStatus

log = logging.getLogger("starling.control")

MAX_REQUEST = 64 * 1024
MAX_RESPONSE = 16 * 1024 * 1024
CLIENT_TIMEOUT_S = 5.0

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class ControlError(Exception):
    """No daemon answers on the socket, or it answered garbage."""


async def _read_line(stream: trio.SocketStream, limit: int) -> bytes:
    buf = bytearray()
    while b"\n" not in buf:
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        buf += chunk
        if len(buf) > limit:
            raise ValueError("message too large")
    return bytes(buf.split(b"\n", 1)[0])


async def serve_control(
    path: Path, handler: Handler, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve requests on `path` until cancelled; the socket file is removed on exit."""
    if path.exists() or path.is_symlink():
        path.unlink()  # a stale socket from a crashed daemon; the lock file proves nobody owns it
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        await sock.bind(str(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(16)
    listener = trio.SocketListener(sock)

    async def client(stream: trio.SocketStream) -> None:
        async with stream:
            with trio.move_on_after(CLIENT_TIMEOUT_S):
                try:
                    line = await _read_line(stream, MAX_REQUEST)
                    request = json.loads(line)
                    if not isinstance(request, dict) or not isinstance(request.get("cmd"), str):
                        raise ValueError("request must be a JSON object with a 'cmd'")
                    answer = await handler(request)
                except ValueError as e:
                    answer = {"ok": False, "error": f"bad request: {e}"}
                except RecursionError:  # absurdly nested JSON
                    answer = {"ok": False, "error": "bad request: nested too deeply"}
                except trio.BrokenResourceError:
                    return
                except Exception as e:  # a bug in a handler must not take the daemon down
                    log.exception("control request failed")
                    answer = {"ok": False, "error": f"internal error: {type(e).__name__}"}
                try:
                    await stream.send_all(json.dumps(answer).encode() + b"\n")
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

    try:
        async with listener:
            task_status.started()
            await trio.serve_listeners(client, [listener])
    finally:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def request_sync(path: Path, request: dict[str, Any], *, timeout: float = 10.0) -> dict[str, Any]:
    """Blocking client for the CLI: send one request, return the decoded answer, or raise ControlError."""
    if not path.exists():
        raise ControlError(f"no daemon is running on {path.parent} (no {path.name})")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        try:
            s.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            raise ControlError(f"no daemon is running on {path.parent} (stale {path.name})") from None
        except PermissionError:
            raise ControlError(f"{path}: permission denied (run as the daemon's user)") from None
        s.sendall(json.dumps(request).encode() + b"\n")
        buf = bytearray()
        while b"\n" not in buf:
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            buf += chunk
            if len(buf) > MAX_RESPONSE:
                raise ControlError("daemon answer too large")
    except TimeoutError:
        raise ControlError(f"the daemon on {path.parent} did not answer within {timeout:.0f}s") from None
    except OSError as e:
        raise ControlError(f"control socket {path}: {e}") from None
    finally:
        s.close()
    try:
        answer = json.loads(bytes(buf).split(b"\n", 1)[0])
    except (ValueError, UnicodeDecodeError):
        raise ControlError("the daemon sent an unreadable answer") from None
    if not isinstance(answer, dict):
        raise ControlError("the daemon sent an unreadable answer")
    return answer


def request_status(home: Path, *, timeout: float = 10.0) -> NodeStatus:
    """The status of the daemon on `home` (the dict `starling status --json` prints), over its control
    socket: the one status client of the launcher (node/ops/launcher.py), tests and benchmarks.

    Raises :class:`ControlError` when no daemon answers, or when it answers with an error."""
    answer = request_sync(Home(home).control_socket, {"cmd": "status"}, timeout=timeout)
    status = answer.get("status")
    if not answer.get("ok") or not isinstance(status, dict):
        raise ControlError(f"daemon error: {answer.get('error')}")
    return cast("NodeStatus", status)  # the daemon built it as one (node/status_schema.py)
