"""Encryption of credential secrets at rest, with a key kept outside the catalog.

SigV4 needs the plaintext secret to recompute signatures, so secrets are encrypted (Fernet:
AES-128-CBC + HMAC-SHA256), not hashed. The key comes from ``KVGW_SECRET_KEY`` or a key file beside
the data (mode 0600, created on first start); a copy of the catalog alone reveals nothing. Gateways
that share a PostgreSQL catalog must share the key (same env var or key file).
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken


class SecretBoxError(Exception):
    """A secret could not be decrypted: wrong key, or a damaged catalog row."""


class SecretBox:
    def __init__(self, key: bytes) -> None:
        self._fernet = Fernet(key)

    @classmethod
    def from_key_file(cls, path: Path) -> SecretBox:
        """Load the key file, creating it (0600) if it does not exist yet."""
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(Fernet.generate_key())
        return cls(path.read_bytes().strip())

    def encrypt(self, secret: str) -> str:
        return self._fernet.encrypt(secret.encode()).decode()

    def decrypt(self, token: str) -> str:
        try:
            return self._fernet.decrypt(token.encode()).decode()
        except InvalidToken as exc:
            raise SecretBoxError("cannot decrypt a credential secret: wrong KVGW secret key?") from exc
