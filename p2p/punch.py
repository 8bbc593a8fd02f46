"""TCP hole punching for the bulk side channel: a simultaneous open between two peers behind NATs.

Why: DCUtR gives two NATed peers a direct libp2p connection, but py-libp2p's Noise + yamux stream moves
bulk tensors at a fraction of the side channel's rate for several times its CPU (``bench/nat.py``), and
the side channel's listener sits behind the responder's NAT where the initiator cannot dial it. So each
side binds a fresh TCP port, announces it over the (already hole-punched) libp2p control stream, and
both connect to each other at once. Each NAT sees its own host's outbound SYN first, so the other
side's SYN, or its SYN-ACK, matches that mapping and is let in: one TCP connection, established on both
sides.

What it needs: a NAT that keeps the source port and maps it the same way for every destination (the
common home router; DCUtR's TCP punch needs the same). The peer is assumed reachable at the public IP
its libp2p connection comes from and the port it announced. Where that does not hold (a symmetric or
port-randomising NAT, a firewall answering with RST), :func:`simultaneous_open` fails within its
deadline and the caller keeps the libp2p stream.
"""

from __future__ import annotations

import errno
import socket

import trio

from p2p.wire import ProtocolError, Reason

__all__ = ["PunchSocket", "simultaneous_open"]

#: One connect attempt: long enough for a SYN retransmission (Linux: 1 s), short enough to retry soon
#: after a NAT or host that answered with RST (no mapping yet, or nothing bound there yet).
ATTEMPT_S = 1.5
#: Between attempts after an immediate refusal, so a refusing peer is not flooded with SYNs.
RETRY_PAUSE_S = 0.1


class PunchSocket:
    """A TCP socket bound to a fresh local port, to announce to the peer before the simultaneous open.

    Binding first reserves the port number the peer will dial; the same port is reused for every
    connect attempt (``SO_REUSEADDR``), since the NAT mapping and the peer's SYNs are for that port.
    """

    def __init__(self, port: int = 0) -> None:
        self._sock: trio.socket.SocketType | None = self._bound(port)
        self.port: int = self._sock.getsockname()[1]

    @staticmethod
    def _bound(port: int) -> trio.socket.SocketType:
        # Bound with the stdlib (a numeric wildcard address needs no resolution), then handed to trio.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("0.0.0.0", port))
        except OSError:
            sock.close()
            raise
        return trio.socket.from_stdlib_socket(sock)

    def _take(self) -> trio.socket.SocketType:
        """The bound socket for the next attempt: the original once, then fresh ones on the same port."""
        if self._sock is not None:
            sock, self._sock = self._sock, None
            return sock
        return self._bound(self.port)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> PunchSocket:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def simultaneous_open(local: PunchSocket, remote: tuple[str, int], *, timeout: float) -> trio.SocketStream:
    """Connect from ``local``'s port to ``remote`` while the peer does the same towards us.

    Retries until ``timeout``: an attempt fails at once where the peer's NAT or host answers with RST
    (its SYN has not gone out yet), and times out where the NAT drops our SYN silently. Raises
    :class:`ProtocolError` (``BROKEN``) naming the address and the last error when no attempt got through.
    """
    deadline = trio.current_time() + timeout
    last = "no attempt made"
    while trio.current_time() < deadline:
        try:
            sock = local._take()
        except OSError as exc:  # the port was taken meanwhile: no point going on
            last = f"cannot bind port {local.port} again: {exc}"
            break
        with trio.move_on_at(min(deadline, trio.current_time() + ATTEMPT_S)):
            try:
                await sock.connect(remote)
            except OSError as exc:
                sock.close()
                last = errno.errorcode.get(exc.errno or 0, str(exc))
                await trio.sleep(min(RETRY_PAUSE_S, max(0.0, deadline - trio.current_time())))
                continue
            return trio.SocketStream(sock)
        sock.close()
        last = f"no answer within {ATTEMPT_S:g}s"
    raise ProtocolError(Reason.BROKEN, f"hole punch from port {local.port} to {remote[0]}:{remote[1]} failed: {last}")
