"""Swarm authorization: a shared swarm key (libp2p private network) and an optional PeerID allowlist.

The swarm key is py-libp2p's private-network PSK: every TCP connection is wrapped in a Salsa20 stream
keyed by the 32-byte swarm key *before* multistream and Noise run, so a node without the key cannot
complete a handshake at all: it reaches no DHT, no state, no averaging protocol. (py-libp2p's pnet uses
an 8-byte nonce, not go-libp2p's XSalsa20, so it only interoperates with py-libp2p; Starling is py-only.)
Noise still authenticates and encrypts everything inside.

The allowlist narrows a keyed swarm to named PeerIDs: streams from other peers are refused and their
connections closed. Refusals of both kinds are logged (rate-limited) and counted for `status`.

On the dialling side the same mistakes used to show only as a dial timeout or py-libp2p's
`SwarmDialAllFailedError` (the cause was logged by the other node, if at all). `AccessControl` also watches
this node's outbound handshakes and keeps, per peer, why the last one failed once a TCP connection was
open (`explain_dial`, which the connection manager puts in its warning and in `status`): another PeerID
answered at that address (Noise proves which), the peer refused or never completed the handshake (with
a private-network key, a different swarm key or none is the likely cause: the other side reads noise),
or it closed the connection right after the handshake (its `node.allow_peers` does not list us).

The key file uses the format IPFS/go-libp2p operators know (libp2p's pnet spec), written as:
    /key/swarm/psk/1.0.0/
    /base16/
    <64 hex digits>
and read in any of the spec's encodings (`/base16/`, `/base64/`, `/bin/`), as 64 hex digits alone, or as
a raw 32-byte file.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import logging
import os
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from libp2p.transport.exceptions import SecurityUpgradeFailure

from p2p.status import AuthorizationStatus

log = logging.getLogger("starling.auth")

_HEADER = ["/key/swarm/psk/1.0.0/", "/base16/"]
LOG_EVERY_S = 60.0


class SwarmKeyError(Exception):
    """The swarm key file is missing or malformed; the message names the file."""


def generate_swarm_key() -> str:
    return secrets.token_bytes(32).hex()


def format_swarm_key(key_hex: str) -> str:
    return "\n".join([*_HEADER, key_hex]) + "\n"


def write_swarm_key(path: Path, key_hex: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(format_swarm_key(key_hex))


def read_swarm_key(path: Path) -> str:
    """The key as 64 hex digits, from any encoding of libp2p's PSK v1 file, a bare hex line or a raw file.

    libp2p's pnet spec: a `/key/swarm/psk/1.0.0/` line, then `/base16/`, `/base64/` or `/bin/` and the
    32-byte key in that encoding (`/bin/`: the raw bytes). Operators also keep keys as 64 hex digits alone
    or as a raw 32-byte file (`head -c 32 /dev/urandom`); both are accepted. The file is read as bytes:
    a raw key is not text, and must not fail as a UTF-8 error that names no format.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SwarmKeyError(f"{path}: no such swarm key file") from None
    except OSError as e:
        raise SwarmKeyError(f"{path}: cannot read the swarm key ({e.strerror or e})") from None
    return decode_swarm_key(data, str(path)).hex()


def decode_swarm_key(data: bytes, where: str) -> bytes:
    """The 32 key bytes of a swarm key file's contents (see read_swarm_key); SwarmKeyError names `where`."""
    header = _HEADER[0].encode()
    if data.startswith(header):
        rest = data[len(header) :]
        if not rest.startswith((b"\n", b"\r\n")):
            raise SwarmKeyError(f"{where}: expected a line break after {_HEADER[0]}")
        codec, sep, body = rest.lstrip(b"\r\n").partition(b"\n")
        codec = codec.rstrip(b"\r")
        if not sep or codec not in _CODECS:
            shown = codec[:20].decode("ascii", "replace")
            raise SwarmKeyError(f"{where}: unknown swarm key encoding {shown!r} after {_HEADER[0]} "
                                f"(expected /base16/, /base64/ or /bin/)")
        return _CODECS[codec](body, where)
    if len(data) == KEY_BYTES and not _is_hex_text(data):
        return data  # a raw key file
    text = data.strip()
    if _is_hex_text(text) and len(text) == 2 * KEY_BYTES:
        return bytes.fromhex(text.decode("ascii"))
    if _is_hex_text(text):
        raise SwarmKeyError(f"{where}: {len(text)} hex digits, but a swarm key is {2 * KEY_BYTES} ({KEY_BYTES} bytes)")
    raise SwarmKeyError(f"{where}: not a swarm key ({_EXPECTED})")


KEY_BYTES = 32
_EXPECTED = (f"expected {_HEADER[0]} then /base16/, /base64/ or /bin/ and a {KEY_BYTES}-byte key, "
             f"64 hex digits, or a raw {KEY_BYTES}-byte file")


def _is_hex_text(data: bytes) -> bool:
    return bool(data) and all(c in b"0123456789abcdefABCDEF" for c in data)


def _decode_base16(body: bytes, where: str) -> bytes:
    text = body.strip()
    if not _is_hex_text(text) or len(text) != 2 * KEY_BYTES:
        raise SwarmKeyError(f"{where}: after /base16/ expected {2 * KEY_BYTES} hex digits")
    return bytes.fromhex(text.decode("ascii"))


def _decode_base64(body: bytes, where: str) -> bytes:
    try:
        key = base64.b64decode(body.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise SwarmKeyError(f"{where}: after /base64/ expected the key in base64") from None
    if len(key) != KEY_BYTES:
        raise SwarmKeyError(f"{where}: after /base64/ the key is {len(key)} bytes, not {KEY_BYTES}")
    return key


def _decode_bin(body: bytes, where: str) -> bytes:
    # The key is the bytes themselves; a line break after them (an editor's) is not part of it.
    if len(body) == KEY_BYTES + 1 and body.endswith(b"\n"):
        body = body[:-1]
    if len(body) != KEY_BYTES:
        raise SwarmKeyError(f"{where}: after /bin/ expected {KEY_BYTES} raw bytes, found {len(body)}")
    return body


_CODECS = {b"/base16/": _decode_base16, b"/base64/": _decode_base64, b"/bin/": _decode_bin}


# A node at its connection limit (p2p/host.py, 2 x node.max_peers) refuses the handshake too, and the dialler
# cannot tell the two apart (bench/scale.py, 64 daemons behind one bootstrap node): the line says both.
KEY_MISMATCH_FIX = ("a different swarm key (or none) is the likely cause; check HOME/swarm.key on both nodes "
                    "(a node at its connection limit refuses handshakes too: see its `starling status`)")
MAX_DIAL_FAILURES = 1024  # peers whose last failed outbound handshake is remembered


@dataclass(frozen=True)
class DialFailure:
    """Why this node's last outbound handshake with a peer failed, after its TCP connection opened."""

    addr: str  # host:port dialled
    kind: str  # wrong_peer | refused | stalled | closed
    actual: str = ""  # wrong_peer: the PeerID that answered there
    at: float = dataclasses.field(default_factory=time.monotonic)


def _answering_peer(exc: BaseException | None, depth: int = 0) -> str | None:
    """The PeerID py-libp2p names in a Noise "peer id does not correspond" or an upgrader "Peer ID
    mismatch" error anywhere in `exc`'s chain, else None."""
    import re

    if exc is None or depth > 12:
        return None
    m = re.search(r"remote_peer_id_from_pubkey=(\w+)|Peer ID mismatch: expected \w+, got (\w+)", str(exc))
    if m:
        return m.group(1) or m.group(2)
    return _answering_peer(exc.__cause__ or exc.__context__, depth + 1)


def _addr_text(raw_conn: Any) -> str:
    try:
        addr = raw_conn.get_remote_address()
    except Exception:  # a relayed or closed connection may have none
        addr = None
    return f"{addr[0]}:{addr[1]}" if addr else "an unknown address"


class AccessControl:
    """Counts and logs refused peers; enforces the allowlist on streams and connections; contains
    exceptions of stream handlers (ours and py-libp2p's) to their stream; remembers why this node's own
    handshakes failed (`explain_dial`)."""

    def __init__(self, *, keyed: bool, allow: Iterable[str] = ()) -> None:
        self.keyed = keyed
        self.allow = set(allow)
        self.refused_handshakes = 0
        self.refused_peers = 0
        self.dial_failures: dict[str, DialFailure] = {}  # peer id -> the last failed outbound handshake
        self._dialled: dict[str, str] = {}  # peer id -> host:port of its last secured outbound connection
        self.own_peer_id = ""
        self._last_log: dict[str, float] = {}

    def _note_dial_failure(self, peer_id: Any, failure: DialFailure) -> None:
        if len(self.dial_failures) >= MAX_DIAL_FAILURES:
            self.dial_failures.clear()
        self.dial_failures[str(peer_id)] = failure

    def explain_dial(self, peer_id: str, since: float = 0.0) -> str | None:
        """One line on why dialling `peer_id` fails, from its last outbound handshake if that failed at or
        after `since` (time.monotonic); None when none did (unreachable, or it worked since)."""
        f = self.dial_failures.get(peer_id)
        if f is None or f.at < since:
            return None
        if f.kind == "wrong_peer":
            return (f"the peer at {f.addr} is {f.actual}, not {peer_id}: correct the PeerID after /p2p/ in the "
                    "address (`starling status` on that node prints its own)")
        if f.kind == "closed":
            return (f"peer at {f.addr} closed the connection right after the handshake: its node.allow_peers "
                    f"probably does not list this node ({self.own_peer_id or 'this PeerID'})")
        verb = "did not complete" if f.kind == "stalled" else "refused"
        return f"peer at {f.addr} {verb} the handshake: {KEY_MISMATCH_FIX}"

    def allowed(self, peer_id: str) -> bool:
        return not self.allow or peer_id in self.allow

    def _log(self, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last_log.get(key, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._last_log[key] = now
            if len(self._last_log) > 1024:
                self._last_log.clear()
            log.warning(msg, *args)

    def install(self, host: Any) -> None:
        """Wrap the host's inbound security upgrade and its stream handlers (narrow, instance-level)."""
        network = host.get_network()
        upgrader = network.upgrader
        upgrade_security = upgrader.upgrade_security
        control = self

        control.own_peer_id = str(host.get_id())

        async def counted_upgrade(raw_conn: Any, is_initiator: bool, peer_id: Any = None) -> Any:
            deadline = trio.current_effective_deadline()
            try:
                secured = await upgrade_security(raw_conn, is_initiator, peer_id)
            except BaseException as e:  # trio.Cancelled too: the dial's deadline fired mid-handshake
                if is_initiator and peer_id is not None:
                    actual = _answering_peer(e)
                    kind = "wrong_peer" if actual else ("refused" if isinstance(e, Exception) else "stalled")
                    control._note_dial_failure(peer_id, DialFailure(_addr_text(raw_conn), kind, actual or ""))
                # An inbound handshake cut by py-libp2p's upgrade deadline (10 s) is refused as surely as one that
                # failed: a peer with another swarm key sends bytes that decrypt to a huge length prefix, and
                # whether its own 10 s dial timeout or our deadline comes first is a race. A cancellation
                # before the deadline (this node stopping) is not a refusal.
                timed_out = isinstance(e, trio.Cancelled) and trio.current_time() >= deadline
                if not is_initiator and (isinstance(e, Exception) or timed_out):
                    control.refused_handshakes += 1
                    addr = raw_conn.get_remote_address() if hasattr(raw_conn, "get_remote_address") else None
                    who = f"{addr[0]}:{addr[1]}" if addr else "an unknown address"
                    control._log(
                        f"hs:{addr[0] if addr else '?'}",
                        "refused a connection from %s: its handshake failed (%s)",
                        who,
                        ("wrong or missing swarm key, or not a Starling node" if control.keyed else "not a libp2p/Noise peer")
                        # A handshake that never completed reads the same here: seen on a 0.08 Mbit/s link that
                        # gossip filled (bench/wan.py one-slow), where honest peers' handshakes timed out.
                        + "; or it did not complete: a slow or lossy link, or the dialler gave up",
                    )
                raise
            remote = str(secured.get_remote_peer())
            if not control.allowed(remote):
                # The Noise handshake proved who it is; it is not on the list: no connection at all.
                control.refused_peers += 1
                control._log(f"peer:{remote}", "refused a connection with %s: not in node.allow_peers", remote)
                with contextlib.suppress(Exception):
                    await secured.close()
                raise SecurityUpgradeFailure(f"{remote} is not in node.allow_peers")
            if is_initiator and peer_id is not None:
                control.dial_failures.pop(str(peer_id), None)
                if len(control._dialled) >= MAX_DIAL_FAILURES:
                    control._dialled.clear()
                control._dialled[str(peer_id)] = _addr_text(raw_conn)
            return secured

        upgrader.upgrade_security = counted_upgrade

        upgrade_connection = upgrader.upgrade_connection

        async def watched_upgrade_connection(secured: Any, peer_id: Any) -> Any:
            try:
                return await upgrade_connection(secured, peer_id)
            except Exception:
                # Noise is done (our side finished last), then the muxer negotiation found the connection
                # closed: what a peer does whose allowlist leaves us out.
                if getattr(secured, "is_initiator", False):
                    addr = control._dialled.get(str(peer_id), "an unknown address")
                    control._note_dial_failure(peer_id, DialFailure(addr, "closed"))
                raise

        upgrader.upgrade_connection = watched_upgrade_connection

        set_handler = host.set_stream_handler

        def gated_set_stream_handler(protocol_id: Any, handler: Any) -> None:
            async def gated(stream: Any) -> None:
                peer = str(stream.muxed_conn.peer_id)
                if not control.allowed(peer):
                    control.refused_peers += 1
                    control._log(f"peer:{peer}", "refused %s on %s: not in node.allow_peers", peer, protocol_id)
                    with contextlib.suppress(Exception):
                        await stream.reset()
                    return
                try:
                    await handler(stream)
                except Exception as e:
                    # py-libp2p lets a handler's exception escape and take the whole host down (e.g. its
                    # pubsub handler on one malformed protobuf frame): contain it to this stream.
                    control._log(f"handler:{protocol_id}", "%s from %s failed: %s: %s", protocol_id, peer,
                                 type(e).__name__, e)
                    with contextlib.suppress(Exception):
                        await stream.reset()

            set_handler(protocol_id, gated)

        host.set_stream_handler = gated_set_stream_handler  # handlers registered from now on are wrapped

    async def disconnect_outsiders(self, host: Any, peers: Iterable[Any]) -> None:
        for peer_id in peers:
            if not self.allowed(str(peer_id)):
                self.refused_peers += 1
                self._log(f"peer:{peer_id}", "disconnecting %s: not in node.allow_peers", peer_id)
                try:
                    await host.disconnect(peer_id)
                except Exception as e:  # already gone
                    log.debug("disconnect %s: %s", peer_id, e)

    def status(self) -> AuthorizationStatus:
        return {
            "swarm_key": self.keyed,
            "allowlist": len(self.allow),
            "refused_handshakes": self.refused_handshakes,
            "refused_peers": self.refused_peers,
        }
