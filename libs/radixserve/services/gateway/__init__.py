"""gateway: the OpenAI-compatible HTTP API (FastAPI + uvicorn) in front of the bus.

    radixserve serve gateway --port 8000 [--served-model-name NAME] [--request-timeout-s 600]

Publishes each request as `SubmitRequest` on `{p}.tokenize`, receives its
`TextDeltaBatch`es and `RequestError`s on `{p}.gateway.{id}.>` (`id` = the instance
id), answers as JSON or SSE, aborts on disconnect or deadline (`{p}.abort`), and
writes a Redis record per request. See services/gateway/README.md.
"""

from __future__ import annotations

import argparse

from radixserve.services.gateway.settings import add_arguments, gateway_settings_from_args

__all__ = ["add_arguments", "run"]


def run(ns: argparse.Namespace) -> int:
    # FastAPI and uvicorn load here, not at import: `serve gateway --help` stays quick.
    from radixserve.services.gateway.service import main
    from radixserve.services.runtime import ServiceContext, run_service

    settings = gateway_settings_from_args(ns)

    async def start(ctx: ServiceContext) -> None:
        await main(ctx, settings)

    return run_service(settings.service, start)
