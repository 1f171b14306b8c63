"""NATS and Redis with credentials against the real servers: a NATS user per service role
with its subjects, a Redis ACL user, TLS for both, and a stack that serves with them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from radixserve.bus import Bus, BusAuthError, BusMsg, BusSettings, NatsAuth
from radixserve.infra import ManagedProcess, NatsServer, NatsUsers, RedisAcl, RedisServer
from radixserve.infra.probes import nats_answers
from radixserve.infra.servers import free_port, write_private
from radixserve.protocol.subjects import Subjects
from radixserve.stack import Stack, StackSpec
from radixserve.store import RedisAuth, Store, StoreAuthError, StoreSettings
from tests.helpers.tiny_models import make_tiny_llama

pytestmark = pytest.mark.timeout(60)

PREFIX = "auth"
SUBJECTS = Subjects(PREFIX)
WAIT_S = 5.0


@pytest.fixture(scope="module")
def nats_users() -> NatsUsers:
    return NatsUsers.generate()


@pytest.fixture(scope="module")
def auth_nats(nats_users: NatsUsers) -> Iterator[NatsServer]:
    with NatsServer(users=nats_users, subject_prefix=PREFIX) as server:
        yield server


def _as(role: str, server: NatsServer, users: NatsUsers, **options: float) -> BusSettings:
    auth = NatsAuth(user=role, password=users.password(role))
    return BusSettings(url=server.url, name=f"test-{role}", auth=auth, **options)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def _buses(server: NatsServer, users: NatsUsers, *roles: str) -> AsyncIterator[list[Bus]]:
    buses = [await Bus.connect(_as(role, server, users)) for role in roles]
    try:
        yield buses
    finally:
        for bus in buses:
            await bus.close()


class _Inbox:
    """Messages of one subscription, awaited with a timeout."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[BusMsg] = asyncio.Queue()

    async def __call__(self, msg: BusMsg) -> None:
        await self.queue.put(msg)

    async def next(self) -> BusMsg:
        return await asyncio.wait_for(self.queue.get(), WAIT_S)


async def test_no_or_wrong_credentials_are_refused_at_once(
    auth_nats: NatsServer, nats_users: NatsUsers
) -> None:
    started = time.monotonic()
    with pytest.raises(BusAuthError, match="wants credentials"):
        await Bus.connect(BusSettings(url=auth_nats.url, connect_attempts=20))
    wrong = NatsAuth(user="gateway", password="not-" + nats_users.password("gateway"))
    with pytest.raises(BusAuthError, match="refused the credentials of user 'gateway'") as info:
        await Bus.connect(BusSettings(url=auth_nats.url, auth=wrong, connect_attempts=20))
    assert nats_users.password("gateway") not in str(info.value)
    # Refusals end the connect: twenty attempts of 2 s each would take far longer.
    assert time.monotonic() - started < 20


async def test_each_role_does_what_its_service_does(
    auth_nats: NatsServer, nats_users: NatsUsers
) -> None:
    roles = ("gateway", "tokenizer", "scheduler", "worker", "grammar", "detokenizer", "admin")
    async with _buses(auth_nats, nats_users, *roles) as buses:
        gateway, tokenizer, scheduler, worker, grammar, detokenizer, admin = buses

        async def ack(msg: BusMsg) -> None:
            await tokenizer.acknowledge(msg)

        async def compile_reply(msg: BusMsg) -> None:
            await grammar.respond(msg, b"compiled:" + msg.data)

        await tokenizer.subscribe(SUBJECTS.tokenize, ack, queue="tokenizer")
        await grammar.subscribe(SUBJECTS.grammar_compile, compile_reply, queue="grammar")
        run, detok, deltas, alive = _Inbox(), _Inbox(), _Inbox(), _Inbox()
        await worker.subscribe(SUBJECTS.worker_all("worker-0"), run)
        await scheduler.subscribe(SUBJECTS.detok, detok)
        await gateway.subscribe(SUBJECTS.gateway_all("gateway-0"), deltas)
        await admin.subscribe(SUBJECTS.alive_all, alive)

        # gateway -> tokenizer, acknowledged; tokenizer -> grammar, answered.
        assert (await gateway.request(SUBJECTS.tokenize, b"submit")).data == b""
        reply = await tokenizer.request(SUBJECTS.grammar_compile, b"schema")
        assert reply.data == b"compiled:schema"
        # scheduler -> worker, which acknowledges on the scheduler's ack subject.
        acks = _Inbox()
        await scheduler.subscribe(SUBJECTS.scheduler_acks("scheduler-0"), acks)
        reply_to = SUBJECTS.scheduler_ack("scheduler-0", "t1")
        await scheduler.publish(SUBJECTS.worker_run("worker-0"), b"run", reply=reply_to)
        await worker.acknowledge(await run.next())
        assert (await acks.next()).subject == reply_to
        # worker -> scheduler (and detokenizer) -> gateway; a heartbeat reaches the admin.
        await worker.publish(SUBJECTS.detok, b"step")
        assert (await detok.next()).data == b"step"
        await detokenizer.publish(SUBJECTS.gateway_deltas("gateway-0"), b"delta")
        assert (await deltas.next()).data == b"delta"
        await worker.publish(SUBJECTS.alive("worker", "worker-0"), b"beat")
        assert (await alive.next()).subject == SUBJECTS.alive("worker", "worker-0")


async def test_tokenizer_may_not_run_a_worker(
    auth_nats: NatsServer, nats_users: NatsUsers, caplog: pytest.LogCaptureFixture
) -> None:
    async with _buses(auth_nats, nats_users, "tokenizer", "admin") as (tokenizer, admin):
        seen = _Inbox()
        await admin.subscribe(f"{PREFIX}.>", seen)
        with caplog.at_level(logging.ERROR, logger="radixserve.bus.client"):
            await tokenizer.publish(SUBJECTS.worker_run("worker-0"), b"forged run")
            # Allowed, published after it on the same connection: the server handles a
            # connection's messages in order, so the forged one would have come first.
            await tokenizer.publish(SUBJECTS.schedule, b"allowed")
            first = await seen.next()
            deadline = time.monotonic() + WAIT_S
            while "permissions violation" not in caplog.text and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
    assert first.subject == SUBJECTS.schedule and first.data == b"allowed"
    assert "permissions violation for publish" in caplog.text
    assert SUBJECTS.worker_run("worker-0") in caplog.text


async def test_restarted_nats_keeps_the_credentials(nats_users: NatsUsers) -> None:
    with NatsServer(users=nats_users, subject_prefix=PREFIX) as server:
        config = server.workdir / "nats.conf"  # type: ignore[operator]
        assert config.stat().st_mode & 0o777 == 0o600
        server.kill()
        server.start()
        bus = await Bus.connect(_as("worker", server, nats_users))
        assert (await bus.health()).ok
        await bus.close()


async def test_redis_acl() -> None:
    acl = RedisAcl.generate()
    with RedisServer(acl=acl) as server:
        assert (server.workdir / "redis.conf").stat().st_mode & 0o777 == 0o600  # type: ignore[operator]
        with pytest.raises(StoreAuthError, match="wants credentials"):
            await Store.connect(StoreSettings(url=server.url, connect_attempts=20))
        wrong = RedisAuth(user=acl.user, password="wrong")
        with pytest.raises(StoreAuthError, match="refused user 'radixserve'"):
            await Store.connect(StoreSettings(url=server.url, auth=wrong))
        right = RedisAuth(user=acl.user, password=acl.password)
        async with await Store.connect(StoreSettings(url=server.url, auth=right)) as store:
            await store.put_request("r1", {"status": "queued"}, ttl_s=60)
            assert await store.get_request("r1") == {"status": "queued"}
        # The same user given in the URL.
        async with await Store.connect(acl.url_for(server.url)) as store:
            assert await store.get_request("r1") == {"status": "queued"}


# -- TLS ----------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["/usr/bin/openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, signed by it."""
    d = tmp_path_factory.mktemp("certs")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=radixserve test CA", cwd=d)  # fmt: skip
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "1",
                 "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    return d


@contextlib.contextmanager
def _tls_nats(certs: Path, tmp: Path, users: NatsUsers) -> Iterator[str]:
    """nats-server that wants TLS with a client certificate, and the role users."""
    from radixserve.infra import find_nats_server, render_authorization

    port = free_port()
    tls = (
        f'tls {{\n  cert_file: "{certs}/server.pem"\n  key_file: "{certs}/server.key"\n'
        f'  ca_file: "{certs}/ca.pem"\n  verify: true\n}}\n'
    )
    config = tmp / "nats-tls.conf"
    write_private(config, tls + render_authorization(SUBJECTS, users))
    argv = [str(find_nats_server()), "-c", str(config), "-a", "127.0.0.1", "-p", str(port)]
    proc = ManagedProcess("nats-tls", argv, tmp / "nats-tls.log")
    proc.start()
    try:
        proc.wait_ready(lambda: nats_answers("127.0.0.1", port), 10.0)
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.stop(5.0)


@contextlib.asynccontextmanager
async def _tls_in_front_of(port: int, certs: Path) -> AsyncIterator[int]:
    """A TLS endpoint (client certificate required) relaying to 127.0.0.1:`port`: the
    PyPI redis-server is built without TLS, so TLS ends here, before the real Redis."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(certs / "ca.pem"))
    context.load_cert_chain(str(certs / "server.pem"), str(certs / "server.key"))
    context.verify_mode = ssl.CERT_REQUIRED

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(relay, "127.0.0.1", 0, ssl=context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def test_tls_for_nats_and_redis(certs: Path, tmp_path: Path) -> None:
    users = NatsUsers.generate()
    tls = {
        "tls_ca": str(certs / "ca.pem"),
        "tls_cert": str(certs / "client.pem"),
        "tls_key": str(certs / "client.key"),
    }
    with _tls_nats(certs, tmp_path, users) as url:
        auth = NatsAuth(user="admin", password=users.password("admin"), **tls)
        async with await Bus.connect(BusSettings(url=url, auth=auth)) as bus:
            inbox = _Inbox()
            await bus.subscribe(SUBJECTS.detok, inbox)
            await bus.publish(SUBJECTS.detok, b"over tls")
            assert (await inbox.next()).data == b"over tls"
        plain = NatsAuth(user="admin", password=users.password("admin"))
        with pytest.raises(BusAuthError, match=r"requires TLS|TLS with"):
            await Bus.connect(BusSettings(url=url, auth=plain, connect_attempts=20))

    acl = RedisAcl.generate()
    with RedisServer(acl=acl) as redis:
        async with _tls_in_front_of(redis.port, certs) as tls_port:
            auth_redis = RedisAuth(user=acl.user, password=acl.password, **tls)
            settings = StoreSettings(url=f"redis://127.0.0.1:{tls_port}/0", auth=auth_redis)
            async with await Store.connect(settings) as store:
                await store.put_request("tls", {"ok": 1}, ttl_s=60)
                assert await store.get_request("tls") == {"ok": "1"}


# -- a stack ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_stack_with_credentials_serves_a_request(tmp_path: Path) -> None:
    users, acl = NatsUsers.generate(), RedisAcl.generate()
    prefix = f"s{uuid.uuid4().hex[:8]}"
    model = make_tiny_llama(tmp_path / "model", seed=0)
    with (
        NatsServer(users=users, subject_prefix=prefix) as nats,
        RedisServer(acl=acl) as redis,
    ):
        spec = StackSpec(
            nats_url=nats.url,
            redis_url=redis.url,
            subject_prefix=prefix,
            host="127.0.0.1",
            port=free_port(),
            workers=1,
            model_dir=model,
            served_model_name="test-model",
            worker_args=["--device", "cpu", "--max-total-tokens", "16384"],
            tokenizer_args=[],
            log_dir=tmp_path / "logs",
            nats_users=users,
            redis_acl=acl,
        )
        stack = Stack(spec, say=print)
        stack.start()
        try:
            stack.wait_healthy(150.0)
            body = {
                "model": "test-model",
                "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 5,
                "temperature": 0,
            }
            answer = httpx.post(f"{spec.url}/v1/chat/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] == 5
            secrets = [*users.passwords.values(), acl.password]
            for pid in stack.pids():  # passwords go through the environment, not argv
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
                assert not any(secret in argv for secret in secrets)
            logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
            assert not any(secret in logs for secret in secrets)
            for refusal in ("permissions violation", "noauth", "wrongpass", "refused"):
                assert refusal not in logs.lower()
        finally:
            stack.stop()
