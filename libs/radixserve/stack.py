"""`radixserve up`: the six services as supervised child processes on one machine.

Each service is `python -m radixserve.cli serve NAME ...` in its own process group
(infra.process.ManagedProcess: it dies with us, even on SIGKILL). A service that
exits is restarted with a doubling backoff (1 s .. 30 s, reset after a minute of
uptime), and the restart is announced. The NATS and Redis servers that `up` started
(`adopt`) are restarted the same way, on their port (neither keeps anything on disk);
the services reconnect to them. `stop()` stops the services front
to back: the gateway first (it stops taking requests), the detokenizer last (it
delivers the last tokens); the servers' owner (infra.Infra) stops them after.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import httpx

from radixserve.bus import BusConnectError, BusSettings
from radixserve.bus.settings import (
    ENV_NATS_CREDS_FILE,
    ENV_NATS_NKEY_SEED_FILE,
    ENV_NATS_PASSWORD,
    ENV_NATS_URL,
    ENV_NATS_USER,
)
from radixserve.credentials import FILE_SUFFIX
from radixserve.infra.nats_auth import ADMIN, NatsUsers
from radixserve.infra.process import InfraError, ManagedProcess
from radixserve.infra.redis_acl import RedisAcl
from radixserve.infra.servers import LocalServer
from radixserve.services.health import HealthReport, probe
from radixserve.services.runtime import ENV_PREFIX
from radixserve.store.settings import ENV_REDIS_PASSWORD, ENV_REDIS_URL, ENV_REDIS_USER

# Start order; stop runs it backwards except that the gateway goes first.
START_ORDER = ("detokenizer", "grammar", "scheduler", "tokenizer", "worker", "gateway")
STOP_ORDER = ("gateway", "tokenizer", "scheduler", "worker", "grammar", "detokenizer")
_NATS_OTHER_AUTH = (ENV_NATS_PASSWORD + FILE_SUFFIX, ENV_NATS_CREDS_FILE, ENV_NATS_NKEY_SEED_FILE)
BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0


@dataclass(frozen=True)
class StackSpec:
    nats_url: str
    redis_url: str
    subject_prefix: str
    host: str
    port: int
    workers: int
    model_dir: Path
    served_model_name: str
    worker_args: list[str]  # engine flags for every worker
    tokenizer_args: list[str]  # e.g. --context-length, kept equal to the workers'
    log_dir: Path
    extra_args: dict[str, list[str]] = field(default_factory=dict)  # per service, e.g. tests
    # Prometheus /metrics ports: every instance but the gateway (its API port serves
    # /metrics) gets base, base+1, ... in start order; 0: none.
    metrics_port_base: int = 0
    # GPUs each worker gets (its tp_size) out of `gpus`, the visible ones in order:
    # worker k sees gpus[k * n : (k + 1) * n] as its CUDA_VISIBLE_DEVICES; 0: no pinning.
    gpus_per_worker: int = 0
    gpus: tuple[str, ...] = ()
    # The credentials of the NATS and Redis that `up` started (None: none, or servers
    # started elsewhere, whose credentials the services take from the environment).
    nats_users: NatsUsers | None = None
    redis_acl: RedisAcl | None = None

    def __post_init__(self) -> None:
        needed = self.workers * self.gpus_per_worker
        if needed > len(self.gpus):
            raise ValueError(
                f"{self.workers} worker(s) of {self.gpus_per_worker} GPU(s) each need {needed} "
                f"GPUs; {len(self.gpus)} are visible"
            )

    def instance_env(self, instance: str) -> dict[str, str]:
        """Variables for one instance: its service's NATS user and the Redis user (in the
        environment, never in argv, so `ps` does not show them), a worker's GPUs."""
        name, _, index = instance.rpartition("-")
        env = self._credentials_env(name)
        if name == "worker" and self.gpus_per_worker:
            k, n = int(index), self.gpus_per_worker
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus[k * n : (k + 1) * n])
        return env

    def _credentials_env(self, service: str) -> dict[str, str]:
        env: dict[str, str] = {}
        # Other ways to authenticate that this process's environment may hold are blanked:
        # two of them at once would be an error in the service.
        if self.nats_users is not None:
            env.update(dict.fromkeys(_NATS_OTHER_AUTH, ""))
            env[ENV_NATS_USER] = service
            env[ENV_NATS_PASSWORD] = self.nats_users.password(service)
        if self.redis_acl is not None:
            env[ENV_REDIS_PASSWORD + FILE_SUFFIX] = ""
            env[ENV_REDIS_USER] = self.redis_acl.user
            env[ENV_REDIS_PASSWORD] = self.redis_acl.password
        return env

    @property
    def admin_nats_url(self) -> str:
        """The NATS URL with the admin's credentials (if any), for the health probe."""
        if self.nats_users is None:
            return self.nats_url
        return self.nats_users.url_for(ADMIN, self.nats_url)

    def write_admin_env(self, path: Path | None = None) -> Path | None:
        """`path` (default `<log_dir>/credentials.env`), mode 0600: the variables that let a
        shell's `radixserve health` and `radixserve keys` reach this stack's NATS (as
        admin) and Redis; None when they need no credentials."""
        if self.nats_users is None and self.redis_acl is None:
            return None
        lines = {
            ENV_NATS_URL: self.nats_url,
            ENV_REDIS_URL: self.redis_url,
            ENV_PREFIX: self.subject_prefix,
        }
        if self.nats_users is not None:
            lines[ENV_NATS_USER] = ADMIN
            lines[ENV_NATS_PASSWORD] = self.nats_users.password(ADMIN)
        if self.redis_acl is not None:
            lines[ENV_REDIS_USER] = self.redis_acl.user
            lines[ENV_REDIS_PASSWORD] = self.redis_acl.password
        path = path or self.log_dir / "credentials.env"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.writelines(f"{name}={shlex.quote(value)}\n" for name, value in lines.items())
        return path

    def instances(self) -> list[tuple[str, str]]:
        """(service, instance id) in start order."""
        return [
            (name, f"{name}-{k}")
            for name in START_ORDER
            for k in range(self.workers if name == "worker" else 1)
        ]

    def metrics_ports(self) -> dict[str, int]:
        """Instance id -> its /metrics port (empty when `metrics_port_base` is 0)."""
        if not self.metrics_port_base:
            return {}
        others = [instance for name, instance in self.instances() if name != "gateway"]
        return {instance: self.metrics_port_base + k for k, instance in enumerate(others)}

    def common_args(self) -> list[str]:
        return [
            "--nats-url",
            self.nats_url,
            "--redis-url",
            self.redis_url,
            "--subject-prefix",
            self.subject_prefix,
        ]

    def service_args(self, name: str) -> list[str]:
        return [*self._own_args(name), *self.extra_args.get(name, [])]

    def _own_args(self, name: str) -> list[str]:
        model = ["--model", str(self.model_dir)]
        if name == "gateway":
            return [
                "--host",
                self.host,
                "--port",
                str(self.port),
                "--served-model-name",
                self.served_model_name,
            ]
        if name == "tokenizer":
            return [*model, *self.tokenizer_args]
        if name in ("detokenizer", "grammar"):  # the grammar service compiles for its tokenizer
            return model
        if name == "worker":
            return [*model, *self.worker_args]
        return []

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def worker_gpus(device: str, tp_size: int) -> tuple[int, tuple[str, ...]]:
    """(GPUs per worker, the visible GPUs) for workers of engine `device` ("auto",
    "cuda": pinned, each worker to its own `tp_size` GPUs; "cpu" or an explicit "cuda:N":
    not pinned, (0, ()))."""
    if device not in ("auto", "cuda"):
        return 0, ()
    import torch

    if not torch.cuda.is_available():
        return 0, ()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        gpus = tuple(g.strip() for g in listed.split(",") if g.strip())
    else:
        gpus = tuple(str(i) for i in range(torch.cuda.device_count()))
    return tp_size, gpus


class Restartable(Protocol):
    """What `Supervised` restarts: a service's ManagedProcess or a LocalServer."""

    @property
    def alive(self) -> bool: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def log_path(self) -> Path: ...

    def start(self) -> object: ...

    def output_tail(self, lines: int = 20) -> str: ...


P = TypeVar("P", bound=Restartable)


@dataclass
class Supervised(Generic[P]):
    """One child (a service process, a NATS or Redis server) and its restart bookkeeping."""

    name: str
    process: P
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = BACKOFF_START_S
    restart_at: float | None = None

    def start(self) -> None:
        self.process.start()
        self.started_at = time.monotonic()
        self.restart_at = None

    def supervise(self, now: float, say: Callable[[str], None]) -> None:
        """Restart it when it exited, after its backoff; announce both through `say`."""
        if self.process.alive:
            if now - self.started_at > STABLE_AFTER_S:
                self.backoff_s = BACKOFF_START_S
            return
        if self.restart_at is None:
            what = f"exited; restarting in {self.backoff_s:.0f}s"
            self._retry_later(now, say, what, self.process.output_tail(5))
        elif now >= self.restart_at:
            try:
                self.start()
            except InfraError as exc:  # cannot execute, or a server that never answered
                what = f"did not restart; next try in {self.backoff_s:.0f}s"
                self._retry_later(time.monotonic(), say, what, str(exc))
                return
            self.restarts += 1
            pid = self.process.pid
            say(f"radixserve: {self.name} restarted (restart {self.restarts}, pid {pid})")

    def _retry_later(self, now: float, say: Callable[[str], None], what: str, detail: str) -> None:
        say(f"radixserve: {self.name} {what} (log {self.process.log_path})\n{detail}")
        self.restart_at = now + self.backoff_s
        self.backoff_s = min(self.backoff_s * 2, BACKOFF_MAX_S)


@dataclass
class Stack:
    spec: StackSpec
    say: Callable[[str], None] = print
    services: list[Supervised[ManagedProcess]] = field(default_factory=list)
    # The NATS and Redis servers `up` started (`adopt`): restarted like the services.
    servers: list[Supervised[LocalServer]] = field(default_factory=list)

    def adopt(self, servers: Iterable[LocalServer]) -> None:
        """Supervise these running servers too; their owner (infra.Infra) stops them."""
        now = time.monotonic()
        self.servers += [Supervised(s.name, s, started_at=now) for s in servers]

    def start(self) -> None:
        self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        check_port_free(self.spec.host, self.spec.port)
        metrics_ports = self.spec.metrics_ports()
        for port in metrics_ports.values():
            check_port_free(self.spec.host, port)
        for name, instance in self.spec.instances():
            metrics = (
                ["--metrics-port", str(metrics_ports[instance]), "--metrics-host", self.spec.host]
                if instance in metrics_ports
                else []
            )
            argv = [
                sys.executable,
                "-m",
                "radixserve.cli",
                "serve",
                name,
                *self.spec.common_args(),
                "--instance-id",
                instance,
                *metrics,
                *self.spec.service_args(name),
            ]
            log_path = self.spec.log_dir / f"{instance}.log"
            env = self.spec.instance_env(instance)
            item = Supervised(instance, ManagedProcess(instance, argv, log_path, env))
            item.start()
            self.services.append(item)

    def supervise_once(self) -> None:
        """Restart what exited, with backoff. Call it every fraction of a second.
        Servers first: the services need them. A server's restart blocks until it
        answers (its startup timeout at most)."""
        children: list[Supervised[Any]] = [*self.servers, *self.services]
        for item in children:
            item.supervise(time.monotonic(), self.say)

    def wait_healthy(self, timeout_s: float) -> HealthReport:
        """Until every service heartbeats, a worker is ready and the gateway answers."""
        deadline = time.monotonic() + timeout_s
        missing = "everything"
        while time.monotonic() < deadline:
            self.supervise_once()
            report, missing = probe_once(
                BusSettings(url=self.spec.admin_nats_url), self.spec.subject_prefix, 1.2
            )
            if not missing and self._gateway_ok():
                return report
            if not missing:
                missing = "the gateway HTTP answer"
        tails = "\n".join(f"--- {s.name} ---\n{s.process.output_tail(8)}" for s in self.services)
        raise TimeoutError(
            f"the stack was not healthy within {timeout_s:.0f}s (missing: {missing})\n{tails}"
        )

    def _gateway_ok(self) -> bool:
        try:
            return httpx.get(f"{self.spec.url}/health/ready", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, timeout_s: float = 15.0) -> None:
        by_kind = sorted(self.services, key=lambda s: STOP_ORDER.index(s.name.rsplit("-", 1)[0]))
        for item in by_kind:
            item.process.stop(timeout_s=timeout_s)

    def pids(self) -> list[int]:
        return [s.process.pid for s in self.services if s.process.pid is not None]


def probe_once(bus: BusSettings, prefix: str, listen_s: float) -> tuple[HealthReport, str]:
    """The heartbeats heard in `listen_s` and what is missing ("" when healthy); a NATS
    that does not answer (or refuses the credentials) is what is missing then."""
    try:
        report = asyncio.run(probe(bus, prefix, listen_s))
    except BusConnectError as exc:
        return HealthReport(), f"NATS at {bus.url} ({exc})"
    missing = [*report.missing(), *([] if report.ready_workers else ["a ready worker"])]
    return report, ", ".join(missing)


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ValueError(
                f"port {port} on {host} is in use ({exc.strerror}); pass --port to pick another"
            ) from None


def local_credentials() -> Path:
    """Where `radixserve up` leaves its admin credentials for the same user's `radixserve
    health` and `radixserve keys` (the latest `up`'s; removed when it stops)."""
    return (
        Path(os.environ.get("RADIXSERVE_CACHE_DIR", "") or Path.home() / ".cache/radixserve")
        / "up-credentials.env"
    )


def load_local_credentials(environ: dict[str, str] | os._Environ[str]) -> bool:
    """Take the variables of `local_credentials()` that `environ` does not set; True when
    there was such a file."""
    path = local_credentials()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return False
    for line in text.splitlines():
        if "=" in line:
            name, _, value = line.partition("=")
            environ.setdefault(name.strip(), " ".join(shlex.split(value)))
    return True


def default_log_dir() -> Path:
    base = Path(os.environ.get("RADIXSERVE_LOG_DIR", "") or Path.home() / ".cache/radixserve/logs")
    return base / time.strftime("%Y%m%d-%H%M%S")
