"""Asyncio NATS client for every radixserve service.

    bus = await Bus.connect(BusSettings.from_env(name="tokenizer"))

    async def on_request(msg: BusMsg) -> None:
        await bus.respond(msg, handle(msg.data))

    await bus.subscribe("rs.tokenize", on_request, queue="tokenizer")   # load-shared
    await bus.publish("rs.tokens", payload, headers={"rid": rid})
    reply = await bus.request("rs.tokenize", payload, timeout_s=2.0)    # BusTimeout on silence
    await bus.drain()                                                   # on shutdown

Payloads are bytes (encoding belongs to radixserve.protocol). Every outgoing message
carries the current OpenTelemetry context as a W3C ``traceparent`` header, and each
handler runs with the sender's context attached, so what it publishes (its reply
included) continues the same trace. Handlers of one subscription run one at a time,
in arrival order; an exception in a handler is logged and the subscription goes on.

The first connection is retried a bounded number of times; after that the client
reconnects without limit and replays its subscriptions, so a NATS restart is
survived. Messages published while disconnected are buffered (nats-py's
``pending_size``) and flushed on reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry import context as otel_context

from radixserve.bus.errors import (
    BusAuthError,
    BusClosed,
    BusConnectError,
    BusError,
    BusNoResponders,
    BusPayloadTooLarge,
    BusTimeout,
)
from radixserve.bus.message import BusMsg
from radixserve.bus.settings import NO_CREDENTIALS, BusSettings
from radixserve.bus.tracing import extract_trace, inject_trace
from radixserve.retry import RetriesExhausted, retry_with_backoff

log = logging.getLogger(__name__)

Handler = Callable[[BusMsg], Awaitable[None]]
_POLL_S = 0.05
# How nats-server words a refusal of who we are (-ERR), and a refused subject.
_AUTH_ERRORS = ("authorization violation", "authentication timeout", "user authentication")
_PERMISSION = "permissions violation"


@dataclass(frozen=True)
class BusHealth:
    """Result of ``Bus.health()``: ``ok`` when a round trip to the server succeeded."""

    ok: bool
    connected: bool
    url: str | None
    rtt_s: float | None
    reconnects: int
    error: str | None = None


class BusSubscription:
    """Handle of one subscription made by ``Bus.subscribe``."""

    def __init__(self, sub: Subscription, subject: str, queue: str) -> None:
        self._sub = sub
        self.subject = subject
        self.queue = queue

    async def unsubscribe(self) -> None:
        """Stop now; messages already queued for the handler are dropped."""
        try:
            await self._sub.unsubscribe()
        except (nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError):
            pass  # already gone with its connection

    async def drain(self) -> None:
        """Stop receiving, let the handler finish what is queued."""
        try:
            await self._sub.drain()
        except (nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError):
            pass


class Bus:
    """A connected NATS client; create it with ``await Bus.connect(...)``."""

    def __init__(self, settings: BusSettings) -> None:
        self.settings = settings
        self._nc: NatsClient | None = None
        self._closing = False  # nats-py reports a requested close as a disconnect too
        # During a connect attempt: why the server refused us, set by the error callback.
        self._refusal: str | None = None
        self._refused = asyncio.Event()

    # -- lifecycle -------------------------------------------------------------

    @classmethod
    async def connect(cls, settings: BusSettings | str | None = None) -> Bus:
        """Connect, retrying ``connect_attempts`` times; raise BusConnectError after.

        ``settings`` may be a URL, a BusSettings, or None (``BusSettings.from_env()``)."""
        if isinstance(settings, str):
            settings = BusSettings(url=settings)
        bus = cls(settings or BusSettings.from_env())
        await bus._connect_with_retry()
        return bus

    async def _connect_with_retry(self) -> None:
        s = self.settings

        async def attempt() -> NatsClient:
            nc = NatsClient()
            self._refusal = None
            self._refused.clear()
            try:
                # NOTE: with unlimited reconnects nats-py's own first connect never gives
                # up, so each attempt is bounded from outside and the client closed.
                await _bounded(self._connect_once(nc), s.connect_timeout_s, self._refused)
            except BaseException:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(nc.close(), s.connect_timeout_s)
                if self._refusal is not None:  # retrying cannot change the server's mind
                    raise BusAuthError(self._refusal) from None
                raise
            return nc

        try:
            self._nc = await retry_with_backoff(
                attempt,
                attempts=s.connect_attempts,
                first_delay_s=s.connect_backoff_s,
                max_delay_s=s.connect_backoff_max_s,
                retry_on=(TimeoutError, OSError, nats.errors.Error),
                log=log,
                what=f"NATS {s.url} connect",
            )
        except RetriesExhausted as exc:
            raise BusConnectError(
                f"cannot connect to NATS at {s.url} after {s.connect_attempts} attempts "
                f"({s.connect_timeout_s}s each): {exc.last_error!r}"
            ) from exc.last_error
        log.info("NATS connected to %s as %r (%s)", s.url, s.name, s.auth.identity)

    async def _connect_once(self, nc: NatsClient) -> None:
        s = self.settings
        # nats-py annotates these durations as int, but sleeps/waits on them as floats.
        connect_timeout: Any = s.connect_timeout_s
        reconnect_wait: Any = s.reconnect_time_wait_s
        drain_timeout: Any = s.drain_timeout_s
        await nc.connect(
            servers=[s.url],
            name=s.name,
            connect_timeout=connect_timeout,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=reconnect_wait,
            ping_interval=s.ping_interval_s,
            drain_timeout=drain_timeout,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
            closed_cb=self._on_closed,
            error_cb=self._on_error,
            **s.auth.connect_options(),
        )

    async def drain(self) -> None:
        """Finish queued handler work and outgoing messages, then close. Idempotent."""
        nc = self._nc
        if nc is None or nc.is_closed:
            return
        self._closing = True
        try:
            await asyncio.wait_for(nc.drain(), self.settings.drain_timeout_s + 1.0)
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("NATS drain did not finish cleanly (%r); closing", exc)
        await nc.close()

    async def close(self) -> None:
        """Close at once, dropping queued work. Idempotent."""
        if self._nc is not None and not self._nc.is_closed:
            self._closing = True
            await self._nc.close()

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.drain()

    # -- state -----------------------------------------------------------------

    @property
    def is_connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    @property
    def reconnects(self) -> int:
        """How many times the connection was re-established since connect()."""
        return 0 if self._nc is None else int(self._nc.stats["reconnects"])

    @property
    def nats_client(self) -> NatsClient:
        """The underlying nats-py client, for what this wrapper does not cover."""
        return self._client()

    async def wait_connected(self, timeout_s: float) -> bool:
        """True once connected (e.g. after a reconnect), False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.is_connected:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_POLL_S)
        return True

    async def health(self, timeout_s: float = 1.0) -> BusHealth:
        """Round trip to the server (PING/PONG); never raises."""
        nc = self._nc
        url = None if nc is None or nc.connected_url is None else nc.connected_url.geturl()
        if nc is None or not nc.is_connected:
            return BusHealth(False, False, url, None, self.reconnects, "not connected")
        started = time.monotonic()
        try:
            await nc.flush(timeout=timeout_s)  # type: ignore[arg-type]  # float is fine
        except (TimeoutError, nats.errors.Error) as exc:
            return BusHealth(False, nc.is_connected, url, None, self.reconnects, repr(exc))
        return BusHealth(True, True, url, time.monotonic() - started, self.reconnects)

    # -- messaging -------------------------------------------------------------

    async def publish(
        self,
        subject: str,
        data: bytes = b"",
        *,
        headers: Mapping[str, str] | None = None,
        reply: str = "",
    ) -> None:
        """Publish ``data`` with ``headers`` plus the current ``traceparent``; a ``reply``
        subject is where the receiver answers (NATS sends a no-responders status there,
        header ``Status: 503``, when nobody listens on ``subject``)."""
        nc = self._client()
        payload = _as_bytes(data)
        carrier = inject_trace(headers)
        try:
            await nc.publish(subject, payload, reply=reply, headers=carrier or None)
        except nats.errors.Error as exc:
            raise _translate(exc, f"publish on {subject!r}") from exc

    async def subscribe(
        self, subject: str, handler: Handler, *, queue: str = ""
    ) -> BusSubscription:
        """Call ``await handler(msg)`` for each message on ``subject`` (wildcards allowed).

        With ``queue``, subscribers sharing the name split the messages: each one goes
        to exactly one of them. Returns once the server knows the interest, so a
        publish from any connection after this call reaches the handler."""
        if not callable(handler):
            raise TypeError(f"handler must be an async callable, got {handler!r}")
        nc = self._client()

        async def dispatch(raw: Msg) -> None:
            msg = BusMsg.from_nats(raw)
            token = otel_context.attach(extract_trace(msg.headers))
            try:
                await handler(msg)
            except Exception:
                log.exception("handler for %r (subject %r) failed", subject, msg.subject)
            finally:
                otel_context.detach(token)

        try:
            sub = await nc.subscribe(subject, queue=queue, cb=dispatch)
            if nc.is_connected:
                await nc.flush(timeout=self.settings.request_timeout_s)  # type: ignore[arg-type]
        except nats.errors.Error as exc:
            raise _translate(exc, f"subscribe to {subject!r}") from exc
        return BusSubscription(sub, subject, queue)

    async def request(
        self,
        subject: str,
        data: bytes = b"",
        *,
        timeout_s: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> BusMsg:
        """Send and wait for one reply. Raises BusTimeout after ``timeout_s`` (default
        ``settings.request_timeout_s``) and BusNoResponders when nobody listens."""
        timeout = self.settings.request_timeout_s if timeout_s is None else timeout_s
        if timeout <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout}")
        nc = self._client()
        payload = _as_bytes(data)
        carrier = inject_trace(headers)
        try:
            raw = await nc.request(subject, payload, timeout=timeout, headers=carrier or None)
        except nats.errors.NoRespondersError as exc:
            raise BusNoResponders(subject) from exc
        except (nats.errors.TimeoutError, TimeoutError) as exc:
            raise BusTimeout(subject, timeout) from exc
        except nats.errors.Error as exc:
            raise _translate(exc, f"request on {subject!r}") from exc
        return BusMsg.from_nats(raw)

    async def respond(
        self, msg: BusMsg, data: bytes = b"", *, headers: Mapping[str, str] | None = None
    ) -> None:
        """Answer a request message (publish to its reply inbox)."""
        if not msg.reply:
            raise ValueError(f"message on {msg.subject!r} has no reply subject to respond to")
        await self.publish(msg.reply, data, headers=headers)

    async def acknowledge(self, msg: BusMsg, headers: Mapping[str, str] | None = None) -> None:
        """Answer an acknowledged send (a `request` whose reply only says "received") with
        an empty reply; a plain publish has no reply subject and gets nothing."""
        if msg.reply:
            await self.publish(msg.reply, headers=headers)

    # -- internals -------------------------------------------------------------

    def _client(self) -> NatsClient:
        if self._nc is None:
            raise BusClosed("bus is not connected; use `await Bus.connect(...)`")
        if self._nc.is_closed:
            raise BusClosed(f"bus to {self.settings.url} is closed")
        return self._nc

    def _live(self) -> bool:
        """Connected once and not being closed: a disconnect now is news."""
        return self._nc is not None and not self._closing

    async def _on_disconnected(self) -> None:
        level = logging.WARNING if self._live() else logging.DEBUG
        log.log(level, "NATS disconnected from %s", self.settings.url)

    async def _on_reconnected(self) -> None:
        log.warning("NATS reconnected to %s (reconnect #%d)", self.settings.url, self.reconnects)

    async def _on_closed(self) -> None:
        level = logging.DEBUG if self._nc is None else logging.INFO
        log.log(level, "NATS connection to %s closed", self.settings.url)

    async def _on_error(self, exc: Exception) -> None:
        refusal = _refusal(exc, self.settings)
        if refusal is not None:
            if self._nc is None:  # the first connect: the attempt gives up at once
                self._refusal = refusal
                self._refused.set()
            else:  # a reconnect: nats-py goes on trying (the server may be reconfigured)
                log.error("%s", refusal)
            return
        if _PERMISSION in str(exc).lower():
            who = self.settings.auth.identity
            log.error("NATS %s refused a subject to %s: %s", self.settings.url, who, exc)
            return
        # Failed tries during the first connect or a reconnect are expected noise: the
        # attempt / disconnect itself is already logged.
        reconnecting = self._nc is not None and self._nc.is_reconnecting
        level = logging.WARNING if self._live() and not reconnecting else logging.DEBUG
        log.log(level, "NATS %s: %r", self.settings.url, exc)


def _refusal(exc: Exception, settings: BusSettings) -> str | None:
    """What to tell the user when `exc` says the server will not take us as we are
    (credentials or TLS); None for any other error."""
    text = str(exc).lower()
    where = f"NATS at {settings.url}"
    if isinstance(exc, nats.errors.AuthorizationError) or any(m in text for m in _AUTH_ERRORS):
        if settings.auth.identity == NO_CREDENTIALS:
            return f"{where} wants credentials and none are set ({exc})"
        return f"{where} refused the credentials of {settings.auth.identity} ({exc})"
    if isinstance(exc, ssl.SSLError):
        return f"TLS with {where} failed: {exc}"
    if isinstance(exc, nats.errors.SecureConnRequiredError):
        return f"{where} requires TLS; set $RADIXSERVE_NATS_TLS_CA (or use a tls:// URL)"
    return None


def _as_bytes(data: bytes) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"payload must be bytes, got {type(data).__name__}; encode it first")


def _translate(exc: nats.errors.Error, action: str) -> Exception:
    if isinstance(exc, nats.errors.BadSubjectError):
        return ValueError(f"{action}: invalid subject")
    if isinstance(exc, (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError)):
        return BusClosed(f"{action}: connection is closed or draining")
    if isinstance(exc, nats.errors.MaxPayloadError):
        return BusPayloadTooLarge(f"{action}: larger than the server's max_payload")
    return BusError(f"{action} failed: {exc!r}")


async def _bounded(
    coro: Coroutine[Any, Any, None], timeout_s: float, give_up: asyncio.Event | None = None
) -> None:
    """`coro` within `timeout_s` (or until `give_up` is set), else TimeoutError once it
    has ended. Unlike `asyncio.wait_for`, the cancellation is repeated until the task
    ends: nats-py's first connect loops over its servers forever (sleeping between
    tries), and one cancellation can be lost inside it (Python 3.11's `wait_for` swallows
    a cancellation that races with its inner future finishing), which had a connect
    attempt hang."""
    task = asyncio.ensure_future(coro)
    stop = asyncio.ensure_future((give_up or asyncio.Event()).wait())
    try:
        await asyncio.wait({task, stop}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.05)
    finally:
        stop.cancel()
        task.cancel()  # this attempt was itself cancelled: the connect goes too (no-op if done)
    error = None if task.cancelled() else task.exception()
    if error is not None:
        raise error
    raise TimeoutError(f"no connection within {timeout_s}s")
