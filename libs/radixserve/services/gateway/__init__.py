"""gateway: the OpenAI-compatible HTTP API (FastAPI + uvicorn) in front of the bus.

    radixserve serve gateway --port 8000 [--served-model-name NAME] [--request-timeout-s 600]

Serves the OpenAI endpoints, SGLang's `/generate`, `/flush_cache`, `/health*`, `/metrics`
and `/v1/requests/{id}`; the API itself (request models, validation, mapping to
`SubmitRequest`, answers and SSE) is `radixserve.api`. Publishes each prompt as
`SubmitRequest` on `{p}.tokenize`, a request the tokenizer acknowledges on receipt
(none listening: 503 `no_tokenizer`; no ack within `--submit-ack-timeout-s`: 503
`tokenizer_unresponsive`), receives its `TextDeltaBatch`es and `RequestError`s on
`{p}.gateway.{id}.>` (`id` = the instance id), and answers as JSON or SSE. Aborts on
`{p}.abort` when the client disconnects or at `--request-timeout-s` (504); a request
silent for `--lost-check-s` is asked about on `{p}.scheduler.inflight` (one whose end was
lost: 503 `request_lost`). Readiness and the per-worker gauges come from `{p}.alive.*`,
`{p}.heartbeat.*` and `{p}.stats.*`. One Redis record per request (TTL `--record-ttl-s`)
goes through a bounded queue: Redis slow or down drops records (counted), never delays a
token. Stateless: scale by replicas. Off NATS it answers 503 `no_bus`; on SIGTERM 503
`draining` while the requests in flight get the drain budget (`service.py`).
"""

from __future__ import annotations

from radixserve.services.gateway.settings import GatewaySettings, add_arguments, settings_from
from radixserve.services.runtime import ServiceContext

__all__ = ["GatewaySettings", "add_arguments", "settings_from", "start"]


async def start(ctx: ServiceContext, settings: GatewaySettings) -> None:
    # FastAPI and uvicorn load here, not at import: `serve gateway --help` stays quick.
    from radixserve.services.gateway import service

    await service.start(ctx, settings)
