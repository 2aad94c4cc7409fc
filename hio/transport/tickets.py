"""Route tickets: the master's proof that a tuple id was routed by it.

The master signs each id it routes with a key it shares with the engines
(``ticket_key_file``); an engine refuses a tuple whose ticket does not match,
so a forged or replayed-for-another-image id never reaches user code. With
no key configured, tickets are empty and not checked.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from hio.config import ConfigError

TICKET_BYTES = 16
MIN_KEY_BYTES = 16


def make_ticket(key: bytes, tuple_id: int, image: str) -> bytes:
    """HMAC-SHA256(key, tuple_id as 8 bytes big-endian + image UTF-8), first 16 bytes."""
    return hmac.new(key, tuple_id.to_bytes(8, "big") + image.encode(), hashlib.sha256).digest()[:TICKET_BYTES]


def verify_ticket(key: bytes, tuple_id: int, image: str, ticket: bytes) -> bool:
    """True when ``ticket`` is what the master issued for this id and image (constant time)."""
    return hmac.compare_digest(make_ticket(key, tuple_id, image), ticket)


def load_ticket_key(path: str) -> bytes:
    """The key: the file's bytes without surrounding whitespace; b'' when no file is set."""
    if not path:
        return b""
    try:
        key = Path(path).expanduser().read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"ticket_key_file: cannot read {path}: {exc.strerror}") from None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"ticket_key_file: {path} holds {len(key)} bytes; use at least {MIN_KEY_BYTES}")
    return key
