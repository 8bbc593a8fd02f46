"""The node's identity: one ed25519 key on disk, reused on every start.

Why a file and not a fresh key: the PeerID is derived from the public key, and everything the swarm
remembers about a node (its CRDT member record, its checkpoint lineage, bans) is keyed by that PeerID.
A node that silently got a new key after a corrupt file would look like a stranger, so a corrupt file
is an error for the operator to resolve, never something we overwrite.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.identity_utils import load_identity, save_identity
from libp2p.peer.id import ID

log = logging.getLogger("starling.identity")


class IdentityError(Exception):
    """The identity file exists but cannot be used; the message names the file and the fix."""


def peer_id_of(key_pair: KeyPair) -> ID:
    return ID.from_pubkey(key_pair.public_key)


def create_identity(path: Path) -> KeyPair:
    """Create a new ed25519 identity at `path` (mode 0600). Refuses to overwrite an existing file."""
    if path.exists():
        raise IdentityError(f"{path}: identity file already exists; refusing to replace it")
    key_pair = create_new_key_pair()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_identity(key_pair, path)
    os.chmod(path, 0o600)
    return key_pair


def load_existing_identity(path: Path) -> KeyPair:
    """Load the identity at `path`; any problem becomes an IdentityError naming the file."""
    try:
        key_pair = load_identity(path)
    except FileNotFoundError as e:
        raise IdentityError(f"{path}: no identity file (run `starling init`)") from e
    except (ValueError, OSError) as e:
        raise IdentityError(
            f"{path}: identity file is unreadable or corrupt ({type(e).__name__}); it was NOT replaced. "
            "Restore it from a backup, or move it away to start this node under a new PeerID."
        ) from e
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        log.warning("%s is readable by other users (mode %o); tightening to 0600", path, mode)
        os.chmod(path, 0o600)
    return key_pair


def load_or_create_identity(path: Path) -> tuple[KeyPair, bool]:
    """Return (key_pair, created). A missing file is created; a corrupt one raises IdentityError."""
    if path.exists():
        return load_existing_identity(path), False
    return create_identity(path), True
