"""The `[sync]` section: how a node pairs with a partner and moves tensors at each outer step."""

from __future__ import annotations

from dataclasses import dataclass

from node.config.base import opt
from protocols.compress import MAX_FRAGMENTS, PRESETS

WIRE_DTYPES = ("fp32", "bf16", "int8")
# `auto` (node/averaging/compression_choice.py): each exchange's initiator picks one of the presets from what it measured.
COMPRESSIONS = ("auto", *PRESETS)
PACES = ("swarm", "steps")


@dataclass
class SyncConfig:
    wire_dtype: str = opt("bf16", "tensor encoding on the wire: fp32 | bf16 | int8 (blockwise, fp32 accumulation)")
    compression: str = opt("auto", "what crosses the wire per outer step: auto (the initiator of each exchange picks "
                           "the least compressed preset whose transfer, at the partner's measured rate, fits in an "
                           "outer step's compute; none before a rate is measured or with group_size 4) | none (phi "
                           "and Delta in wire_dtype, 4 B/param in bf16) | medium (top 1/16 of Delta + a quarter of "
                           "phi in int8, 0.44 B/param) | high (top 1/64 + a 32nd, 0.08 B/param); a trainer applies its own "
                           "Delta in full and error feedback keeps what is not sent yet for the next partner. Every "
                           "trainer of a swarm must use the same")
    fragments: int = opt(1, "streaming fragments (issue #23): 1 syncs the whole model at each outer step | F (2..64) "
                         "cuts it into F contiguous fragments, fragment f synced at inner step (f+1)H/F of each "
                         "outer step with its own partner: a transfer F times shorter, so a result that comes late "
                         "on a slow link is F times fresher. Every trainer of a swarm must use the same")
    pace: str = opt("swarm", "swarm: an outer step every H inner steps of the swarm's fastest trainer (slower machines "
                    "take fewer) | steps: every H inner steps of this machine")
    max_step_gap: int = opt(4, "refuse partners whose outer step differs from ours by more than this")
    pair_window_s: float = opt(5.0, "seconds to look for a partner before taking a solo outer step")
    group_size: int = opt(2, "2: average with one partner per outer step | 4: a second round joins two pairs "
                          "into a group of four (every trainer of a swarm should use the same)")
    handshake_timeout_s: float = opt(5.0, "seconds a partner has to answer a pairing request (more for one whose "
                                          "link was measured slow: a queue of its bulk data at that rate, up to 4x this)")
    stall_timeout_s: float = opt(30.0, "an exchange's transfer is given up when no byte moved either way for this "
                                 "long (a slow link that moves is never cut off)")
    max_transfer_s: float = opt(3600.0, "the longest one exchange's transfer may take, however it moves (seconds)")
    assumed_rate_mbps: float = opt(100.0, "deprecated and ignored: transfers run as long as they move "
                                   "(sync.stall_timeout_s) and partners' rates are measured")
    deadline_slack: float = opt(3.0, "deprecated and ignored (see sync.stall_timeout_s, sync.max_transfer_s)")
    datapath: bool = opt(True, "move bulk tensors over a direct encrypted TCP side channel when reachable")
    datapath_port: int = opt(0, "TCP port of the side channel (0 = any free port)")
    allow_relay_bulk: bool = opt(False, "allow averaging with peers reachable only through a relay")
    clip_ratio: float = opt(2.0, "clip a partner's Delta norm to this many times our own Delta norm per inner step "
                            "times the steps exchanged")
    clip_phi_ratio: float = opt(4.0, "clip the distance of a partner's phi from ours to this many times the same "
                                "reference (honest phis drift apart by a few Deltas between pairings)")
    max_delta_ratio: float = opt(4.0, "refuse a partner's values (an offence) whose Delta norm or phi distance from ours "
                                 "exceeds this many times the norm of our own phi (no model of ours)")
    ban_after: int = opt(3, "offences (poisoned or malformed updates) before a partner is banned")
    ban_s: float = opt(600.0, "how long a banned partner is ignored (seconds)")
    join_donors: int = opt(3, "late join: download the swarm's weights from up to this many donors at once (0 = off)")
    join_wait_s: float = opt(10.0, "late join: seconds to wait for trained members before starting a fresh model")
    join_timeout_s: float = opt(600.0, "late join and catch-up: seconds the download may take before it is given up")
    serve_mbps: float = opt(0.0, "late join and catch-up donors: the most this node sends to joiners, in Mbit/s over "
                                 "all their downloads together (0 = no limit)")
    catch_up_after: int = opt(3, "outer steps in a row not averaged before a node far from the swarm's median re-syncs from it (0 = never)")
    backoff_s: float = opt(10.0, "first back-off after a failed exchange with a partner (doubles, max 5 min)")

    def validate(self) -> None:
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"sync.wire_dtype: one of {', '.join(WIRE_DTYPES)}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"sync.compression: one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")
        if self.compression not in ("none", "auto") and self.group_size != 2:
            raise ValueError(f"sync.compression = {self.compression} needs sync.group_size = 2: a group's second "
                             "round re-encodes the pair's mean, which no node's error feedback could account for")
        if not 1 <= self.fragments <= MAX_FRAGMENTS:
            raise ValueError(f"sync.fragments: between 1 (the whole model at once) and {MAX_FRAGMENTS}, "
                             f"got {self.fragments}")
        if self.pace not in PACES:
            raise ValueError(f"sync.pace: one of {', '.join(PACES)}")
        if not 0 <= self.max_step_gap <= 1000:
            raise ValueError("sync.max_step_gap: must be between 0 and 1000")
        if self.group_size not in (2, 4):
            raise ValueError(f"sync.group_size: 2 or 4, got {self.group_size}")
        if not 0.1 <= self.pair_window_s <= 600:
            raise ValueError("sync.pair_window_s: must be between 0.1 and 600 seconds")
        if not 0.5 <= self.handshake_timeout_s <= 120:
            raise ValueError("sync.handshake_timeout_s: must be between 0.5 and 120 seconds")
        if not 5 <= self.stall_timeout_s <= 3600:
            raise ValueError("sync.stall_timeout_s: must be between 5 and 3600 seconds")
        if not 10 <= self.max_transfer_s <= 86400:
            raise ValueError("sync.max_transfer_s: must be between 10 and 86400 seconds")
        if not 0.01 <= self.assumed_rate_mbps <= 1_000_000:
            raise ValueError("sync.assumed_rate_mbps: must be between 0.01 and 1000000")
        if not 1.0 <= self.deadline_slack <= 100:
            raise ValueError("sync.deadline_slack: must be between 1 and 100")
        if not 0 <= self.datapath_port <= 65535:
            raise ValueError("sync.datapath_port: must be a port number (0 = any)")
        if not 0.01 <= self.max_delta_ratio <= 1e6:
            raise ValueError("sync.max_delta_ratio: must be between 0.01 and 1000000")
        if not 1.0 <= self.clip_ratio <= 1e6:
            raise ValueError("sync.clip_ratio: must be between 1 and 1000000")
        if not 1.0 <= self.clip_phi_ratio <= 1e6:
            raise ValueError("sync.clip_phi_ratio: must be between 1 and 1000000")
        if not 1 <= self.ban_after <= 1000:
            raise ValueError("sync.ban_after: must be between 1 and 1000")
        if not 0 <= self.ban_s <= 86400 * 7:
            raise ValueError("sync.ban_s: must be between 0 and 604800 seconds")
        if not 0 <= self.join_donors <= 16:
            raise ValueError("sync.join_donors: must be between 0 and 16")
        if not 0 <= self.join_wait_s <= 3600:
            raise ValueError("sync.join_wait_s: must be between 0 and 3600 seconds")
        if not 1 <= self.join_timeout_s <= 86400:
            raise ValueError("sync.join_timeout_s: must be between 1 and 86400 seconds")
        if not 0 <= self.serve_mbps <= 100_000:
            raise ValueError("sync.serve_mbps: must be between 0 (no limit) and 100000 Mbit/s")
        if not 0 <= self.catch_up_after <= 1000:
            raise ValueError("sync.catch_up_after: must be between 0 and 1000 (0 = never)")
        if not 0.1 <= self.backoff_s <= 3600:
            raise ValueError("sync.backoff_s: must be between 0.1 and 3600 seconds")
