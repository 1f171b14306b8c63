"""Command-line flags for the launcher, reusable by the ``radixserve`` CLI:

    parser = argparse.ArgumentParser()
    add_infra_arguments(parser)
    sys.exit(run_infra(settings_from_args(parser.parse_args())))

Flags override the ``RADIXSERVE_*`` environment variables (InfraSettings.from_env).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from radixserve.infra.launcher import run_infra
from radixserve.infra.settings import InfraSettings


def add_infra_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", help="use this NATS server instead of starting one")
    parser.add_argument("--redis-url", help="use this Redis server instead of starting one")
    parser.add_argument("--nats-port", type=int, help="port for the local NATS (default: free)")
    parser.add_argument("--redis-port", type=int, help="port for the local Redis (default: free)")
    parser.add_argument("--host", help="interface the local servers bind (default 127.0.0.1)")
    parser.add_argument("--nats-server-bin", help="path of the nats-server binary")
    parser.add_argument("--redis-server-bin", help="path of the redis-server binary")


def settings_from_args(args: argparse.Namespace) -> InfraSettings:
    """InfraSettings from the environment, with every given flag taking precedence."""
    overrides = {
        "nats_url": args.nats_url,
        "redis_url": args.redis_url,
        "nats_port": args.nats_port,
        "redis_port": args.redis_port,
        "host": args.host,
        "nats_server_path": args.nats_server_bin,
        "redis_server_path": args.redis_server_bin,
    }
    given = {key: value for key, value in overrides.items() if value is not None}
    return dataclasses.replace(InfraSettings.from_env(), **given)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m radixserve.infra",
        description="Run local NATS (JetStream) and Redis until SIGINT/SIGTERM.",
    )
    add_infra_arguments(parser)
    return run_infra(settings_from_args(parser.parse_args(argv)))
