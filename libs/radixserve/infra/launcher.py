"""Start NATS and Redis for a local stack, or use the ones the settings point at.

In code (tests, ``radixserve up``):

    with Infra(InfraSettings.from_env()) as infra:
        infra.nats_url, infra.redis_url      # started here, or the configured URLs
        infra.nats_pid, infra.redis_pid      # None for a server started elsewhere

As a process (``python -m radixserve.infra`` / ``radixserve infra``), ``run_infra``
prints one line per server and then ``ready``, and blocks until SIGINT/SIGTERM; with
credentials (the default) each URL carries the admin's / the ACL user's:

    nats-server pid=4242 url=nats://admin:PASSWORD@127.0.0.1:40001
    redis-server pid=4243 url=redis://radixserve:PASSWORD@127.0.0.1:40002/0
    ready
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any, TextIO

from radixserve.infra.binaries import find_nats_server, find_redis_server
from radixserve.infra.nats_auth import ADMIN, NatsUsers
from radixserve.infra.process import InfraError
from radixserve.infra.redis_acl import RedisAcl
from radixserve.infra.servers import LocalServer, NatsServer, RedisServer
from radixserve.infra.settings import InfraSettings

_WATCH_PERIOD_S = 0.2


class Infra:
    """NATS + Redis for one process's lifetime; see the module docstring."""

    def __init__(self, settings: InfraSettings | None = None) -> None:
        self.settings = settings or InfraSettings.from_env()
        self.nats: NatsServer | None = None
        self.redis: RedisServer | None = None
        self._started = False

    @property
    def nats_users(self) -> NatsUsers | None:
        """The role users of the NATS started here (None: started elsewhere, or no auth)."""
        return None if self.nats is None else self.nats.users

    @property
    def redis_acl(self) -> RedisAcl | None:
        """The ACL user of the Redis started here (None: started elsewhere, or no auth)."""
        return None if self.redis is None else self.redis.acl

    @property
    def nats_url(self) -> str:
        self._require_started()
        if self.nats is not None:
            return self.nats.url
        assert self.settings.nats_url is not None
        return self.settings.nats_url

    @property
    def redis_url(self) -> str:
        self._require_started()
        if self.redis is not None:
            return self.redis.url
        assert self.settings.redis_url is not None
        return self.settings.redis_url

    @property
    def nats_pid(self) -> int | None:
        return None if self.nats is None else self.nats.pid

    @property
    def redis_pid(self) -> int | None:
        return None if self.redis is None else self.redis.pid

    def local_servers(self) -> list[LocalServer]:
        """The servers this object started (none for configured URLs)."""
        return [s for s in (self.nats, self.redis) if s is not None]

    def start(self) -> Infra:
        """Start what is not configured; on any failure stop what already started."""
        s = self.settings
        try:
            if s.nats_url is None:
                self.nats = NatsServer(
                    find_nats_server(s.nats_server_path),
                    users=NatsUsers.generate() if s.auth else None,
                    subject_prefix=s.subject_prefix,
                    **self._server_options(s.nats_port),
                )
                self.nats.start()
            if s.redis_url is None:
                self.redis = RedisServer(
                    find_redis_server(s.redis_server_path),
                    acl=RedisAcl.generate() if s.auth else None,
                    **self._server_options(s.redis_port),
                )
                self.redis.start()
        except BaseException:
            self.stop()
            raise
        self._started = True
        return self

    def _server_options(self, port: int | None) -> dict[str, Any]:
        s = self.settings
        return {
            "host": s.host,
            "port": port,
            "startup_timeout_s": s.startup_timeout_s,
            "stop_timeout_s": s.stop_timeout_s,
        }

    def stop(self) -> None:
        """Stop the servers this object started. Idempotent."""
        for server in (self.redis, self.nats):
            if server is not None:
                server.stop()
        self._started = False

    def __enter__(self) -> Infra:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _require_started(self) -> None:
        if not self._started:
            raise RuntimeError("Infra is not started; use `with Infra(...)` or call start()")


def run_infra(
    settings: InfraSettings | None = None, *, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """Start the servers, print their pids and URLs, block until SIGINT/SIGTERM, stop
    them. Returns 0 on a clean stop, 1 when a server fails to start or dies.

    Must run on the main thread (it installs signal handlers)."""
    out = out or sys.stdout
    err = err or sys.stderr
    stop_requested = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop_requested.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    infra = Infra(settings)
    try:
        try:
            infra.start()
        except InfraError as exc:
            print(f"radixserve infra: {exc}", file=err, flush=True)
            return 1
        _announce(infra, out)
        while not stop_requested.wait(_WATCH_PERIOD_S):
            dead = [s for s in infra.local_servers() if not s.alive]
            if dead:
                names = ", ".join(f"{s.name} (pid {s.pid})" for s in dead)
                print(f"radixserve infra: {names} exited unexpectedly", file=err, flush=True)
                return 1
        return 0
    finally:
        infra.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _announce(infra: Infra, out: TextIO) -> None:
    # Machine-readable lines: tests and scripts parse `pid=` and `url=`. The URL of a
    # server started with credentials carries the admin's (NATS) or the ACL user's (Redis):
    # this is how the one who started it learns them, as Jupyter prints its token.
    users, acl = infra.nats_users, infra.redis_acl
    nats_url = infra.nats_url if users is None else users.url_for(ADMIN, infra.nats_url)
    redis_url = infra.redis_url if acl is None else acl.url_for(infra.redis_url)
    for name, pid, url in (
        ("nats-server", infra.nats_pid, nats_url),
        ("redis-server", infra.redis_pid, redis_url),
    ):
        if pid is None:
            print(f"{name} external url={url}", file=out)
        else:
            print(f"{name} pid={pid} url={url}", file=out)
    print("ready", file=out, flush=True)


__all__ = ["Infra", "run_infra"]
