"""The shipped docker-compose.yml, started for real with the CPU worker, and used.

    make test-compose

Skipped when no Docker engine answers (`docker info`) or Compose v2 is missing. Otherwise
the base images Docker Hub would give are built where missing (tests/deploy/
standin_images.py), the CPU image is built from docker/Dockerfile (cpu_image.py; cached
layers: seconds when nothing changed), and the stack comes up as a user starts it without a
GPU:

    RADIXSERVE_GPU_WORKERS=0 docker compose -p radixserve-test --profile cpu up -d \\
        nats redis tokenizer scheduler grammar detokenizer worker-cpu gateway prometheus

(Grafana, the OpenTelemetry collector and Jaeger have no stand-in here: not started;
secrets-init, which the gateway waits for, is.) Every compose command carries
`-p radixserve-test --profile cpu`, `down` included: .env's COMPOSE_PROFILES=gpu would
otherwise leave worker-cpu, the network and a volume behind.

Once the gateway's /health/ready answers 200 (open), the admin key secrets-init made is
read as a user reads it (`docker compose exec gateway cat /secrets/admin-api-key`) and
every API call carries it; one without a key, or with a wrong one, is refused. NATS and
Redis want credentials (secrets-init's): `radixserve health` as the NATS admin, run as
docker-compose.yml says, sees every service, and without credentials it is refused. A
json_schema request is sent at once (is the whole API ready?), then the API is driven with
the `openai` client and httpx, Prometheus is asked for its targets, the worker is restarted
(a request meanwhile must be answered, not left hanging: its scheduler refusal is also what
the dashboard's "Scheduler refusals" panel shows), and every expression of the overview
dashboard must return a series. Then Redis must refuse a client without the password, a
second `up` must keep every secret (the same admin key), and no service may have been
denied a NATS subject (nats-server's log). The stack is always taken down (`down -v`, then
nothing of the project may be left); a failed test prints the containers' last 50 log
lines (and keeps them under $RADIXSERVE_STANDIN_DIR/compose-logs).

RADIXSERVE_COMPOSE_READY_TIMEOUT_S (default 900) bounds the wait for the first ready;
RADIXSERVE_REBUILD_IMAGE=0 uses an existing radixserve image as it is.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.deploy import cpu_image, standin_images
from tests.deploy.conftest import FIGURES
from tests.helpers.structured_cases import WEATHER

# Every wait below has its own deadline; this bounds each test's body (not the fixtures,
# whose image build alone may take most of an hour on a new machine).
pytestmark = pytest.mark.timeout(600, func_only=True)

REPO = Path(__file__).resolve().parents[2]
PROJECT = "radixserve-test"
SERVICES = [
    "nats",
    "redis",
    "tokenizer",
    "scheduler",
    "grammar",
    "detokenizer",
    "worker-cpu",
    "gateway",
    "prometheus",
]
GATEWAY = "http://127.0.0.1:8000"
ADMIN_KEY_FILE = "/secrets/admin-api-key"  # secrets-init's, as docker-compose.yml says
PROMETHEUS = "http://127.0.0.1:9090"
READY_TIMEOUT_S = float(os.environ.get("RADIXSERVE_COMPOSE_READY_TIMEOUT_S", "900"))
UP_TIMEOUT_S = READY_TIMEOUT_S + 120
COMMAND_TIMEOUT_S = 300
LOG_DIR = standin_images.WORK_DIR / "compose-logs"

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast of a city for some days.",
            "parameters": WEATHER,
        },
    }
]
HELLO = [{"role": "user", "content": "Say hello in one short sentence."}]


def _skip_reason() -> str | None:
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, timeout=30, check=False)
    except FileNotFoundError:
        return "no docker command on PATH"
    except subprocess.TimeoutExpired:
        return "no Docker engine answers: `docker info` timed out after 30 s"
    if info.returncode != 0:
        why = (info.stderr or info.stdout).decode("utf-8", "replace").strip().splitlines()
        return f"no Docker engine answers (`docker info`: {why[-1] if why else info.returncode})"
    if not standin_images.compose_cli():
        return "Compose v2 is missing (neither `docker compose` nor a v2 `docker-compose`)"
    return None


@dataclass
class Stack:
    compose: list[str]
    env: dict[str, str]
    model: str = ""
    api_key: str = ""
    # A json_schema request sent the moment the gateway said ready: status, seconds, body.
    first_structured: tuple[int, float, str] = (0, 0.0, "")

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def run(self, *args: str, timeout_s: float = COMMAND_TIMEOUT_S) -> str:
        """The command's stdout (its stderr, compose's progress, only in a failure)."""
        # `--profile cpu` on every command, `down` included: .env's COMPOSE_PROFILES=gpu
        # would leave worker-cpu (and so the network and a volume) out of a plain `down`.
        done = subprocess.run(
            [*self.compose, "-p", PROJECT, "--profile", "cpu", *args],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            timeout=timeout_s,
            check=False,
        )
        out = (done.stdout + done.stderr).decode("utf-8", "replace")
        assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n{out[-4000:]}"
        return done.stdout.decode("utf-8", "replace")

    def logs(self, tail: int = 50) -> str:
        try:
            return self.run("logs", "--no-color", "--tail", str(tail), timeout_s=120)
        except (AssertionError, subprocess.TimeoutExpired) as exc:
            return f"(docker compose logs failed: {exc})"

    def dump_logs(self, why: str) -> None:
        text = self.logs()
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        path = LOG_DIR / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', why)}.log"
        path.write_text(text)
        print(f"\n===== docker compose logs --tail 50 ({why}; also {path}) =====\n{text}")


def _compose_env() -> dict[str, str]:
    env = dict(os.environ)
    env["RADIXSERVE_GPU_WORKERS"] = "0"
    # Tracing off (no collector here): docker-compose.yml's `${RADIXSERVE_OTLP_ENDPOINT-...}`
    # keeps the empty value.
    env["RADIXSERVE_OTLP_ENDPOINT"] = ""
    return env


def _get(
    url: str, timeout_s: float = 5.0, params: dict[str, str] | None = None
) -> httpx.Response | None:
    try:
        return httpx.get(url, params=params, timeout=timeout_s)
    except httpx.HTTPError:
        return None


def wait_ready(timeout_s: float) -> tuple[float, str]:
    """Until the gateway says it can serve: `/health/ready` 200, or (a gateway without
    it) `/health` 200 with `workers_ready >= 1`. Seconds waited, and the last answer."""
    started = time.monotonic()
    deadline = started + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        ready = _get(f"{GATEWAY}/health/ready")
        if ready is not None and ready.status_code == 200:
            return time.monotonic() - started, ready.text
        if ready is not None and ready.status_code != 404:
            last = f"/health/ready {ready.status_code} {ready.text[:300]}"
        else:
            health = _get(f"{GATEWAY}/health")
            if health is not None:
                last = f"/health {health.status_code} {health.text[:300]}"
                body = _json(health)
                if health.status_code == 200 and body.get("workers_ready", 0) >= 1:
                    return time.monotonic() - started, health.text
        time.sleep(2)
    raise AssertionError(f"the gateway was not ready within {timeout_s:.0f} s: {last}")


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def container_health(stack: Stack, service: str) -> list[str]:
    """The Docker health status of each container of `service`."""
    ids = stack.run("ps", "-q", service, timeout_s=60).split()
    states = []
    for cid in ids:
        done = subprocess.run(
            ["docker", "inspect", "-f", "{{if .State.Health}}{{.State.Health.Status}}{{end}}", cid],
            capture_output=True,
            timeout=60,
            check=False,
        )
        states.append(done.stdout.decode().strip() or "none")
    return states


def wait_until(what: str, probe: Callable[[], Any], timeout_s: float, every_s: float = 2) -> Any:
    """`probe()` until it returns something true; its last value in the failure."""
    deadline = time.monotonic() + timeout_s
    value: Any = None
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s (last: {value!r})")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    started = time.monotonic()
    figures = cpu_image.ensure_all(REPO)
    FIGURES["stand-in build s"] = figures.standin_s or "(all there already)"
    FIGURES["stand-in versions"] = figures.versions
    if figures.image_build_s is not None:
        FIGURES["radixserve image build s"] = figures.image_build_s
        FIGURES["radixserve image size MB"] = round((figures.image_size_bytes or 0) / 1e6)
    FIGURES["images ready s"] = round(time.monotonic() - started, 1)
    stack = Stack(standin_images.compose_cli(), _compose_env())
    stack.run("down", "-v", "--remove-orphans", "--timeout", "10")  # a run left behind
    up_started = time.monotonic()
    try:
        stack.run(
            "up",
            "-d",
            "--no-build",
            "--pull",
            "never",
            *SERVICES,
            timeout_s=UP_TIMEOUT_S,
        )
        FIGURES["compose up -d returned s"] = round(time.monotonic() - up_started, 1)
        wait_ready(max(30.0, READY_TIMEOUT_S - (time.monotonic() - up_started)))
        FIGURES["start to ready s"] = round(time.monotonic() - up_started, 1)
        health = _get(f"{GATEWAY}/health")
        services = _json(health).get("services", {}) if health is not None else {}
        FIGURES["services ready at gateway ready"] = services
        stack.api_key = stack.run("exec", "-T", "gateway", "cat", ADMIN_KEY_FILE).strip()
        models = httpx.get(f"{GATEWAY}/v1/models", headers=stack.auth, timeout=30)
        assert models.status_code == 200, models.text
        stack.model = models.json()["data"][0]["id"]
        stack.first_structured = _structured_request(stack)
    except BaseException:
        stack.dump_logs("stack start")
        _down(stack)
        raise
    try:
        yield stack
    finally:
        _down(stack)


def _down(stack: Stack) -> None:
    """`down -v`, then nothing of the project may be left (containers, networks, volumes)."""
    stack.run("down", "-v", "--remove-orphans", "--timeout", "30")
    label = f"label=com.docker.compose.project={PROJECT}"
    left = []
    for kind in (["ps", "-a"], ["network", "ls"], ["volume", "ls"]):
        done = subprocess.run(
            ["docker", *kind, "-q", "--filter", label],
            capture_output=True,
            timeout=60,
            check=False,
        )
        left += done.stdout.decode().split()
    assert not left, f"left after `down -v`: {left}"


def _structured_request(stack: Stack) -> tuple[int, float, str]:
    started = time.monotonic()
    answer = httpx.post(
        f"{GATEWAY}/v1/chat/completions",
        headers=stack.auth,
        json={
            "model": stack.model,
            "messages": [{"role": "user", "content": "A city to visit and for how many days?"}],
            "max_tokens": 64,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "trip", "schema": WEATHER},
            },
        },
        timeout=180,
    )
    return answer.status_code, round(time.monotonic() - started, 2), answer.text[:300]


@pytest.fixture(autouse=True)
def _logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed and "stack" in request.fixturenames:
        request.getfixturevalue("stack").dump_logs(request.node.name)


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{GATEWAY}/v1", api_key=stack.api_key, max_retries=0, timeout=180
    )


def test_the_api_wants_the_key_secrets_init_made(stack: Stack) -> None:
    """Auth is on by default: no key or a wrong one is a 401, health stays open, and the
    API port's /metrics wants a key of the metrics scope (Prometheus scrapes the
    gateway's metrics port instead, see test_prometheus_scrapes_every_service)."""
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 1}}
    for headers in ({}, {"Authorization": "Bearer rsk-not-a-key"}, {"x-api-key": "wrong"}):
        assert httpx.get(f"{GATEWAY}/v1/models", headers=headers, timeout=30).status_code == 401
        refused = httpx.post(f"{GATEWAY}/generate", json=body, headers=headers, timeout=30)
        assert refused.status_code == 401, refused.text
        assert httpx.get(f"{GATEWAY}/metrics", headers=headers, timeout=30).status_code == 401
    assert httpx.get(f"{GATEWAY}/health/ready", timeout=30).status_code == 200
    assert httpx.get(f"{GATEWAY}/metrics", headers=stack.auth, timeout=30).status_code == 200
    by_header = httpx.get(f"{GATEWAY}/v1/models", headers={"x-api-key": stack.api_key}, timeout=30)
    assert by_header.status_code == 200, by_header.text


def test_radixserve_health_as_the_nats_admin(stack: Stack) -> None:
    """The operator's command of docker-compose.yml: secrets-init's container is the NATS
    admin (its password file mounted); the same command without credentials is refused."""
    health = ["run", "--rm", "--entrypoint", "radixserve", "secrets-init", "health"]
    stack.run(*health, "--wait", "60", timeout_s=COMMAND_TIMEOUT_S)  # exit 0: all alive
    anonymous = subprocess.run(
        [*stack.compose, "-p", PROJECT, "--profile", "cpu", "run", "--rm",
         "-e", "RADIXSERVE_NATS_USER=", "-e", "RADIXSERVE_NATS_PASSWORD_FILE=",
         *health[2:]],
        cwd=REPO, env=stack.env, capture_output=True, timeout=COMMAND_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert anonymous.returncode != 0, anonymous.stdout.decode("utf-8", "replace")[-2000:]


def _greedy_chat(client: openai.OpenAI, model: str) -> Any:
    return client.chat.completions.create(
        model=model, messages=HELLO, temperature=0, max_tokens=24, seed=0
    )


def test_chat_completion(client: openai.OpenAI, stack: Stack) -> None:
    response = _greedy_chat(client, stack.model)
    choice = response.choices[0]
    assert (choice.message.content or "").strip(), response
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage is not None and usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    FIGURES["chat answer"] = choice.message.content


def test_streamed_chat_is_the_same_answer(client: openai.OpenAI, stack: Stack) -> None:
    whole = _greedy_chat(client, stack.model).choices[0].message.content or ""
    pieces, reasons, chunks = [], [], 0
    stream = client.chat.completions.create(
        model=stack.model,
        messages=HELLO,
        temperature=0,
        max_tokens=24,
        seed=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    for chunk in stream:
        chunks += 1
        usage = chunk.usage or usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            if c.finish_reason:
                reasons.append(c.finish_reason)
    text = "".join(pieces)
    assert text.strip() and text == whole, (text, whole)
    assert len(reasons) == 1 and reasons[0] in ("stop", "length"), reasons
    assert usage is not None and usage.completion_tokens > 0
    FIGURES["streamed chunks"] = chunks


def test_json_schema_output_validates(client: openai.OpenAI, stack: Stack) -> None:
    response = client.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": "A city to visit and for how many days?"}],
        temperature=0,
        max_tokens=64,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "trip", "schema": WEATHER, "strict": True},
        },
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice
    answer = json.loads(choice.message.content or "")
    jsonschema.validate(answer, WEATHER)
    FIGURES["json_schema answer"] = answer


def test_structured_output_answers_as_soon_as_ready(stack: Stack) -> None:
    """/health/ready 200 means every API answers: a json_schema request sent at that
    moment (before any other) is served, not refused because the grammar service is
    still loading."""
    status, seconds, body = stack.first_structured
    FIGURES["json_schema request at ready"] = f"{status} in {seconds} s"
    assert status == 200, f"answered {status} in {seconds} s: {body}"


def test_forced_tool_call(client: openai.OpenAI, stack: Stack) -> None:
    response = client.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": "What is the weather in Oslo this week?"}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=64,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    assert len(calls) == 1, calls
    call = calls[0]
    assert call.type == "function" and call.function.name == "get_weather"  # type: ignore[union-attr]
    arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
    jsonschema.validate(arguments, WEATHER)
    FIGURES["tool call arguments"] = arguments


def test_completions(client: openai.OpenAI, stack: Stack) -> None:
    response = client.completions.create(
        model=stack.model, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    choice = response.choices[0]
    assert choice.text.strip() and choice.finish_reason in ("stop", "length"), response
    assert response.usage is not None and response.usage.completion_tokens > 0


def test_native_generate(stack: Stack) -> None:
    body = {
        "text": "The capital of France is",
        "sampling_params": {"temperature": 0, "max_new_tokens": 8},
    }
    answer = httpx.post(f"{GATEWAY}/generate", json=body, headers=stack.auth, timeout=180)
    assert answer.status_code == 200, answer.text
    out = answer.json()
    assert out["text"].strip(), out
    meta = out["meta_info"]
    assert meta["prompt_tokens"] > 0 and 0 < meta["completion_tokens"] <= 8, meta


def _targets() -> list[dict[str, Any]]:
    answer = _get(f"{PROMETHEUS}/api/v1/targets?state=active", timeout_s=10)
    if answer is None or answer.status_code != 200:
        return []
    active: list[dict[str, Any]] = answer.json()["data"]["activeTargets"]
    return active


EXPECTED_JOBS = {"gateway", "tokenizer", "scheduler", "grammar", "detokenizer", "worker"}


def test_prometheus_scrapes_every_service(stack: Stack) -> None:
    def all_up() -> list[dict[str, Any]] | None:
        targets = _targets()
        jobs = {t["labels"].get("job") for t in targets}
        if EXPECTED_JOBS <= jobs and all(t["health"] == "up" for t in targets):
            return targets
        return None

    try:
        # DNS discovery refreshes every 15 s, scrapes every 5 s: a few intervals.
        targets = wait_until("every Prometheus target up", all_up, timeout_s=120, every_s=5)
    except AssertionError:
        bad = [
            f"{t['labels'].get('job')} {t['scrapeUrl']}: {t['health']} {t.get('lastError', '')}"
            for t in _targets()
            if t["health"] != "up"
        ]
        jobs = {t["labels"].get("job") for t in _targets()}
        raise AssertionError(
            f"targets not up: {bad}; jobs missing: {sorted(EXPECTED_JOBS - jobs)}"
        ) from None
    FIGURES["prometheus targets up"] = sorted(
        f"{t['labels'].get('job')}@{t['labels'].get('instance')}" for t in targets
    )
    build = _get(f"{PROMETHEUS}/api/v1/status/buildinfo")
    if build is not None and build.status_code == 200:
        FIGURES["prometheus version"] = build.json()["data"]["version"]


def test_worker_restart_serves_again(client: openai.OpenAI, stack: Stack) -> None:
    started = time.monotonic()
    stack.run("restart", "worker-cpu", timeout_s=COMMAND_TIMEOUT_S)
    # A request while the new worker loads its model: answered, not left hanging (a 503
    # "retry later", or a 200 once the worker is up).
    asked = time.monotonic()
    meanwhile = httpx.post(
        f"{GATEWAY}/v1/chat/completions",
        headers=stack.auth,
        json={"model": stack.model, "messages": HELLO, "max_tokens": 8},
        timeout=READY_TIMEOUT_S,
    )
    FIGURES["a chat during the restart"] = (
        f"{meanwhile.status_code} in {time.monotonic() - asked:.1f} s: {meanwhile.text[:200]}"
    )
    assert meanwhile.status_code in (200, 503), meanwhile.text
    wait_until(
        "worker-cpu healthy again",
        lambda: (s := container_health(stack, "worker-cpu")) and all(x == "healthy" for x in s),
        timeout_s=READY_TIMEOUT_S,
        every_s=3,
    )
    wait_ready(READY_TIMEOUT_S)
    FIGURES["worker restart to ready s"] = round(time.monotonic() - started, 1)
    response = _greedy_chat(client, stack.model)
    assert (response.choices[0].message.content or "").strip(), response


def dashboard_expressions(path: Path) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every `expr` in a Grafana dashboard, its variables made
    plain PromQL: `$__rate_interval` and the other interval variables `1m`, any other
    template variable `.*`."""
    found: list[tuple[str, str]] = []

    def walk(node: Any, title: str) -> None:
        if isinstance(node, dict):
            title = str(node.get("title", title))
            for key, value in node.items():
                if key == "expr" and isinstance(value, str) and value.strip():
                    found.append((title, value))
                else:
                    walk(value, title)
        elif isinstance(node, list):
            for item in node:
                walk(item, title)

    walk(json.loads(path.read_text()), "")
    plain = []
    for title, expr in found:
        expr = re.sub(r"\$\{?__(rate_interval|interval|range)\}?", "1m", expr)
        expr = re.sub(
            r"\$\{[A-Za-z_][A-Za-z0-9_]*(:[a-z]+)?\}|\$[A-Za-z_][A-Za-z0-9_]*", ".*", expr
        )
        plain.append((title, expr))
    return plain


def _traffic(client: openai.OpenAI, stack: Stack) -> None:
    """A few requests of each kind, and one the gateway refuses (an error series)."""
    model = stack.model
    for i in range(3):
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Count to {i + 3}."}],
            max_tokens=12,
            temperature=0,
        )
    client.completions.create(model=model, prompt="Once upon a time", max_tokens=8)
    for _ in range(2):  # the second compile is a grammar cache hit
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "A trip?"}],
            max_tokens=64,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "t", "schema": WEATHER},
            },
        )
    refused = httpx.post(
        f"{GATEWAY}/v1/chat/completions",
        headers=stack.auth,
        json={"model": model, "messages": [], "max_tokens": -1},
        timeout=60,
    )
    assert 400 <= refused.status_code != 401, refused.text  # refused for its body, not its key


def test_every_dashboard_expression_has_a_series(client: openai.OpenAI, stack: Stack) -> None:
    expressions = dashboard_expressions(REPO / "dashboards/radixserve-overview.json")
    assert expressions
    _traffic(client, stack)
    time.sleep(20)  # four scrapes of the counters the traffic moved

    def query(expr: str) -> tuple[int, str]:
        answer = _get(f"{PROMETHEUS}/api/v1/query", timeout_s=30, params={"query": expr})
        if answer is None:
            return 0, "no answer"
        body = _json(answer)
        if body.get("status") != "success":
            return 0, f"{answer.status_code} {body.get('error', answer.text[:200])}"
        return len(body["data"]["result"]), ""

    empty = []
    for title, expr in expressions:
        count, error = query(expr)
        if count == 0:
            empty.append(f"[{title}] {expr}" + (f" ({error})" if error else ""))
    FIGURES["dashboard expressions"] = len(expressions)
    FIGURES["dashboard expressions without a series"] = empty
    assert not empty, f"{len(empty)} of {len(expressions)} have no series:\n" + "\n".join(empty)


def test_redis_wants_the_password_secrets_init_made(stack: Stack) -> None:
    """No `default` user: a client without credentials gets NOAUTH; the radixserve user
    with secrets-init's password gets PONG."""
    anonymous = stack.run("exec", "-T", "redis", "redis-cli", "ping", timeout_s=60)
    assert "NOAUTH" in anonymous, anonymous
    as_user = 'REDISCLI_AUTH="$(cat /run/secrets/redis/password)" redis-cli --user radixserve ping'
    assert stack.run("exec", "-T", "redis", "sh", "-c", as_user, timeout_s=60).strip() == "PONG"


def test_a_second_up_keeps_the_keys(stack: Stack) -> None:
    """`up` again runs secrets-init again: it keeps every secret it made (the same admin
    key, the same hashed keys file and passwords), and the running stack still serves."""
    files = ["/secrets/api-keys.json", "/run/secrets/nats/password", "/run/secrets/redis/password"]
    before = stack.run("exec", "-T", "gateway", "sha256sum", *files, timeout_s=60)
    stack.run("up", "-d", "--no-build", "--pull", "never", *SERVICES, timeout_s=UP_TIMEOUT_S)
    assert "nothing done" in stack.run("logs", "--no-color", "secrets-init", timeout_s=60)
    assert stack.run("exec", "-T", "gateway", "cat", ADMIN_KEY_FILE).strip() == stack.api_key
    assert stack.run("exec", "-T", "gateway", "sha256sum", *files, timeout_s=60) == before
    wait_ready(READY_TIMEOUT_S)
    models = httpx.get(f"{GATEWAY}/v1/models", headers=stack.auth, timeout=30)
    assert models.status_code == 200, models.text


def test_no_service_stepped_outside_its_nats_permissions(stack: Stack) -> None:
    """Last, after all the traffic: nats-server logs every publish or subscription a user's
    permissions deny, and none is a service's. The reference: `radixserve health` as the
    tokenizer role (not allowed the heartbeats it listens to) is logged so."""
    probe = ["run", "--rm", "-e", "RADIXSERVE_NATS_USER=tokenizer", "-e",
             "RADIXSERVE_NATS_PASSWORD_FILE=/nats-users/tokenizer/password",
             "--entrypoint", "radixserve", "secrets-init", "health"]  # fmt: skip
    subprocess.run(
        [*stack.compose, "-p", PROJECT, "--profile", "cpu", *probe],
        cwd=REPO, env=stack.env, capture_output=True, timeout=COMMAND_TIMEOUT_S, check=False,
    )  # fmt: skip
    denied = [
        line
        for line in stack.run("logs", "--no-color", "nats", timeout_s=60).splitlines()
        if "Publish Violation" in line or "Subscription Violation" in line
    ]
    probed = [line for line in denied if "radixserve-health" in line and "tokenizer" in line]
    assert probed, f"the probe's denied subscriptions are not in the log: {denied[-5:]}"
    services = [line for line in denied if line not in probed]
    FIGURES["NATS permission violations by a service"] = len(services)
    assert not services, "\n".join(services[-20:])
