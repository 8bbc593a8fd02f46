"""What the averager tells its operator: the counters, the mixing window and the latest refusal.

`starling status` (`sync`, node/status_schema.py `SyncStatus`), the metrics and `starling doctor`'s island
check read these; the round state machine (node/averaging/averager.py) only reports into them and never
decides anything from them, except whether its last outer step was averaged, which it tells askers
between outer steps (`last_step_averaged`).

Refusals either way are logged at INFO, once a minute per peer and kind of reason (`REFUSAL_LOG_S`), and
the latest one shows in status (`last_refusal`) with what it means here: `declined` alone rose while the
reason was logged at debug level only, and a node stepping solo beside an alive partner must say why.
"""

from __future__ import annotations

import collections
import logging
import math
from typing import Any

import trio

from node.status_schema import MixingStatus, RefusalStatus
from protocols.avg import AnswerCode, TransferResult

log = logging.getLogger("starling.averager")

MIXING_WINDOW = 20  # outer steps that `status()["mixing"]` and the member record's partners look back over
REFUSAL_LOG_S = 60.0  # a refusal is logged at INFO at most this often per peer and kind of reason
MAX_LOGGED = 4096  # (peer, reason) pairs whose last INFO line is remembered


class Report:
    """The averager's counters for status, and its log lines about refusals."""

    def __init__(self, max_step_gap: int) -> None:
        self.max_step_gap = max_step_gap  # for the hint of a step-gap refusal
        self.stats: dict[str, Any] = {
            "rounds": 0,
            "solo_rounds": 0,
            "unpaired_rounds": 0,  # solo at once: no eligible partner when the outer step began
            "failures": 0,
            "declined": 0,
            "last_partner": None,
            "last_duration_s": None,
            "last_bytes": None,
            "last_path": None,
            "bytes_sent": 0,
            "bytes_received": 0,
            "last_bytes_per_param": None,  # payload bytes this node sent per parameter in its last exchange
            "last_compression": None,  # the sync.compression preset its wire used (auto chooses per exchange)
            "last_error": None,
            "last_asked": None,  # the phases of our latest exchange that we asked for (node/averaging/phases.py)
        }
        self.clipped: dict[str, int] = {"delta": 0, "phi": 0}
        # Streaming fragments: each fragment's latest sync, (bytes this node sent, its parameters), by index.
        self._fragment_sent: dict[int, tuple[int, int]] = {}
        self._partners: set[str] = set()
        # (outer step, its partners (none: a solo step), whether the first was the scheduled one), newest last.
        self._recent: collections.deque[tuple[int, tuple[str, ...], bool]] = collections.deque(maxlen=MIXING_WINDOW)
        # The latest refusal either way (a partner's answer to us, or ours to it).
        self._last_refusal: tuple[str, str, str, str, float] | None = None  # (peer, by, reason, hint, time)
        self._refusal_logged: dict[tuple[str, AnswerCode], float] = {}  # (peer, reason) -> next INFO line
        self._last_success_at = -math.inf  # trio time of our latest completed exchange

    # --- what happened -------------------------------------------------------------------------------------

    def exchanged(self, partner: str, result: TransferResult, numel: int, compression: str,
                  fragment: tuple[int, int] | None = None) -> None:
        """An exchange with `partner` completed; `fragment` = (index, count): it synced that streaming
        fragment of `numel` parameters.

        `last_bytes_per_param` is per outer step, what a node sends for each parameter once: the bytes of
        the latest exchange over its parameters, or with streaming fragments the bytes of the latest sync of
        each fragment over those fragments' parameters (one period syncs every fragment once), so that it
        reads the same, 4 B/param in bf16 for instance, whatever the count."""
        self._last_success_at = trio.current_time()
        self._partners.add(partner)
        if result.clip.clipped:
            self.clipped["delta"] += result.clip.delta_scale < 1.0
            self.clipped["phi"] += result.clip.phi_scale < 1.0
            # Honest partners are clipped too (a late starter, a partition, a node in warm-up): one line per
            # exchange would flood the journal, so the counts go to status and metrics, the detail to debug.
            log.debug("clipped the update of %s: kept %.2g of its Delta and %.2g of its phi's distance from ours",
                      partner, result.clip.delta_scale, result.clip.phi_scale)
        self.stats.update(
            rounds=self.stats["rounds"] + 1,
            last_partner=partner,
            last_duration_s=round(result.duration_s, 3),
            last_bytes=result.bytes_sent + result.bytes_received,
            last_path=result.path,
            bytes_sent=self.stats["bytes_sent"] + result.bytes_sent,
            bytes_received=self.stats["bytes_received"] + result.bytes_received,
            last_bytes_per_param=self._bytes_per_param(result.bytes_sent, numel, fragment),
            last_compression=compression,
        )

    def _bytes_per_param(self, sent: int, numel: int, fragment: tuple[int, int] | None) -> float | None:
        """`last_bytes_per_param` (`exchanged`): of this exchange, or of each fragment's latest sync."""
        if fragment is None:
            self._fragment_sent.clear()
            return round(sent / numel, 4) if numel else None
        index, count = fragment
        if any(f >= count for f in self._fragment_sent):  # the count changed: the old cut's syncs go
            self._fragment_sent.clear()
        self._fragment_sent[index] = (sent, numel)
        params = sum(n for _, n in self._fragment_sent.values())
        return round(sum(b for b, _ in self._fragment_sent.values()) / params, 4) if params else None

    def failed(self, partner: str, text: str, *, count: bool) -> None:
        """An exchange with `partner` failed (`count`: as a failure, not a request that timed out unread)."""
        self.stats["last_error"] = f"{partner}: {text}"
        if count:
            self.stats["failures"] += 1

    def declined(self) -> None:
        """A partner we asked said busy or refused."""
        self.stats["declined"] += 1

    def refused(self, peer: str, by: str, code: AnswerCode, reason: str, ours: int, theirs: int) -> None:
        """A refusal (`by`: "partner" refused us, "us"), for status, and at INFO once a minute per peer and
        kind of reason (`code`)."""
        now = trio.current_time()
        hint = ""
        if code is AnswerCode.STEP_GAP:
            behind = theirs - ours
            hint = (f"{'this node' if behind > 0 else 'the partner'} is {abs(behind)} outer steps behind "
                    f"(sync.max_step_gap {self.max_step_gap}): "
                    f"{'it' if behind > 0 else 'the partner'} catches up from the swarm")
        self._last_refusal = (peer, by, reason, hint, now)
        key = (peer, code)
        if now < self._refusal_logged.get(key, -math.inf):
            return
        self._refusal_logged[key] = now + REFUSAL_LOG_S
        if len(self._refusal_logged) > MAX_LOGGED:
            self._refusal_logged.pop(next(iter(self._refusal_logged)))
        if by == "partner":
            log.info("partner %s refused to average: %r%s", peer, reason, f"; {hint}" if hint else "")
        else:
            log.info("refused to average with %s: %r%s", peer, reason, f"; {hint}" if hint else "")

    def outer_step(self, outer_step: int, partners: tuple[str, ...], *, scheduled: bool, unpaired: bool = False) -> None:
        """An outer step ended, averaged with `partners` (none: solo; `unpaired`: solo at once, nobody to
        pair with), the first of them the scheduled one or not."""
        if not partners:
            self.stats["solo_rounds"] += 1
            self.stats["unpaired_rounds"] += unpaired
        self._recent.append((outer_step, partners, scheduled))

    # --- what it shows -------------------------------------------------------------------------------------

    def last_step_averaged(self) -> bool:
        """Whether our latest outer step was averaged (what we tell askers between outer steps: a trainer
        that averaged is in phase with someone)."""
        return bool(self._recent) and bool(self._recent[-1][1])

    def mixing(self) -> MixingStatus:
        """Whom this node averaged with over its last MIXING_WINDOW outer steps, and how often it stepped
        solo: what `starling status` shows and `starling doctor` checks for islands."""
        recent = list(self._recent)
        partners: dict[str, int] = {}
        for _, step_partners, _ in recent:
            for partner in step_partners:
                partners[partner] = partners.get(partner, 0) + 1
        averaged = sum(1 for _, step_partners, _ in recent if step_partners)
        return {
            "window": MIXING_WINDOW,
            "outer_steps": len(recent),
            "averaged": averaged,
            "solo": len(recent) - averaged,
            "solo_share": round((len(recent) - averaged) / len(recent), 3) if recent else None,
            "scheduled": sum(1 for _, p, sched in recent if p and sched),
            "partners": partners,
            "distinct_partners": len(partners),
        }

    def recent_partners(self) -> list[str]:
        """Distinct partners over the last MIXING_WINDOW outer steps, most frequent first."""
        counts = self.mixing()["partners"]
        return sorted(counts, key=lambda p: (-counts[p], p))

    def distinct_partners(self) -> int:
        """Partners averaged with since the daemon started (`mixing`'s: the recent window)."""
        return len(self._partners)

    def last_refusal(self) -> RefusalStatus | None:
        if self._last_refusal is None:
            return None
        peer, by, reason, hint, at = self._last_refusal
        return {"peer": peer, "by": by, "reason": reason, "hint": hint,
                "seconds_ago": round(trio.current_time() - at, 1), "averaged_since": self._last_success_at > at}
