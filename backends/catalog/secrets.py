"""Encryption of credential secrets at rest, with a key kept outside the catalog.

SigV4 needs the plaintext secret to recompute signatures, so secrets are encrypted (Fernet:
AES-128-CBC + HMAC-SHA256), not hashed. The key comes from ``KVGW_CATALOG_KEY`` or a key file beside
the data (mode 0600, created on first start); a copy of the catalog alone reveals nothing. Gateways
that share a PostgreSQL catalog must share the key (same env var or key file): the catalog records the
key's fingerprint, and a gateway or CLI run with another key is refused before it writes anything.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken


class SecretBoxError(Exception):
    """A secret could not be decrypted: wrong key, or a damaged catalog row."""


def read_key_file(path: Path) -> bytes | None:
    """The key in ``path``, or None if there is no such file."""
    try:
        return path.read_bytes().strip()
    except FileNotFoundError:
        return None


def create_key_file(path: Path) -> bytes:
    """Write a new key to ``path`` (0600, never over an existing file) and return it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    key = Fernet.generate_key()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(key)
    return key


class SecretBox:
    def __init__(self, key: bytes) -> None:
        """ValueError if ``key`` is not a Fernet key (32 url-safe base64-encoded bytes)."""
        self._fernet = Fernet(key)
        # identifies the key without revealing it (the key is 256 random bits: no guessing)
        self.fingerprint = hashlib.sha256(b"kvgw catalog key\0" + key).hexdigest()[:16]

    @classmethod
    def from_key_file(cls, path: Path) -> SecretBox:
        """Load the key file, creating it (0600) if it does not exist yet."""
        key = read_key_file(path)
        return cls(key if key is not None else create_key_file(path))

    def encrypt(self, secret: str) -> str:
        return self._fernet.encrypt(secret.encode()).decode()

    def decrypt(self, token: str) -> str:
        try:
            return self._fernet.decrypt(token.encode()).decode()
        except InvalidToken as exc:
            raise SecretBoxError("cannot decrypt a credential secret: wrong KVGW secret key?") from exc
