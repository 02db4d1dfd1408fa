"""Pre-shared HMAC keys (Gazette's `NewKeyedAuth`): the first real key signs, any key verifies.

`--auth-keys` (or `TIDINGS_AUTH_KEYS`) holds base64 keys, standard alphabet, separated by spaces
or commas; `--auth-keys-file` the same text in a file (systemd `LoadCredential=`: no secret in
`ps`). The pseudo-key `AA==` (one zero byte) admits requests that carry no token, for a rollout.
A key is never shown: errors name its index, `repr` only counts keys.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from tidings.protocol.status import ValidationError

ALLOW_MISSING: Final = "AA=="  # admits requests without a token (a present token is still verified)
MIN_KEY_BYTES: Final = 16  # shorter keys are refused: brute-forcing an HMAC key must stay out of reach
KEY_BYTES: Final = 32  # what `keygen` makes: HS256's block of security


@dataclass(frozen=True)
class KeySet:
    """The keys of a process: `keys[0]` signs, any verifies; `allow_missing` from `AA==`."""

    keys: tuple[bytes, ...] = field(repr=False)
    allow_missing: bool = False

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValidationError("keys", "at least one key is needed")

    def __repr__(self) -> str:  # (never the keys themselves)
        n = len(self.keys)
        return f"KeySet({n} key{'' if n == 1 else 's'}, allow_missing={self.allow_missing})"

    @property
    def signing_key(self) -> bytes:
        """The key tokens are signed with: the first one given (rotation puts the new key first)."""
        return self.keys[0]

    @classmethod
    def parse(cls, text: str, source: str = "--auth-keys") -> KeySet:
        """Keys from `text`, Gazette's rules plus a floor on length; errors name `source` and the key's
        index (counting `AA==`, from 0), never its value."""
        keys: list[bytes] = []
        allow_missing = False
        for i, word in enumerate(text.replace(",", " ").split()):
            if word == ALLOW_MISSING:
                allow_missing = True
                continue
            try:
                key = base64.b64decode(word, validate=True)
            except (binascii.Error, ValueError):
                raise ValidationError(
                    source, f"key at index {i} is not base64 (standard alphabet, = padding), e.g. `tidings auth keygen`"
                ) from None
            if len(key) < MIN_KEY_BYTES:
                raise ValidationError(
                    source,
                    f"key at index {i} is {len(key)} bytes: HS256 wants {KEY_BYTES} random bytes, "
                    "e.g. `tidings auth keygen`",
                )
            keys.append(key)
        if not keys:
            said = "only AA== (which admits requests without a token)" if allow_missing else "no key"
            raise ValidationError(source, f"{said}: give at least one key, e.g. from `tidings auth keygen`")
        return cls(tuple(keys), allow_missing)

    @classmethod
    def from_sources(cls, keys: str | None, keys_file: Path | None) -> KeySet | None:
        """The keys of `--auth-keys` or `--auth-keys-file` (never both: which would win?); None when
        neither is given (auth off). An empty value counts as not given."""
        if keys and keys_file:
            raise ValidationError("", "--auth-keys and --auth-keys-file are both given: give one")
        if keys:
            return cls.parse(keys, "--auth-keys (TIDINGS_AUTH_KEYS)")
        if keys_file:
            source = f"--auth-keys-file {keys_file}"
            try:
                text = keys_file.read_text(encoding="ascii")
            except UnicodeDecodeError:
                raise ValidationError(source, "is not text: base64 keys expected") from None
            except OSError as exc:
                raise ValidationError(source, f"cannot be read: {exc.strerror or exc}") from None
            return cls.parse(text, source)
        return None


def generate_key() -> str:
    """A fresh random key, base64 (what `tidings auth keygen` prints)."""
    return base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode("ascii")
