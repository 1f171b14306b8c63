"""The gateway process: subscribe, start uvicorn inside the runtime's loop, drain on SIGTERM.

uvicorn runs as a supervised task (`ctx.spawn`) on a socket bound here, so a busy
port fails the start at once. The runtime owns SIGTERM/SIGINT: uvicorn's own signal
capture is switched off. On SIGTERM new requests get 503, the ones in flight get up
to the drain budget to finish, then uvicorn stops and the record queue is flushed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn

from radixserve.auth import Authenticator, KeyFile, KeyRateLimiter, RedisKeys
from radixserve.services.gateway.aborts import AbortSender
from radixserve.services.gateway.app import create_app
from radixserve.services.gateway.hub import Hub
from radixserve.services.gateway.lost import check_lost_requests
from radixserve.services.gateway.records import RecordWriter
from radixserve.services.gateway.settings import GatewaySettings
from radixserve.services.gateway.state import GatewayState, Guard
from radixserve.services.gateway.workers import WorkerTracker
from radixserve.services.runtime import ServiceContext
from radixserve.store import Store
from radixserve.telemetry import GatewayMetrics

log = logging.getLogger(__name__)

# Seconds of the drain budget kept for stopping uvicorn after the in-flight wait.
_HTTP_STOP_S = 3.0


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: they would replace the runtime's."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_socket(host: str, port: int) -> socket.socket:
    """The API's listening socket. Made with proto IPPROTO_TCP, as getaddrinfo gives it:
    asyncio sets TCP_NODELAY only on connections whose socket says so, and without it
    Nagle's algorithm held each stream's first chunk behind its headers until the
    client's delayed ACK, ~40 ms later, on every keep-alive request. TCP_NODELAY is also
    set here, for the accepted connections to inherit."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


async def start(ctx: ServiceContext, settings: GatewaySettings) -> None:
    bus, subjects = ctx.bus, ctx.subjects
    metrics = GatewayMetrics(common=ctx.metrics)  # on the process's registry
    # No PING here: Redis being down must not keep the gateway from serving (records
    # are best effort); redis-py connects on the first write and reconnects by itself.
    store = Store(settings.store)
    state = GatewayState(
        settings=settings,
        bus=bus,
        hub=Hub(subjects, settings.gateway_id),
        aborts=AbortSender(bus, subjects),
        records=RecordWriter(
            store,
            ttl_s=settings.record_ttl_s,
            metrics=metrics,
            max_pending=settings.record_queue_size,
            write_timeout_s=settings.record_write_timeout_s,
        ),
        metrics=metrics,
        workers=WorkerTracker(metrics, settings.worker_timeout_s),
        guard=_guard(ctx, settings, store),
    )
    await bus.subscribe(subjects.gateway_all(settings.gateway_id), state.hub.on_message)
    await bus.subscribe(subjects.heartbeat_all, state.workers.on_heartbeat)
    await bus.subscribe(subjects.stats_all, state.workers.on_stats)
    await bus.subscribe(subjects.alive_all, state.workers.on_alive)
    ctx.spawn(state.records.run(), "record-writer")
    ctx.spawn(state.aborts.run(), "abort-sender")
    if settings.lost_check_s > 0:
        ctx.spawn(check_lost_requests(state, settings.lost_check_s), "lost-request-check")

    sock = bind_socket(settings.host, settings.port)
    config = uvicorn.Config(
        create_app(state),
        log_config=None,  # the runtime configured logging
        access_log=False,  # one line per request comes from the gateway itself, with its rid
        lifespan="off",
        timeout_graceful_shutdown=int(_HTTP_STOP_S),
    )
    server = _EmbeddedServer(config)
    http_task = ctx.spawn(_serve(server, sock), "http")
    log.info(
        "gateway %s serving %r on http://%s:%d",
        settings.gateway_id,
        settings.served_model_name,
        settings.host,
        sock.getsockname()[1],
    )

    async def stop_http() -> None:
        state.draining = True
        budget = max(0.5, settings.service.drain_timeout_s - _HTTP_STOP_S - 1.0)
        if not await state.wait_idle(budget):
            log.warning("%d requests still in flight after %.1fs", len(state.inflight), budget)
        server.should_exit = True
        await asyncio.wait({http_task}, timeout=_HTTP_STOP_S + 0.5)

    async def stop_records() -> None:
        await state.records.flush(timeout_s=1.0)
        await store.close()

    ctx.on_drain(stop_http)
    ctx.on_drain(stop_records)


def _guard(ctx: ServiceContext, settings: GatewaySettings, store: Store) -> Guard | None:
    """The API-key checks when auth is on; their background work supervised."""
    auth = settings.auth
    if not auth.enabled:
        log.warning(
            "no API keys: anyone who reaches %s can use this gateway (auth is off)", settings.host
        )
        return None
    keyfile = None if auth.keys_file is None else KeyFile(auth.keys_file)
    authenticator = Authenticator(
        keyfile,
        RedisKeys(store),
        cache_ttl_s=auth.cache_ttl_s,
        stale_s=auth.stale_s,
        lookup_timeout_s=auth.lookup_timeout_s,
    )
    limiter = KeyRateLimiter(store)
    ctx.spawn(limiter.run(), "rate-limit-charges")
    ctx.on_drain(lambda: limiter.drain(timeout_s=1.0))
    if keyfile is not None:
        ctx.spawn(keyfile.watch(auth.reload_interval_s), "keys-file-watch")
    log.info(
        "API keys required: %s and Redis",
        "none from a file" if keyfile is None else f"{len(keyfile)} from {auth.keys_file}",
    )
    return Guard(authenticator, limiter, keyfile)


async def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
    try:
        await server.serve(sockets=[sock])
    except SystemExit as exc:  # uvicorn exits the process on a failed start
        raise RuntimeError(f"the HTTP server failed to start (exit {exc.code})") from exc
    finally:
        sock.close()
    if not server.should_exit:
        raise RuntimeError("the HTTP server stopped on its own")
