"""What an API key is: its name, scopes, limits and priority class, and its hash.

    key = generate_key()                 # "rsk-..." : shown once, never stored
    entry = ApiKey(name="ci", sha256=hash_key(key), scopes=frozenset({"inference"}))
    entry.to_dict(); ApiKey.from_dict(d) # the keys file's and Redis's shape

Keys are 256 random bits, so one SHA-256 is enough to store them (as GitHub and
Stripe do): nothing stored can be turned back into a key, and a check costs a hash.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

Scope = Literal["inference", "admin", "metrics"]
SCOPES: frozenset[Scope] = frozenset(("inference", "admin", "metrics"))
DEFAULT_SCOPES: frozenset[Scope] = frozenset(("inference",))

# A key's class caps the `priority` its requests may ask for (a higher one is admitted
# first); a key without one is "normal".
PRIORITY_CLASSES: dict[str, int] = {"low": -10, "normal": 0, "high": 10}

KEY_PREFIX = "rsk-"
# Longer than any key we make, so a header of megabytes is refused before it is hashed.
MAX_KEY_CHARS = 256
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """The hex SHA-256 of the key's UTF-8 text (Helm's `sha256sum` gives the same)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"key name {name!r}: 1 to 64 letters, digits, '.', '_' or '-', starting with "
            "a letter or digit"
        )
    return name


def parse_scopes(text: str) -> frozenset[Scope]:
    """`inference,admin` -> the scopes; an unknown one is an error."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    return _scopes(names)


def _scopes(names: Any) -> frozenset[Scope]:
    if not isinstance(names, (list, tuple, set, frozenset)) or not names:
        raise ValueError(f"scopes must be a non-empty list of {sorted(SCOPES)}")
    unknown = [n for n in names if n not in SCOPES]
    if unknown:
        raise ValueError(f"unknown scope(s) {unknown}; known: {sorted(SCOPES)}")
    return frozenset(cast("list[Scope]", list(names)))


@dataclass(frozen=True)
class ApiKey:
    """One key as stored (hashed). `rpm` / `tpm`: requests and tokens (prompt +
    completion) per minute, None for no limit. `priority`: a class of PRIORITY_CLASSES."""

    name: str
    sha256: str = field(repr=False)
    scopes: frozenset[Scope] = DEFAULT_SCOPES
    rpm: int | None = None
    tpm: int | None = None
    priority: str | None = None

    def __post_init__(self) -> None:
        check_name(self.name)
        if not _SHA256.fullmatch(self.sha256):
            raise ValueError(f"key {self.name!r}: sha256 must be 64 lowercase hex digits")
        _scopes(self.scopes)
        for limit in ("rpm", "tpm"):
            value = getattr(self, limit)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"key {self.name!r}: {limit} must be an integer or null")
            if value is not None and value < 1:
                raise ValueError(f"key {self.name!r}: {limit} must be >= 1, got {value}")
        if self.priority is not None and self.priority not in PRIORITY_CLASSES:
            raise ValueError(
                f"key {self.name!r}: priority must be one of {list(PRIORITY_CLASSES)}, "
                f"got {self.priority!r}"
            )

    @property
    def priority_value(self) -> int:
        """The highest `priority` this key's requests may have."""
        return PRIORITY_CLASSES[self.priority or "normal"]

    def has(self, scope: Scope) -> bool:
        return scope in self.scopes

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "sha256": self.sha256,
            "scopes": sorted(self.scopes),
            "rpm": self.rpm,
            "tpm": self.tpm,
            "priority": self.priority,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ApiKey:
        if not isinstance(raw, Mapping):
            raise ValueError(f"a key entry must be an object, got {type(raw).__name__}")
        unknown = set(raw) - {"name", "sha256", "scopes", "rpm", "tpm", "priority"}
        if unknown:
            raise ValueError(f"key entry: unknown field(s) {sorted(unknown)}")
        for required in ("name", "sha256"):
            if not isinstance(raw.get(required), str):
                raise ValueError(f"key entry: {required!r} must be a string")
        return cls(
            name=raw["name"],
            sha256=raw["sha256"],
            scopes=_scopes(raw.get("scopes", sorted(DEFAULT_SCOPES))),
            rpm=raw.get("rpm"),
            tpm=raw.get("tpm"),
            priority=raw.get("priority"),
        )
