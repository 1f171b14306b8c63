"""What the NATS and Redis settings share about secrets: a password read from a variable or
a mounted file, a URL's `user:password@` taken out of it, and a URL fit to log.

    password = secret_from_env(env, "RADIXSERVE_NATS_PASSWORD")   # or ..._PASSWORD_FILE
    url, user, password = split_userinfo("nats://u:p@h:4222")     # ("nats://h:4222", "u", "p")
    log.info("connecting to %s", redact_url(url))                 # nats://u:***@h:4222
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

FILE_SUFFIX = "_FILE"
_HIDDEN = "***"


def env_text(env: Mapping[str, str], name: str) -> str | None:
    """The variable's value without surrounding blanks; unset or empty: None."""
    return env.get(name, "").strip() or None


def secret_from_env(env: Mapping[str, str], name: str) -> str | None:
    """`$NAME`, or the contents of the file `$NAME_FILE` (a mounted secret, its final
    newline dropped); None when neither is set. Both set is an error: which one wins
    would be a guess."""
    file_name = name + FILE_SUFFIX
    value = env.get(name, "") or None
    path = env_text(env, file_name)
    if value is not None and path is not None:
        raise ValueError(f"set ${name} or ${file_name}, not both")
    if path is None:
        return value
    return read_secret_file(path, f"${file_name}")


def read_secret_file(path: str, what: str) -> str:
    """The file's text without its trailing newline; a clear error when it is unreadable
    or empty."""
    try:
        text = Path(path).read_text().rstrip("\r\n")
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc.strerror or exc}") from None
    if not text:
        raise ValueError(f"{what}: {path} is empty")
    return text


def check_file(path: str | None, what: str) -> None:
    """A configured file (certificate, key, creds) must exist: say so now, not at connect."""
    if path is not None and not Path(path).is_file():
        raise ValueError(f"{what}: no such file {path}")


def split_userinfo(url: str) -> tuple[str, str | None, str | None]:
    """(the URL without `user:password@`, user, password); None for what it lacks."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None, None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, has_password, password = userinfo.partition(":")
    bare = urlunsplit(parts._replace(netloc=hostport))
    return bare, unquote(user) or None, unquote(password) if has_password else None


def with_userinfo(url: str, user: str, password: str) -> str:
    """The URL with `user:password@` (quoted) in it, for a client that takes one string."""
    parts = urlsplit(url)
    hostport = parts.netloc.rpartition("@")[2]
    userinfo = f"{quote(user, safe='')}:{quote(password, safe='')}"
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{hostport}"))


def redact_url(url: str) -> str:
    """The URL with its password (if any) replaced by `***`: safe for logs and errors."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, has_password, _ = userinfo.partition(":")
    shown = f"{user}:{_HIDDEN}" if has_password else user
    return urlunsplit(parts._replace(netloc=f"{shown}@{hostport}"))
