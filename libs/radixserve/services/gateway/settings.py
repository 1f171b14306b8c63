"""The gateway's typed settings: flags first, then `RADIXSERVE_*` variables, then defaults."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from radixserve.api.limits import DEFAULT_LIMITS, RequestLimits, add_limit_arguments, limits_from
from radixserve.auth import settings as auth_settings
from radixserve.auth.settings import AuthSettings
from radixserve.chat_format.reasoning import REASONING_FORMATS
from radixserve.model_files.names import EMBEDDED_MODEL_NAME
from radixserve.model_files.names import served_model_name as model_name_of
from radixserve.services.runtime import (
    ENV_MODEL,
    ServiceSettings,
    model_path_from,
    settings_from_args,
)
from radixserve.store import StoreSettings

SERVICE = "gateway"

ENV_SERVED_MODEL_NAME = "RADIXSERVE_SERVED_MODEL_NAME"
ENV_HOST = "RADIXSERVE_GATEWAY_HOST"
ENV_PORT = "RADIXSERVE_GATEWAY_PORT"
ENV_REQUEST_TIMEOUT_S = "RADIXSERVE_REQUEST_TIMEOUT_S"
ENV_RECORD_TTL_S = "RADIXSERVE_RECORD_TTL_S"
ENV_REASONING_PARSER = "RADIXSERVE_REASONING_PARSER"
ENV_RESUME_GRACE_S = "RADIXSERVE_RESUME_GRACE_S"


@dataclass(frozen=True)
class GatewaySettings:
    service: ServiceSettings
    store: StoreSettings = field(default_factory=StoreSettings)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = EMBEDDED_MODEL_NAME
    # From arrival to the last token; then the request is aborted and answered 504.
    request_timeout_s: float = 600.0
    record_ttl_s: float = 3600.0
    # A worker counts as ready in /health while its last ready heartbeat is this recent.
    worker_timeout_s: float = 5.0
    # Request-record writes waiting for Redis; past this they are dropped (and counted).
    record_queue_size: int = 10_000
    record_write_timeout_s: float = 2.0
    flush_timeout_s: float = 10.0
    # How long the tokenizer has to acknowledge a request it was sent; then 503.
    submit_ack_timeout_s: float = 10.0
    # A request silent this long is checked with the scheduler, and answered 503
    # request_lost if it saw it end (gateway/lost.py); 0: no check.
    lost_check_s: float = 30.0
    # How the served model writes its reasoning (chat_format/reasoning.py); chat answers then
    # carry it as reasoning_content. None: answers are content only.
    reasoning_parser: str | None = None
    auth: AuthSettings = field(default_factory=AuthSettings)
    # What one request may ask for (stop strings, tools, grammar size, ...): 400s past them.
    limits: RequestLimits = DEFAULT_LIMITS
    # A resumable request whose client left runs on this long for it to come back (then
    # aborted unless resumed); 0: no request is resumable (a client gone aborts it).
    resume_grace_s: float = 30.0

    def __post_init__(self) -> None:
        self.auth.check_exposure(self.host)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.served_model_name:
            raise ValueError("the served model name must not be empty")
        for name in (
            "request_timeout_s",
            "record_ttl_s",
            "worker_timeout_s",
            "flush_timeout_s",
            "submit_ack_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.resume_grace_s >= 0:
            raise ValueError(f"resume_grace_s must be >= 0, got {self.resume_grace_s}")
        if self.lost_check_s < 0:
            raise ValueError(f"lost_check_s must be >= 0, got {self.lost_check_s}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_FORMATS:
            raise ValueError(
                f"reasoning_parser must be one of {sorted(REASONING_FORMATS)}, "
                f"got {self.reasoning_parser!r}"
            )
        if self.record_queue_size < 1:
            raise ValueError(f"record_queue_size must be >= 1, got {self.record_queue_size}")

    @property
    def gateway_id(self) -> str:
        """The runtime instance id: deltas and errors for this gateway come to its subjects."""
        return self.service.instance_id


def served_model_name(flag: str | None, model: str | None, environ: Mapping[str, str]) -> str:
    """`--served-model-name`, else $RADIXSERVE_SERVED_MODEL_NAME, else the basename of
    `--model` ($RADIXSERVE_MODEL), else the embedded model's name."""
    name = flag or environ.get(ENV_SERVED_MODEL_NAME, "").strip()
    if name:
        return name
    return model_name_of(model_path_from(model, environ))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=None, help=f"default ${ENV_HOST} or 127.0.0.1")
    parser.add_argument("--port", type=int, default=None, help=f"default ${ENV_PORT} or 8000")
    parser.add_argument(
        "--served-model-name",
        default=None,
        help=f"the model name of /v1/models; default ${ENV_SERVED_MODEL_NAME}, else the "
        f"basename of --model, else {EMBEDDED_MODEL_NAME}",
    )
    parser.add_argument(
        "--model", default=None, help=f"model path (only names the model); default ${ENV_MODEL}"
    )
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        default=None,
        help=f"abort and answer 504 after this long; default ${ENV_REQUEST_TIMEOUT_S} or 600",
    )
    parser.add_argument(
        "--submit-ack-timeout-s",
        type=float,
        default=None,
        help="answer 503 when the tokenizer has not acknowledged a request within this "
        "long (default 10)",
    )
    parser.add_argument(
        "--lost-check-s",
        type=float,
        default=None,
        help="ask the scheduler about a request silent this long; one it saw end at "
        "least half that long ago (its end was lost on the way back) gets 503 "
        "request_lost instead of waiting for the request timeout (default 30; 0: never)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        help="how the served model writes its reasoning, which chat answers then carry "
        f"as reasoning_content: one of {', '.join(sorted(REASONING_FORMATS))}, or none; "
        f"default ${ENV_REASONING_PARSER} or none",
    )
    parser.add_argument(
        "--record-ttl-s",
        type=float,
        default=None,
        help=f"TTL of the Redis request records; default ${ENV_RECORD_TTL_S} or 3600",
    )
    parser.add_argument(
        "--resume-grace-s",
        type=float,
        default=None,
        help="how long a stream (or an X-Resumable request) whose client left runs on for "
        "the client to resume it with Last-Event-ID, at this or another gateway; 0: a "
        f"client gone aborts its request (default ${ENV_RESUME_GRACE_S} or 30)",
    )
    auth_settings.add_arguments(parser)
    add_limit_arguments(parser)


def settings_from(
    ns: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> GatewaySettings:
    env = os.environ if environ is None else environ
    service = settings_from_args(SERVICE, ns)
    store = dataclasses.replace(
        StoreSettings.from_env(env), url=service.redis_url, auth=service.redis_auth
    )

    def pick(flag: str | float | None, var: str) -> str | None:
        if flag is not None:
            return str(flag)
        return env.get(var, "").strip() or None

    host = pick(ns.host, ENV_HOST)
    port = pick(ns.port, ENV_PORT)
    timeout = pick(ns.request_timeout_s, ENV_REQUEST_TIMEOUT_S)
    ttl = pick(ns.record_ttl_s, ENV_RECORD_TTL_S)
    reasoning = pick(ns.reasoning_parser, ENV_REASONING_PARSER)
    grace = pick(ns.resume_grace_s, ENV_RESUME_GRACE_S)
    defaults = GatewaySettings(service=service)
    return GatewaySettings(
        service=service,
        store=store,
        host=host or defaults.host,
        port=defaults.port if port is None else int(port),
        served_model_name=served_model_name(ns.served_model_name, ns.model, env),
        request_timeout_s=defaults.request_timeout_s if timeout is None else float(timeout),
        record_ttl_s=defaults.record_ttl_s if ttl is None else float(ttl),
        submit_ack_timeout_s=(
            defaults.submit_ack_timeout_s
            if ns.submit_ack_timeout_s is None
            else ns.submit_ack_timeout_s
        ),
        lost_check_s=defaults.lost_check_s if ns.lost_check_s is None else ns.lost_check_s,
        reasoning_parser=None if reasoning in (None, "none") else reasoning,
        auth=auth_settings.settings_from(ns, env),
        limits=limits_from(ns, env),
        resume_grace_s=defaults.resume_grace_s if grace is None else float(grace),
    )
