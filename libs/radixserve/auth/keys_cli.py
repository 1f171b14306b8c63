"""`radixserve keys create|list|revoke`: API keys in Redis (every gateway sees them) or
in a keys file (a secret to mount).

    radixserve keys create --name ci --scopes inference --rpm 60 --tpm 100000
    radixserve keys create --name admin --scopes inference,admin,metrics \\
        --file secrets/api-keys.json --key-out secrets/admin-api-key --if-missing
    radixserve keys list [--file F]      radixserve keys revoke ci [--file F]

The key is printed once (or written to --key-out, mode 0600) and never stored: only
its SHA-256 is.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from pathlib import Path

from radixserve.auth.keyfile import KeyFileError, read_keys, write_keys
from radixserve.auth.keys import PRIORITY_CLASSES, ApiKey, generate_key, hash_key, parse_scopes
from radixserve.auth.redis_keys import KeyExists, RedisKeys
from radixserve.store import Store, StoreSettings
from radixserve.store.settings import ENV_REDIS_URL


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = sub.add_parser("keys", help="create, list and revoke API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)

    def where(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--file",
            type=Path,
            default=None,
            help="a keys file (what --api-keys-file reads) instead of Redis",
        )
        parser.add_argument(
            "--redis-url", default=None, help=f"default ${ENV_REDIS_URL} or the local Redis"
        )

    create = keys_sub.add_parser("create", help="make a key; it is shown once")
    create.add_argument("--name", required=True, help="unique; revoke and list by it")
    create.add_argument(
        "--scopes",
        type=parse_scopes,
        default=parse_scopes("inference"),
        help="comma-separated: inference (the API), admin (/flush_cache, every request "
        "record), metrics (/metrics); default inference",
    )
    create.add_argument(
        "--rpm", type=int, default=None, help="requests a minute (default: no limit)"
    )
    create.add_argument(
        "--tpm",
        type=int,
        default=None,
        help="prompt + completion tokens a minute (default: no limit)",
    )
    create.add_argument(
        "--priority",
        choices=list(PRIORITY_CLASSES),
        default=None,
        help="the highest priority its requests may have (default normal)",
    )
    create.add_argument(
        "--key-out",
        type=Path,
        default=None,
        help="write the key to this file (mode 0600) instead of printing it",
    )
    create.add_argument(
        "--if-missing", action="store_true", help="do nothing when a key of this name exists"
    )
    where(create)
    listing = keys_sub.add_parser("list", help="the keys' names, scopes and limits")
    where(listing)
    revoke = keys_sub.add_parser("revoke", help="remove a key (gateways drop it within 5 s)")
    revoke.add_argument("name")
    where(revoke)


def run(ns: argparse.Namespace) -> int:
    try:
        if ns.file is not None:
            return _in_file(ns, ns.file)
        return asyncio.run(_in_redis(ns))
    except (KeyFileError, KeyExists, ValueError, OSError) as exc:
        print(f"radixserve keys: {exc}", file=sys.stderr)
        return 1


def _new_key(ns: argparse.Namespace) -> tuple[str, ApiKey]:
    key = generate_key()
    entry = ApiKey(
        name=ns.name,
        sha256=hash_key(key),
        scopes=ns.scopes,
        rpm=ns.rpm,
        tpm=ns.tpm,
        priority=ns.priority,
    )
    return key, entry


def _hand_out(ns: argparse.Namespace, key: str, entry: ApiKey) -> None:
    if ns.key_out is None:
        print(key)
        print(f"created key {entry.name!r}: keep it now, it is not stored", file=sys.stderr)
        return
    ns.key_out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(ns.key_out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(key + "\n")
    print(f"created key {entry.name!r}; it is in {ns.key_out}")


def _in_file(ns: argparse.Namespace, path: Path) -> int:
    keys = read_keys(path) if path.exists() else []
    if ns.keys_command == "list":
        _print_keys(keys)
        return 0
    if ns.keys_command == "revoke":
        kept = [k for k in keys if k.name != ns.name]
        if len(kept) == len(keys):
            print(f"radixserve keys: no key named {ns.name!r} in {path}", file=sys.stderr)
            return 1
        write_keys(path, kept)
        print(f"revoked {ns.name!r} (gateways reading {path} drop it within seconds)")
        return 0
    if any(k.name == ns.name for k in keys):
        if ns.if_missing:
            print(f"a key named {ns.name!r} exists in {path}: nothing done")
            return 0
        raise KeyExists(f"a key named {ns.name!r} exists in {path}")
    key, entry = _new_key(ns)
    write_keys(path, [*keys, entry])
    _hand_out(ns, key, entry)
    return 0


async def _in_redis(ns: argparse.Namespace) -> int:
    settings = StoreSettings.from_env()
    if ns.redis_url:
        settings = dataclasses.replace(settings, url=ns.redis_url)
    settings = dataclasses.replace(settings, connect_attempts=2)
    async with await Store.connect(settings) as store:
        keys = RedisKeys(store)
        if ns.keys_command == "list":
            _print_keys(await keys.list())
            return 0
        if ns.keys_command == "revoke":
            if not await keys.revoke(ns.name):
                print(f"radixserve keys: no key named {ns.name!r} in Redis", file=sys.stderr)
                return 1
            print(f"revoked {ns.name!r} (gateways drop it within their key cache, 5 s)")
            return 0
        key, entry = _new_key(ns)
        try:
            await keys.create(entry)
        except KeyExists:
            if not ns.if_missing:
                raise
            print(f"a key named {ns.name!r} exists in Redis: nothing done")
            return 0
        _hand_out(ns, key, entry)
        return 0


def _print_keys(keys: list[ApiKey]) -> None:
    print(f"{'NAME':24} {'SCOPES':26} {'RPM':>8} {'TPM':>10} PRIORITY")
    for k in keys:
        rpm = "-" if k.rpm is None else str(k.rpm)
        tpm = "-" if k.tpm is None else str(k.tpm)
        print(
            f"{k.name:24} {','.join(sorted(k.scopes)):26} {rpm:>8} {tpm:>10} {k.priority or 'normal'}"
        )
