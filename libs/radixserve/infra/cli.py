"""Command-line flags for the launcher, reusable by the ``radixserve`` CLI:

    parser = argparse.ArgumentParser()
    add_infra_arguments(parser)       # the servers' flags (`radixserve up` takes them too)
    add_infra_commands(parser)        # --subject-prefix and the `nats-auth-config` command
    sys.exit(run_infra_command(parser.parse_args()))

Flags override the ``RADIXSERVE_*`` environment variables (InfraSettings.from_env).
``nats-auth-config`` prints nats-server's ``authorization`` block of the role users, with
each password a ``$RADIXSERVE_NATS_PASSWORD_<ROLE>`` variable (for a packaged config).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from radixserve.infra.launcher import run_infra
from radixserve.infra.nats_auth import render_authorization
from radixserve.infra.settings import InfraSettings
from radixserve.protocol.subjects import DEFAULT_PREFIX, Subjects

NATS_AUTH_CONFIG = "nats-auth-config"


def add_infra_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", help="use this NATS server instead of starting one")
    parser.add_argument("--redis-url", help="use this Redis server instead of starting one")
    parser.add_argument("--nats-port", type=int, help="port for the local NATS (default: free)")
    parser.add_argument("--redis-port", type=int, help="port for the local Redis (default: free)")
    parser.add_argument("--host", help="interface the local servers bind (default 127.0.0.1)")
    parser.add_argument("--nats-server-bin", help="path of the nats-server binary")
    parser.add_argument("--redis-server-bin", help="path of the redis-server binary")
    parser.add_argument(
        "--no-auth",
        action="store_true",
        help="start the local servers without credentials (default: a generated NATS user "
        "per role and a Redis ACL user; $RADIXSERVE_INFRA_AUTH=0 does the same)",
    )


def add_infra_commands(parser: argparse.ArgumentParser) -> None:
    """`--subject-prefix` (the NATS permissions' subjects) and the `nats-auth-config`
    command, for `radixserve infra` and `python -m radixserve.infra`."""
    parser.add_argument(
        "--subject-prefix",
        default=None,
        help=f"the subjects the NATS users may use are under it (default {DEFAULT_PREFIX})",
    )
    commands = parser.add_subparsers(dest="infra_command")
    commands.add_parser(
        NATS_AUTH_CONFIG,
        help="print nats-server's authorization block of the role users (passwords as "
        "$RADIXSERVE_NATS_PASSWORD_<ROLE> variables) and exit",
    )


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
        "auth": False if args.no_auth else None,
        "subject_prefix": getattr(args, "subject_prefix", None),
    }
    given = {key: value for key, value in overrides.items() if value is not None}
    return dataclasses.replace(InfraSettings.from_env(), **given)


def run_infra_command(args: argparse.Namespace) -> int:
    """`nats-auth-config`: print the block; else run the servers until a signal."""
    settings = settings_from_args(args)
    if getattr(args, "infra_command", None) == NATS_AUTH_CONFIG:
        sys.stdout.write(render_authorization(Subjects(settings.subject_prefix)))
        return 0
    return run_infra(settings)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m radixserve.infra",
        description="Run local NATS and Redis until SIGINT/SIGTERM.",
    )
    add_infra_arguments(parser)
    add_infra_commands(parser)
    return run_infra_command(parser.parse_args(argv))
