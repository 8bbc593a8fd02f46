"""Which run manifest a node trusts: the swarm's manifest record can be signed by any key, so whether a
replica adopts one is decided here, by this node's configuration, and never by the record.

The rule (:class:`ManifestAuthority`): only the configured founder's manifests (``node.founder``), only
the configured hash (``node.manifest_hash``), or, with neither, trust on first use: the first manifest this
node held (pinned to disk by the replicator, node/swarm/replicator.py) and no other ever after. Among the
manifests the rule allows (all with one content, or all by one founder) the replica (node/swarm/crdt.py)
keeps the lowest HLC, so replicas still converge. Lowest HLC alone, as before, let a fresh key sign a
manifest at HLC (0, 0) and take the swarm over.

Trust on first use remembers that manifest in ``HOME/manifest.pin`` (:func:`read_manifest_pin`,
:func:`write_manifest_pin`), per swarm, so that not even an empty state file lets another one in.

Why a module apart from the replica: the replica merges whatever records it is given by a join; this is a
trust policy with its own errors, :class:`ManifestRefused` (a manifest the rule does not allow) and
:class:`ManifestMismatch` (this node's own manifest is not the swarm's), which the daemon and the
replicator report to the operator.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from p2p.fsutil import atomic_write_bytes
from protocols.record import Manifest, ManifestRecord


class ManifestMismatch(Exception):
    """This node's run manifest differs from the swarm's; it must not train with this swarm."""

    def __init__(
        self, swarm_hash: str, local_hash: str, *, founder: str | None = None, fields: tuple[str, ...] = ()
    ) -> None:
        self.swarm_hash = swarm_hash
        self.local_hash = local_hash
        self.founder = founder
        self.fields = fields
        founded = f" (founded by {founder})" if founder else ""
        differ = f"; they differ in {', '.join(fields)}" if fields else ""
        super().__init__(
            f"run manifest mismatch: this node's manifest is {local_hash} but the swarm's is "
            f"{swarm_hash}{founded}{differ}. Join with the same task, model config, optimizer config and "
            f"protocol version as the swarm, or start a separate swarm."
        )


class ManifestRefused(Exception):
    """A run manifest that this node's :class:`ManifestAuthority` does not allow; names both hashes."""

    def __init__(self, record_hash: str, signer: str, why: str, held_hash: str | None) -> None:
        self.record_hash = record_hash
        self.signer = signer
        self.why = why
        self.held_hash = held_hash
        super().__init__(
            f"refused run manifest {record_hash} signed by {signer}: {why}; this node keeps "
            f"{held_hash or 'no manifest yet'}"
        )


@dataclass(frozen=True)
class ManifestAuthority:
    """Which run manifests a replica may adopt: what makes the swarm's manifest something an outsider
    cannot forge (any key can sign a manifest record; only the configuration says whose counts).

    ``founder``: the PeerID whose manifests alone are adopted (``node.founder``). ``manifest_hash``: the
    one manifest hash adopted, whoever signed it (``node.manifest_hash``). With neither: trust on first
    use, ``pinned`` being the hash of the first manifest this node ever held (``HOME/manifest.pin``,
    written by the replicator); a node that holds a manifest, pinned or not, never adopts another one.
    """

    founder: str = ""
    manifest_hash: str = ""
    pinned: str = ""

    @property
    def configured(self) -> bool:
        """Whether the configuration names the authority (else: trust on first use)."""
        return bool(self.founder or self.manifest_hash)

    def describe(self) -> str:
        """The rule in force, for status and logs."""
        rules = []
        if self.founder:
            rules.append(f"founder {self.founder}")
        if self.manifest_hash:
            rules.append(f"manifest hash {self.manifest_hash}")
        if not rules:
            rules.append(f"trust on first use ({self.pinned or 'nothing pinned yet'})")
        return ", ".join(rules)

    def refusal(self, record: ManifestRecord, held: Manifest | None) -> str | None:
        """Why ``record`` must not be adopted by a replica that holds ``held`` (None: it may be)."""
        if self.founder and record.peer_id != self.founder:
            return f"it is not signed by the configured founder {self.founder} (node.founder)"
        manifest_hash = record.manifest.hash
        if self.manifest_hash and manifest_hash != self.manifest_hash:
            return f"node.manifest_hash allows only {self.manifest_hash}"
        if not self.configured:
            trusted = self.pinned or (held.hash if held is not None else "")
            if trusted and manifest_hash != trusted:
                return (
                    f"this node trusts {trusted}, the first manifest it saw (trust on first use; set "
                    f"node.founder to the swarm founder's PeerID to make that explicit)"
                )
        return None


class ManifestPinError(Exception):
    """``HOME/manifest.pin`` cannot be read; the operator decides (the daemon exits 2 with this line)."""


def read_manifest_pin(path: Path, swarm: str) -> str:
    """The manifest hash pinned for ``swarm`` in ``path`` ("" when there is none, or for another swarm)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return ""
    except (OSError, ValueError) as exc:
        raise ManifestPinError(
            f"{path}: cannot read the pinned run manifest ({getattr(exc, 'strerror', None) or exc}); delete "
            f"it to trust the next manifest this node sees, or set node.founder"
        ) from None
    pins = data.get("pins") if isinstance(data, dict) else None
    value = pins.get(swarm, "") if isinstance(pins, dict) else None
    if not isinstance(value, str) or (value and not _is_sha256_hex(value)):
        raise ManifestPinError(f"{path}: not a manifest pin file; delete it to trust the next manifest seen")
    return value


def write_manifest_pin(path: Path, swarm: str, manifest_hash: str) -> None:
    """Pin ``manifest_hash`` for ``swarm`` (other swarms' pins are kept); 0600, atomic."""
    try:
        data = json.loads(path.read_text())
        pins = data["pins"] if isinstance(data, dict) and isinstance(data.get("pins"), dict) else {}
    except (OSError, ValueError):
        pins = {}
    pins[swarm] = manifest_hash
    body = json.dumps({"format": "starling-manifest-pin", "pins": pins}, indent=1, sort_keys=True) + "\n"
    atomic_write_bytes(path, body.encode(), mode=0o600)


def _is_sha256_hex(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)
