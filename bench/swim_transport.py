"""What a SWIM ping/ack round trip costs on py-libp2p, against a UDP datagram pair (issue #24).

Why: the SWIM core (node/swarm/membership.py) was designed, like SWIM itself, for cheap datagrams: it probes
a member each second, and the simulation (bench/scale_sim.py) counts ~137 messages per node per minute.
Starling's transport is py-libp2p (TCP + Noise + Yamux), where a connection costs a handshake and at least
250 ms on loopback (shared/design/py-libp2p-notes.md, pitfall 4), and with ``target_peers`` 8 of N most
members are not connected. This measures the candidate carriers before the daemon picks one.

Two hosts built by :func:`p2p.host.build_host` (as the daemon builds them) in one process on 127.0.0.1 (one
trio thread, so the CPU figures are *both sides together*: one ping sent, received, verified, answered, and
the ack received and verified). Each round trip sends a real :mod:`protocols.swim` ``Ping`` and ``Ack``; each
message carries one claim freshly signed by its sender with its ed25519 key (``cryptography``) and, for the
``full`` payload, relayed claims signed by others up to the core's 2 KiB piggy-back budget (what the
simulation's messages carry: ~2 KiB each); the receiver decodes with signature verification of every claim
(public keys cached per peer, as a daemon would). Carriers:

(a) ``stream``: a new libp2p stream per round trip on an existing connection (open, multistream-select the
    protocol, write the ping, read the ack, close);
(b) ``long``: one long-lived stream per peer pair, length-prefixed frames (:class:`p2p.wire.PlainFrameChannel`);
(c) ``connect``: a new connection per probe (dial: TCP + Noise + Yamux, then a stream, then disconnect);
(d) ``udp``: a raw trio UDP datagram pair; with no Noise session, each datagram also carries the sender's
    peer ID and its signature over the datagram (what it takes to know who sent it), so sign+verify twice.

Also the codec and crypto alone (no transport), and one ed25519 sign / verify; and (with the default ``full``
payload) every carrier again with 1-claim messages, where little crypto hides the carriers' own cost. Then what each option
costs a node per minute at the simulated rate: a node sends ~137 messages a minute and receives as many,
i.e. ~68.5 round trips' worth of both-sides work, about a third of them to a member it is not connected to.

Usage: python bench/swim_transport.py [--round-trips 300] [--connects 40] [--payload full|bare]
                                      [--messages-per-min 137] [--unconnected 0.33] [--write-docs]
Run it under ``flock /tmp/starling-heavy.lock`` (about a minute of one busy core); ``make bench-swim-transport``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cryptography.exceptions import InvalidSignature  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey  # noqa: E402

from protocols import swim  # noqa: E402
from starling_testing.report import replace_section  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
SECTION = "## Scale: SWIM's transport"
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
PROTOCOL = swim.PROTOCOL_ID
STEP_TIMEOUT_S = 10.0  # every network wait is bounded
RELAY_AUTHORS = 14  # relayed claims in a full message: 1 own + 14 Progress claims ~ the 2 KiB budget


# ------------------------------------------------------------------------------------------ identities


@dataclass
class Identity:
    """A node's ed25519 key: the libp2p key pair (for the host) and the same key in ``cryptography``."""

    key_pair: Any
    name: bytes  # peer ID bytes (identity multihash of the public key), as the codec puts them on the wire
    private: Ed25519PrivateKey

    @classmethod
    def new(cls) -> Identity:
        from libp2p.crypto.ed25519 import create_new_key_pair
        from libp2p.peer.id import ID

        key_pair = create_new_key_pair()
        private = Ed25519PrivateKey.from_private_bytes(key_pair.private_key.to_bytes()[:32])
        return cls(key_pair, ID.from_pubkey(key_pair.public_key).to_bytes(), private)


class Names:
    """The codec's ``name_of`` / ``id_of`` over a fixed set of identities, and a ``verify`` with public keys
    cached per peer (a daemon parses a member's key once, not per claim)."""

    def __init__(self, identities: list[Identity]) -> None:
        self.identities = identities
        self._ids = {ident.name: i for i, ident in enumerate(identities)}
        self._keys: dict[bytes, Ed25519PublicKey] = {}
        self.verified = 0

    def name_of(self, i: int) -> bytes:
        return self.identities[i].name

    def id_of(self, name: bytes) -> int | None:
        return self._ids.get(name)

    def verify(self, signer: bytes, data: bytes, sig: bytes) -> bool:
        key = self._keys.get(signer)
        if key is None:
            if len(signer) != 38:  # an ed25519 peer ID: identity multihash, the raw key its last 32 bytes
                return False
            key = self._keys[signer] = Ed25519PublicKey.from_public_bytes(signer[-32:])
        self.verified += 1
        try:
            key.verify(sig, data)
        except InvalidSignature:
            return False
        return True


def signed(update: Any, names: Names, author: Identity) -> Any:
    """``update`` with its author's signature over the codec's claim bytes."""
    sig = author.private.sign(swim.claim_bytes(update, names.name_of))
    return dataclasses.replace(update, sig=sig)


class Codec:
    """Builds and checks the messages of one round trip: node 0 pings node 1, node 1 acks.

    Each message carries a claim its sender signs now (its own ``Alive``, incarnation bumped so that no
    signature is reused) and, for the ``full`` payload, ``RELAY_AUTHORS`` relayed ``Progress`` claims signed
    by other members beforehand (relays forward signatures, they do not sign)."""

    def __init__(self, payload: str) -> None:
        self.identities = [Identity.new() for _ in range(2 + RELAY_AUTHORS)]
        self.names = Names(self.identities)
        self.relayed: tuple[Any, ...] = ()
        if payload == "full":
            self.relayed = tuple(
                signed(swim.Progress(i, 7, 1234, 2.5, 900.0), self.names, self.identities[i])
                for i in range(2, 2 + RELAY_AUTHORS))
        self.incarnation = 0
        self.seq = 0

    def _own(self, node: int) -> Any:
        self.incarnation += 1
        return signed(swim.Alive(node, self.incarnation), self.names, self.identities[node])

    def ping(self) -> bytes:
        self.seq += 1
        message = swim.Ping(0, self.seq, 1, (self._own(0), *self.relayed))
        return swim.encode(message, self.names.name_of)

    def answer(self, data: bytes) -> bytes:
        """Node 1's side: decode and verify the ping, encode its ack."""
        ping = swim.decode(data, 0, self.names.id_of, self.names.verify)
        if not isinstance(ping, swim.Ping) or ping.target != 1 or len(ping.updates) != 1 + len(self.relayed):
            raise AssertionError(f"a bad ping: {ping!r}")
        return swim.encode(swim.Ack(1, ping.seq, (self._own(1), *self.relayed)), self.names.name_of)

    def check_ack(self, data: bytes) -> None:
        ack = swim.decode(data, 1, self.names.id_of, self.names.verify)
        if not isinstance(ack, swim.Ack) or ack.seq != self.seq or len(ack.updates) != 1 + len(self.relayed):
            raise AssertionError(f"a bad ack: {ack!r}")


# ------------------------------------------------------------------------------------------ measuring


@dataclass
class Result:
    """One carrier: round trips done, CPU seconds (both sides) per round trip, wall latencies."""

    name: str
    round_trips: int
    cpu_s: float  # per round trip, both sides
    wall_s: list[float]
    ping_bytes: int = 0

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.wall_s) * 1e3

    @property
    def p99_ms(self) -> float:
        ordered = sorted(self.wall_s)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3


async def _timed(name: str, n: int, one: Callable[[], Awaitable[float | None]], warmup: int = 3) -> Result:
    """Run ``one`` round trip ``n`` times after ``warmup``; wall until the ack arrived (``one`` returns that
    moment, ``time.perf_counter()``, when it goes on closing afterwards; else until it returns)."""
    for _ in range(warmup):
        await one()
    walls = []
    cpu0 = time.process_time()
    for _ in range(n):
        t0 = time.perf_counter()
        with trio.fail_after(STEP_TIMEOUT_S):
            acked = await one()
        walls.append((acked if acked is not None else time.perf_counter()) - t0)
    return Result(name, n, (time.process_time() - cpu0) / n, walls)


def crypto_alone(n: int) -> tuple[float, float]:
    """CPU seconds of one ed25519 sign and one verify (``cryptography``, a 60-byte claim)."""
    key = Ed25519PrivateKey.generate()
    public = key.public_key()
    data = b"x" * 60
    sig = key.sign(data)
    t0 = time.process_time()
    for _ in range(n):
        key.sign(data)
    sign_s = (time.process_time() - t0) / n
    t0 = time.process_time()
    for _ in range(n):
        public.verify(sig, data)
    return sign_s, (time.process_time() - t0) / n


async def codec_alone(codec: Codec, n: int) -> Result:
    async def one() -> None:
        codec.check_ack(codec.answer(codec.ping()))

    return await _timed("codec + signatures, no transport", n, one)


# ------------------------------------------------------------------------------------------ libp2p


async def _serve(host: Any, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    import multiaddr

    async with host.run([multiaddr.Multiaddr(LOOPBACK)]):
        task_status.started()
        await trio.sleep_forever()


def _channel(stream: Any) -> Any:
    from p2p.wire import LibP2PByteStream, PlainFrameChannel

    return PlainFrameChannel(LibP2PByteStream(stream), max_frame_size=swim.MAX_MESSAGE_BYTES)


async def libp2p_carriers(codec: Codec, n: int, connects: int, idle_s: float = 2.0) -> tuple[list[Result], float]:
    """(a), (b) and (``connects`` > 0) (c) between hosts built like the daemon's; also the hosts' idle CPU
    (s per s, measured over ``idle_s``; 0: not measured)."""
    from libp2p.peer.peerinfo import info_from_p2p_addr

    from p2p.host import build_host
    from p2p.wire import close_quietly

    server, client = (build_host(codec.identities[i].key_pair) for i in (1, 0))
    dialer = build_host(Identity.new().key_pair)  # for (c): a host of its own, never connected beforehand

    async def handler(stream: Any) -> None:
        """Node 1: answer every ping on the stream until the other side closes it."""
        from p2p.wire import ProtocolError, Reason

        channel = _channel(stream)
        try:
            while True:
                with trio.fail_after(STEP_TIMEOUT_S * 3):
                    data = await channel.recv()
                if not data:
                    break
                await channel.send(codec.answer(data))
        except ProtocolError as exc:
            if exc.reason is not Reason.CLOSED:  # a stream per round trip ends without a close frame
                failures.append(exc)
            await close_quietly(stream, reset=exc.reason is not Reason.CLOSED)
            return
        except Exception as exc:  # noqa: BLE001 - recorded and raised by the measuring side
            failures.append(exc)
            await close_quietly(stream, reset=True)
            return
        await close_quietly(stream)

    results: list[Result] = []
    failures: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        for host in (server, client, dialer):
            await nursery.start(_serve, host)
        server.set_stream_handler(PROTOCOL, handler)
        info = info_from_p2p_addr(server.get_addrs()[0])
        with trio.fail_after(STEP_TIMEOUT_S):
            await client.connect(info)

        # idle: three connected-or-listening hosts doing nothing (what the figures below include)
        idle = 0.0
        if idle_s > 0:
            cpu0 = time.process_time()
            await trio.sleep(idle_s)
            idle = (time.process_time() - cpu0) / idle_s

        async def exchange(stream: Any, channel: Any) -> None:
            await channel.send(codec.ping())
            codec.check_ack(await channel.recv())

        async def new_stream() -> None:  # (a)
            stream = await client.new_stream(info.peer_id, [PROTOCOL])
            try:
                await exchange(stream, _channel(stream))
            finally:
                await close_quietly(stream)

        results.append(await _timed("(a) new stream per round trip, existing connection", n, new_stream))

        stream = await client.new_stream(info.peer_id, [PROTOCOL])  # (b)
        channel = _channel(stream)
        try:
            results.append(await _timed("(b) one long-lived stream, framed", n,
                                        lambda: exchange(stream, channel)))
        finally:
            await channel.close_send()
            await close_quietly(stream)

        async def new_connection() -> float:  # (c): wall to the ack; the disconnect (~200 ms) is CPU only
            await dialer.connect(info)
            try:
                stream = await dialer.new_stream(info.peer_id, [PROTOCOL])
                try:
                    await exchange(stream, _channel(stream))
                    return time.perf_counter()
                finally:
                    await close_quietly(stream)
            finally:
                await dialer.disconnect(info.peer_id)

        if connects > 0:
            results.append(await _timed("(c) new connection per probe (dial, stream, disconnect; wall to the ack)",
                                        connects,
                                        new_connection, warmup=1))
        nursery.cancel_scope.cancel()
    if failures:
        raise RuntimeError(f"the answering side failed: {failures[0]!r}")
    return results, idle


# ------------------------------------------------------------------------------------------ UDP


async def udp_carrier(codec: Codec, n: int) -> Result:
    """(d): one datagram each way; each carries ``sender peer ID || signature over the rest || message``."""
    names = codec.names
    a, b = codec.identities[0], codec.identities[1]

    def seal(ident: Identity, body: bytes) -> bytes:
        return ident.name + ident.private.sign(body) + body

    def open_(datagram: bytes, expect: int) -> bytes:
        sender, sig, body = datagram[:38], datagram[38:102], datagram[102:]
        if names.id_of(sender) != expect or not names.verify(sender, body, sig):
            raise AssertionError("a datagram from someone else")
        return body

    sa, sb = trio.socket.socket(type=trio.socket.SOCK_DGRAM), trio.socket.socket(type=trio.socket.SOCK_DGRAM)
    with sa, sb:
        await sa.bind(("127.0.0.1", 0))
        await sb.bind(("127.0.0.1", 0))

        async def responder() -> None:
            while True:
                datagram, addr = await sb.recvfrom(65536)
                await sb.sendto(seal(b, codec.answer(open_(datagram, 0))), addr)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(responder)

            async def one() -> None:
                await sa.sendto(seal(a, codec.ping()), sb.getsockname())
                datagram, _ = await sa.recvfrom(65536)
                codec.check_ack(open_(datagram, 1))

            result = await _timed("(d) UDP datagram pair (+ sender signature)", n, one)
            nursery.cancel_scope.cancel()
    return result


# ------------------------------------------------------------------------------------------ report


@dataclass
class Report:
    sign_s: float
    verify_s: float
    codec: Result
    carriers: list[Result]
    idle_cpu: float
    ping_bytes: int
    claims: int
    messages_per_min: float
    unconnected: float
    bare: dict[str, Result] = dataclasses.field(default_factory=dict)  # the same carriers, 1-claim messages

    def per_min(self, connected: Result, unconnected: Result) -> float:
        """CPU seconds per node per minute: half the messages are round trips of both-sides work."""
        trips = self.messages_per_min / 2
        return trips * ((1 - self.unconnected) * connected.cpu_s + self.unconnected * unconnected.cpu_s)

    def by_key(self, key: str) -> Result:
        return next(r for r in self.carriers if r.name.startswith(key))


async def measure(round_trips: int, connects: int, payload: str, messages_per_min: float = 137.0,
                  unconnected: float = 0.33) -> Report:
    codec = Codec(payload)
    ping_bytes = len(codec.ping())
    claims = 1 + len(codec.relayed)
    sign_s, verify_s = crypto_alone(max(200, round_trips))
    codec_result = await codec_alone(codec, round_trips)
    carriers, idle = await libp2p_carriers(codec, round_trips, connects)
    carriers.append(await udp_carrier(codec, round_trips))
    report = Report(sign_s, verify_s, codec_result, carriers, idle, ping_bytes, claims, messages_per_min,
                    unconnected)
    if payload == "full":  # again with one claim a message: the carriers' own cost, with little crypto
        small = Codec("bare")
        bare = [await codec_alone(small, round_trips)]
        more, _ = await libp2p_carriers(small, round_trips, connects, idle_s=0)
        bare += [*more, await udp_carrier(small, round_trips)]
        report.bare = {r.name[:3]: r for r in bare}
    return report


def render(report: Report, command: str) -> str:
    r = report
    a, b, c, d = (r.by_key(k) for k in ("(a)", "(b)", "(c)", "(d)"))
    trips = r.messages_per_min / 2
    lines = [
        SECTION, "",
        f"Command: `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
        f"{platform.machine()}, Python {platform.python_version()}). Two py-libp2p hosts built by "
        "`p2p.host.build_host` (TCP + Noise + Yamux, as the daemon builds them) in one process on 127.0.0.1, "
        "so CPU is *both sides of a round trip together* (process CPU time; one trio thread): node A sends a "
        f"`protocols.swim` `Ping` ({r.ping_bytes} bytes, {r.claims} signed claims: one its sender signs now, "
        "the rest relayed claims signed by others, the core's 2 KiB piggy-back budget as in the simulation), "
        "node B decodes it verifying every claim's ed25519 signature (`cryptography`, public keys cached per "
        "peer) and answers an `Ack` of the same shape, which A decodes and verifies. Wall is one round trip on "
        f"loopback, so it shows per-message software latency, not network distance. The hosts' idle CPU, "
        f"included below, was {r.idle_cpu * 1e3:.1f} ms per second.",
        "",
        f"| carrier | round trips | CPU ms per round trip (both sides), {r.claims}-claim messages | "
        "CPU ms, 1-claim messages | wall ms p50 / p99 |",
        "|---|---|---|---|---|",
        f"| ed25519 sign / verify alone (`cryptography`) | - | {r.sign_s * 1e3:.3f} / {r.verify_s * 1e3:.3f} "
        "per signature | - | - |",
    ]
    for res in [r.codec, *r.carriers]:
        small = r.bare.get(res.name[:3])
        small_ms = f"{small.cpu_s * 1e3:.2f}" if small is not None else "-"
        lines.append(f"| {res.name} | {res.round_trips} | {res.cpu_s * 1e3:.2f} | {small_ms} | "
                     f"{res.p50_ms:.2f} / {res.p99_ms:.2f} |")
    lines += [
        "",
        f"Per node per minute at the simulated rate ({r.messages_per_min:.0f} messages sent a minute and as many "
        f"received: {trips:.1f} round trips' worth of both-sides work), "
        f"{r.unconnected:.0%} of them to a member the node is not connected to (`target_peers` 8 of N):",
        "",
        "| how the daemon would carry SWIM | CPU s per node per minute | share of one core |",
        "|---|---|---|",
    ]
    options = [
        ("(d) UDP for everything (SWIM's design; needs its own sender authentication, no NAT traversal)", d, d),
        ("(b) long-lived streams, probing only members the node is connected to (SWIM on the connection "
         "graph: each member probed by its ~8 neighbours, no dial)", b, b),
        ("(b) for connected members, (c) a new connection for the others", b, c),
        ("(a) a stream per message for connected members, (c) for the others", a, c),
        ("(c) a new connection per probe for everything", c, c),
    ]
    for label, conn, unconn in options:
        cost = r.per_min(conn, unconn) if conn is not unconn else trips * conn.cpu_s
        lines.append(f"| {label} | {cost:.2f} | {cost / 60:.2%} |")
    verify_rt = 2 * r.claims * r.verify_s
    base = r.bare or {res.name[:3]: res for res in (r.codec, *r.carriers)}
    small_codec = f"; 1-claim messages cost {r.bare['cod'].cpu_s * 1e3:.1f} ms" if r.bare else ""
    over = "" if r.bare else " (not measured: these are the full messages')"
    over_a, over_b, over_d = (base[k].cpu_s - base["cod"].cpu_s for k in ("(a)", "(b)", "(d)"))
    dials = trips * r.unconnected
    lines += [
        "",
        f"Reading it. Most of a round trip's CPU is the message, not the carrier: of the "
        f"{r.codec.cpu_s * 1e3:.1f} ms the codec and signatures take alone, verifying the {2 * r.claims} "
        f"claims of a ping and its ack at the price measured apart ({r.verify_s * 1e3:.2f} ms each) comes "
        f"to {verify_rt * 1e3:.1f} ms: nearly all of it (msgpack, which decode also runs again on each claim "
        f"to rebuild the signed bytes, is the rest{small_codec}). Each claim reaches a node "
        "many times (every node that learns it retransmits it 4 x log10 N times), so a cache of claims "
        f"already verified would remove most of that. The carriers' own cost shows best with 1-claim "
        f"messages{over}: on a connection that already exists a long-lived stream adds "
        f"{over_b * 1e3:.1f} ms per round trip to the codec alone (UDP "
        f"{over_d * 1e3:.1f} ms, its extra sender signature included), a fresh stream per round trip "
        f"{over_a * 1e3:.1f} ms (multistream-select, Yamux open and close). CPU figures move by 10-20% "
        "between runs on this shared 2-core machine (other sessions' work), so differences of a millisecond "
        "between the full-message rows are noise. "
        f"A new connection costs {c.cpu_s * 1e3:.1f} ms of CPU (Noise's X25519 and "
        f"signature, multistream twice) and {c.p50_ms:.0f} ms of wall to the ack even on loopback (py-libp2p's "
        "`connect` takes ~250 ms there, shared/design/py-libp2p-notes.md pitfall 4, and its `disconnect` "
        "another ~200 ms after the ack), half the core's 500 ms `ack_timeout_s`; over a WAN the handshake adds several round trips (TCP, multistream, Noise XX, "
        "Yamux) before the ping, so a direct probe of an unconnected member would often be taken for a "
        f"failure. At the simulated rate that is ~{dials:.0f} dials a minute per node, and as many accepted. "
        "Indirect probes do not avoid the dials: the members asked to ping an unconnected target are "
        "themselves connected to only 8 of N, so they would have to dial it too.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round-trips", type=int, default=300, help="round trips per carrier (a), (b), (d)")
    parser.add_argument("--connects", type=int, default=40, help="round trips of (c), each a new connection")
    parser.add_argument("--payload", choices=("full", "bare"), default="full",
                        help="full: ~2 KiB messages of 15 signed claims (the simulation's); bare: one claim")
    parser.add_argument("--messages-per-min", type=float, default=137.0, help="bench/scale_sim.py's figure")
    parser.add_argument("--unconnected", type=float, default=0.33, help="share of probes to unconnected members")
    parser.add_argument("--write-docs", action="store_true", help=f"write `{SECTION}` of docs/benchmarks.md")
    args = parser.parse_args(argv)
    if args.round_trips < 1 or args.connects < 1 or not 0 <= args.unconnected <= 1:
        parser.error("--round-trips and --connects must be positive, --unconnected in [0, 1]")
    import logging

    logging.disable(logging.WARNING)  # libp2p's import-time noise
    report = trio.run(measure, args.round_trips, args.connects, args.payload, args.messages_per_min,
                      args.unconnected)
    command = "python bench/swim_transport.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = render(report, command.strip())
    print(text)
    if args.write_docs:
        replace_section(DOCS, SECTION, text)
        print(f"wrote {SECTION!r} to {DOCS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
