"""What every service process shares: settings, logging, connect, supervise, heartbeat, drain.

Every service module (`radixserve.services.<name>`) has one skeleton, `ServiceModule`: a
frozen `<Name>Settings` whose `service` is the `ServiceSettings` below; `add_arguments`
(its flags); `settings_from(ns)`, which reads and checks flags and variables and imports
nothing heavy; and `async def start(ctx, settings)`, which subscribes its handlers, spawns
its tasks and returns. `run_module` builds the settings and hands `start` to
`run_service`, which keeps the process alive until SIGTERM or SIGINT, publishes a
`ServiceHeartbeat` every `heartbeat_interval_s`, and on the signal runs the drain
callbacks the service registered (stop taking work, finish or hand back what is in
flight), then drains NATS and exits 0. A supervised background task that crashes stops
the process with exit code 1, so the supervisor (`radixserve up`, Docker, Kubernetes)
restarts it: nothing fails silently.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from radixserve.bus import Bus, BusSettings, NatsAuth
from radixserve.bus.settings import DEFAULT_NATS_URL, ENV_NATS_URL
from radixserve.protocol import ServiceHeartbeat, Subjects, encode
from radixserve.protocol.subjects import DEFAULT_PREFIX, check_token
from radixserve.services.event_loop import (
    ENV_EVENT_LOOP,
    EVENT_LOOPS,
    check_event_loop,
    loop_factory,
)
from radixserve.store.settings import DEFAULT_REDIS_URL, ENV_REDIS_URL, RedisAuth, StoreSettings
from radixserve.telemetry.common import ServiceMetrics
from radixserve.telemetry.exposition import MetricsServer
from radixserve.telemetry.tracing import ENV_OTLP_ENDPOINT, TracingSettings, setup_tracing

log = logging.getLogger(__name__)

ENV_PREFIX = "RADIXSERVE_SUBJECT_PREFIX"
ENV_INSTANCE_ID = "RADIXSERVE_INSTANCE_ID"
ENV_LOG_FORMAT = "RADIXSERVE_LOG_FORMAT"  # "text" (default) or "json"
ENV_LOG_PROMPTS = "RADIXSERVE_LOG_PROMPTS"  # "1": prompt/output text may appear in debug logs
ENV_DRAIN_TIMEOUT_S = "RADIXSERVE_DRAIN_TIMEOUT_S"  # SIGTERM to exit, at most
ENV_METRICS_PORT = "RADIXSERVE_METRICS_PORT"  # the /metrics port; 0 (default): none
ENV_METRICS_HOST = "RADIXSERVE_METRICS_HOST"
DEFAULT_METRICS_HOST = "127.0.0.1"

DrainCallback = Callable[[], Awaitable[None]]
ENV_MODEL = "RADIXSERVE_MODEL"


def model_path_from(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The model path a service serves: its `--model`, else $RADIXSERVE_MODEL, else None
    (the embedded SmolLM2)."""
    return flag or environ.get(ENV_MODEL, "").strip() or None


Start = Callable[["ServiceContext"], Awaitable[None]]


def default_instance_id(service: str) -> str:
    """`<service>-<host>-<short random>`: one NATS token, unique per process."""
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())
    return f"{service}-{host or 'host'}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class ServiceSettings:
    """What every service needs; each service's own settings hold one of these."""

    service: str
    instance_id: str = ""
    nats_url: str = DEFAULT_NATS_URL
    redis_url: str = DEFAULT_REDIS_URL
    subject_prefix: str = DEFAULT_PREFIX
    heartbeat_interval_s: float = 1.0
    drain_timeout_s: float = 10.0
    # The first NATS connection: attempts with doubling backoff, each logged.
    connect_attempts: int = 30
    # A /metrics HTTP port of its own (0: none; the gateway serves /metrics on its API port).
    metrics_port: int = 0
    metrics_host: str = DEFAULT_METRICS_HOST
    # OTLP endpoint for traces ("" : the OTEL_* variables decide; tracing is off by default).
    otlp_endpoint: str = ""
    # auto (uvloop where installed), uvloop or asyncio (services/event_loop.py).
    event_loop: str = "auto"
    # Credentials and TLS (`user:password@` in a URL moves here, out of the logged URL).
    nats_auth: NatsAuth = field(default_factory=NatsAuth)
    redis_auth: RedisAuth = field(default_factory=RedisAuth)

    def __post_init__(self) -> None:
        check_event_loop(self.event_loop)
        nats_url, nats_auth = self.nats_auth.with_url(self.nats_url)
        redis_url, redis_auth = self.redis_auth.with_url(self.redis_url)
        object.__setattr__(self, "nats_url", nats_url)
        object.__setattr__(self, "nats_auth", nats_auth)
        object.__setattr__(self, "redis_url", redis_url)
        object.__setattr__(self, "redis_auth", redis_auth)
        if not self.instance_id:
            object.__setattr__(self, "instance_id", default_instance_id(self.service))
        check_token(self.instance_id, "instance id")
        if self.heartbeat_interval_s <= 0 or self.drain_timeout_s <= 0:
            raise ValueError("heartbeat_interval_s and drain_timeout_s must be > 0")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")

    @classmethod
    def from_env(
        cls, service: str, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> ServiceSettings:
        """From the `RADIXSERVE_*` variables; non-None `overrides` win: the fields, and the
        credential flags' names (`nats_user`, `nats_tls_ca`, `redis_user`, ...)."""
        env = os.environ if environ is None else environ
        nats_auth = NatsAuth.from_env(env, **_pop_prefixed(overrides, "nats_", _NATS_AUTH))
        redis_auth = RedisAuth.from_env(env, **_pop_prefixed(overrides, "redis_", _REDIS_AUTH))
        values: dict[str, Any] = {
            "nats_auth": nats_auth,
            "redis_auth": redis_auth,
            "service": service,
            "instance_id": env.get(ENV_INSTANCE_ID, ""),
            "nats_url": env.get(ENV_NATS_URL, "").strip() or DEFAULT_NATS_URL,
            "redis_url": env.get(ENV_REDIS_URL, "").strip() or DEFAULT_REDIS_URL,
            "subject_prefix": env.get(ENV_PREFIX, "").strip() or DEFAULT_PREFIX,
            "metrics_port": _port_from_env(env, ENV_METRICS_PORT),
            "metrics_host": env.get(ENV_METRICS_HOST, "").strip() or DEFAULT_METRICS_HOST,
            "otlp_endpoint": env.get(ENV_OTLP_ENDPOINT, "").strip(),
            "event_loop": env.get(ENV_EVENT_LOOP, "").strip().lower() or "auto",
            "drain_timeout_s": seconds_from_env(env, ENV_DRAIN_TIMEOUT_S, 10.0),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.subject_prefix)

    def tracing_settings(self, environ: Mapping[str, str] | None = None) -> TracingSettings:
        return TracingSettings.from_env(environ, endpoint=self.otlp_endpoint)

    def store_settings(self) -> StoreSettings:
        """Redis as this process reaches it (URL, credentials; $RADIXSERVE_REDIS_PREFIX)."""
        return StoreSettings(
            url=self.redis_url,
            key_prefix=StoreSettings.from_env().key_prefix,
            auth=self.redis_auth,
        )

    def bus_settings(self) -> BusSettings:
        return BusSettings(
            url=self.nats_url,
            name=self.instance_id,
            connect_attempts=self.connect_attempts,
            connect_backoff_max_s=2.0,
            auth=self.nats_auth,
        )


# The credential settings that have flags (`--nats-user` ...): passwords have none, so that
# they never show in `ps`; they come from $RADIXSERVE_*_PASSWORD or its _FILE.
_NATS_AUTH = ("user", "creds_file", "nkey_seed_file", "tls_ca", "tls_cert", "tls_key")
_REDIS_AUTH = ("user", "tls_ca", "tls_cert", "tls_key")


def _pop_prefixed(overrides: dict[str, Any], prefix: str, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: overrides.pop(prefix + name, None) for name in names}


def _add_auth_arguments(
    parser: argparse.ArgumentParser, system: str, names: tuple[str, ...]
) -> None:
    for name in names:
        flag = f"{system}-{name.replace('_', '-')}"
        variable = f"RADIXSERVE_{flag.replace('-', '_').upper()}"
        parser.add_argument(f"--{flag}", default=None, help=f"default ${variable}")


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags every service takes; unset ones fall back to `RADIXSERVE_*` variables."""
    parser.add_argument(
        "--nats-url", default=None, help=f"default ${ENV_NATS_URL} or {DEFAULT_NATS_URL}"
    )
    parser.add_argument(
        "--redis-url", default=None, help=f"default ${ENV_REDIS_URL} or {DEFAULT_REDIS_URL}"
    )
    parser.add_argument(
        "--subject-prefix", default=None, help=f"default ${ENV_PREFIX} or {DEFAULT_PREFIX}"
    )
    parser.add_argument("--instance-id", default=None, help="default <service>-<host>-<random>")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help=f"serve Prometheus /metrics on this port (default ${ENV_METRICS_PORT} or 0: off)",
    )
    parser.add_argument(
        "--metrics-host",
        default=None,
        help=f"interface of the metrics port (default ${ENV_METRICS_HOST} or "
        f"{DEFAULT_METRICS_HOST})",
    )
    parser.add_argument(
        "--otlp-endpoint",
        default=None,
        help=f"send traces over OTLP/HTTP to this base URL (default ${ENV_OTLP_ENDPOINT}, "
        "else the OTEL_EXPORTER_OTLP_* variables; off when none is set)",
    )
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        default=None,
        help="on SIGTERM, how long to finish what is in flight before exiting (a worker "
        f"hands what is left to other workers at 60%% of it); default ${ENV_DRAIN_TIMEOUT_S} "
        "or 10",
    )
    parser.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default=None,
        help=f"the asyncio event loop (default ${ENV_EVENT_LOOP} or auto: uvloop where installed)",
    )
    # NATS: --nats-user (password: $RADIXSERVE_NATS_PASSWORD[_FILE]), --nats-creds-file,
    # --nats-nkey-seed-file, --nats-tls-ca/-cert/-key; Redis: --redis-user, --redis-tls-*.
    _add_auth_arguments(parser, "nats", _NATS_AUTH)
    _add_auth_arguments(parser, "redis", _REDIS_AUTH)


def settings_from_args(service: str, ns: argparse.Namespace) -> ServiceSettings:
    return ServiceSettings.from_env(
        service,
        nats_url=getattr(ns, "nats_url", None),
        redis_url=getattr(ns, "redis_url", None),
        subject_prefix=getattr(ns, "subject_prefix", None),
        instance_id=getattr(ns, "instance_id", None),
        metrics_port=getattr(ns, "metrics_port", None),
        metrics_host=getattr(ns, "metrics_host", None),
        otlp_endpoint=getattr(ns, "otlp_endpoint", None),
        event_loop=getattr(ns, "event_loop", None),
        drain_timeout_s=getattr(ns, "drain_timeout_s", None),
        **{f"nats_{name}": getattr(ns, f"nats_{name}", None) for name in _NATS_AUTH},
        **{f"redis_{name}": getattr(ns, f"redis_{name}", None) for name in _REDIS_AUTH},
    )


def seconds_from_env(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    try:
        return float(raw) if raw else default
    except ValueError:
        raise ValueError(f"${name} must be seconds, got {raw!r}") from None


def flag_from_env(env: Mapping[str, str], name: str, default: bool = False) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in ("1", "true", "on", "0", "false", "off"):
        raise ValueError(f"${name} must be true or false, got {raw!r}")
    return raw in ("1", "true", "on")


def _port_from_env(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name, "").strip()
    try:
        return int(raw) if raw else 0
    except ValueError:
        raise ValueError(f"${name} must be a port number, got {raw!r}") from None


@dataclass
class ServiceContext:
    """Handed to a service's `start`: its bus, subjects and the means to run and stop."""

    settings: ServiceSettings
    bus: Bus
    # The process's metrics registry (with what every service shares); a service adds its
    # own metrics to `metrics.registry`.
    metrics: ServiceMetrics = None  # type: ignore[assignment]  # set in __post_init__
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    status: str = "ready"
    _drain_callbacks: list[DrainCallback] = field(default_factory=list)
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    _crashed: BaseException | None = None

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = ServiceMetrics(self.settings.service, self.settings.instance_id)

    @property
    def subjects(self) -> Subjects:
        return self.settings.subjects

    def on_drain(self, callback: DrainCallback) -> None:
        """Run `callback` on SIGTERM, before NATS is drained (in registration order)."""
        self._drain_callbacks.append(callback)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """A supervised background task: if it raises, the service stops with exit code 1."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def fail(self, exc: BaseException) -> None:
        """Stop the service as crashed (exit code 1)."""
        if self._crashed is None:
            self._crashed = exc
        self.stopping.set()

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self.stopping.is_set():  # already stopping: report only
            log.error("task %s failed while stopping: %r", task.get_name(), exc, exc_info=exc)
        elif exc is not None:
            log.error(
                "task %s crashed: %r; stopping the service", task.get_name(), exc, exc_info=exc
            )
            self.fail(exc)

    async def _cancel_tasks(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _heartbeat_loop(ctx: ServiceContext) -> None:
    s = ctx.settings
    subject = ctx.subjects.alive(s.service, s.instance_id)
    host = socket.gethostname()
    while True:
        beat = ServiceHeartbeat(
            service=s.service,
            instance_id=s.instance_id,
            time=time.time(),
            status=ctx.status,
            pid=os.getpid(),
            host=host,
        )
        if ctx.bus.is_connected:
            try:
                await ctx.bus.publish(subject, encode(beat))
            except Exception as exc:  # a NATS blip must not kill the service
                log.warning("heartbeat publish failed: %r", exc)
        await asyncio.sleep(s.heartbeat_interval_s)


async def serve_async(settings: ServiceSettings, start: Start) -> int:
    """Connect, run `start`, heartbeat, wait for a signal, drain. Returns the exit code."""
    log.info(
        "starting %s (instance %s), NATS %s as %s",
        settings.service,
        settings.instance_id,
        settings.nats_url,
        settings.nats_auth.identity,
    )
    bus = await Bus.connect(settings.bus_settings())
    ctx = ServiceContext(settings=settings, bus=bus)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, ctx.stopping.set)
    metrics_server: MetricsServer | None = None
    try:
        if settings.metrics_port:
            metrics_server = MetricsServer.start(
                ctx.metrics.registry, settings.metrics_host, settings.metrics_port
            )
            log.info("metrics on %s", metrics_server.url)
        await start(ctx)
        ctx.spawn(_heartbeat_loop(ctx), "heartbeat")
        log.info("%s ready", settings.service)
        await ctx.stopping.wait()
        log.info("%s draining", settings.service)
        ctx.status = "draining"
        for callback in ctx._drain_callbacks:
            try:
                await asyncio.wait_for(callback(), settings.drain_timeout_s)
            except Exception as exc:
                log.warning("drain step failed: %r", exc)
    finally:
        await ctx._cancel_tasks()
        try:
            await asyncio.wait_for(bus.drain(), settings.drain_timeout_s)
        except Exception as exc:
            log.warning("NATS drain failed: %r", exc)
            await bus.close()
        if metrics_server is not None:
            metrics_server.close()
    if ctx._crashed is not None:
        log.error("%s stopped after a crash", settings.service)
        return 1
    log.info("%s stopped", settings.service)
    return 0


def run_service(settings: ServiceSettings, start: Start) -> int:
    """Blocking: set up logging and tracing, then serve until a signal or a crash."""
    setup_logging(settings.service)
    tracing = setup_tracing(settings.tracing_settings(), settings.service, settings.instance_id)
    try:
        name, factory = loop_factory(settings.event_loop)
        log.info("%s on the %s event loop", settings.service, name)
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(serve_async(settings, start))
    except Exception as exc:
        log.error("%s failed: %s", settings.service, exc, exc_info=True)
        return 1
    finally:
        tracing.shutdown()  # the spans still buffered go out before the process ends


class HasServiceSettings(Protocol):
    """What `run_module` needs of a `<Name>Settings`: the common part."""

    @property
    def service(self) -> ServiceSettings: ...


SettingsT = TypeVar("SettingsT", bound=HasServiceSettings)


class ServiceModule(Protocol[SettingsT]):
    """The skeleton every `radixserve.services.<name>` module has (see the docstring above)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def settings_from(self, ns: argparse.Namespace) -> SettingsT: ...

    async def start(self, ctx: ServiceContext, settings: SettingsT) -> None: ...


def run_module(module: ServiceModule[SettingsT], ns: argparse.Namespace) -> int:
    """`radixserve serve <name>`: the module's settings from `ns`, then its `start` served."""
    settings = module.settings_from(ns)
    return run_service(settings.service, lambda ctx: module.start(ctx, settings))


class _LogfmtFormatter(logging.Formatter):
    """`ts level service logger: message rid=...`: greppable, with the request id."""

    def __init__(self, service: str, as_json: bool) -> None:
        super().__init__()
        self.service = service
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "rid", None)
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        ts += f".{int(record.msecs):03d}Z"
        message = record.getMessage()
        if self.as_json:
            import json

            body: dict[str, Any] = {
                "ts": ts,
                "level": record.levelname,
                "service": self.service,
                "logger": record.name,
                "msg": message,
            }
            if rid:
                body["rid"] = rid
            if record.exc_info:
                body["exc"] = self.formatException(record.exc_info)
            return json.dumps(body)
        line = f"{ts} {record.levelname} {self.service} {record.name}: {message}"
        if rid:
            line += f" rid={rid}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(service: str, level: str | None = None) -> None:
    """One handler on stderr; `RADIXSERVE_LOG_FORMAT=json` for log shippers."""
    handler = logging.StreamHandler(sys.stderr)
    as_json = os.environ.get(ENV_LOG_FORMAT, "text").lower() == "json"
    handler.setFormatter(_LogfmtFormatter(service, as_json))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or os.environ.get("RADIXSERVE_LOG_LEVEL", "INFO")).upper())


def log_prompts_enabled() -> bool:
    """Prompt and output text stay out of logs unless RADIXSERVE_LOG_PROMPTS=1."""
    return os.environ.get(ENV_LOG_PROMPTS, "") == "1"
