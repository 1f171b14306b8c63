"""The one Redis ACL user a local redis-server gets (`radixserve`, every key, channel and
command; the password-less `default` user off), as redis.conf lines.

    acl = RedisAcl.generate()
    acl.config_lines()   # ["user default off", "user radixserve on >... ~* &* +@all"]
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from radixserve.credentials import with_userinfo

DEFAULT_USER = "radixserve"


@dataclass(frozen=True)
class RedisAcl:
    user: str = DEFAULT_USER
    password: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        # One redis.conf token each: a blank or `#` would end or split the rule.
        for what, value in (("user", self.user), ("password", self.password)):
            if not value or any(c.isspace() or c == "#" for c in value):
                raise ValueError(f"Redis ACL {what} must be non-empty, without blanks or '#'")

    @classmethod
    def generate(cls, user: str = DEFAULT_USER) -> RedisAcl:
        return cls(user, secrets.token_urlsafe(24))

    def url_for(self, url: str) -> str:
        """`url` with this user's `user:password@`, for a client that takes one string."""
        return with_userinfo(url, self.user, self.password)

    def config_lines(self) -> list[str]:
        return ["user default off", f"user {self.user} on >{self.password} ~* &* +@all"]
