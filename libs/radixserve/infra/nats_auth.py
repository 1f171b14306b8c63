"""Who may publish and subscribe to what on NATS: one user per service role, each allowed
the subjects its service's code uses (read from protocol.subjects, under the configured
prefix), rendered as nats-server's `authorization { users = [...] }` block.

    users = NatsUsers.generate()                    # a random password per role
    text = render_authorization(Subjects("rs"), users)          # literal passwords
    text = render_authorization(Subjects("rs"))     # password: $RADIXSERVE_NATS_PASSWORD_GATEWAY ...

A responder (the tokenizer acknowledging a submit, the grammar service answering a
compile) answers on its requester's reply subject through `allow_responses`; a requester
(`Bus.request`) receives its answer on nats-py's `_INBOX.>`. No service uses JetStream
(the NATS servers radixserve starts run without it), so on a NATS of yours that has it no
role but `admin` may reach `$JS.API.>`. `admin` (`radixserve health`, operators' taps) may
do anything.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from radixserve.credentials import with_userinfo
from radixserve.protocol.subjects import Subjects

SERVICE_ROLES = ("gateway", "tokenizer", "scheduler", "worker", "grammar", "detokenizer")
ADMIN = "admin"
ROLES = (*SERVICE_ROLES, ADMIN)
INBOX = "_INBOX.>"  # nats-py's default inbox prefix
_ANY = "RADIXSERVE-ANY-ID"  # stands for one id token while a subject is derived


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False


def password_variable(role: str) -> str:
    """The nats-server variable (an environment variable of the server) of a role's
    password in a rendered config, e.g. `RADIXSERVE_NATS_PASSWORD_GATEWAY`."""
    return f"RADIXSERVE_NATS_PASSWORD_{_checked_role(role).upper()}"


def role_permissions(subjects: Subjects) -> dict[str, Permissions]:
    """Each role's subjects, as its service's code publishes and subscribes to them."""
    s = subjects

    def any_id(subject: Callable[..., str], *args: str) -> str:
        """`subject(...)` with each id token a `*`: the form for every worker / gateway."""
        tokens = subject(*[_ANY if a == "*" else a for a in args]).split(".")
        return ".".join("*" if token == _ANY else token for token in tokens)

    def alive(role: str) -> str:
        return any_id(s.alive, role, "*")

    errors = s.gateway_errors_all
    return {
        "gateway": Permissions(
            publish=(s.tokenize, s.abort, s.flush_cache, s.scheduler_inflight, alive("gateway")),
            subscribe=(
                any_id(s.gateway_all, "*"),
                s.heartbeat_all,
                s.stats_all,
                s.alive_all,
                INBOX,
            ),
        ),
        "tokenizer": Permissions(
            publish=(s.schedule, s.abort, s.grammar_compile, errors, alive("tokenizer")),
            subscribe=(s.tokenize, s.abort, INBOX),
            allow_responses=True,  # the submit acknowledgement
        ),
        "scheduler": Permissions(
            publish=(
                errors,
                s.worker_run_all,
                s.worker_abort_all,
                any_id(s.worker_flush_cache, "*"),
                any_id(s.worker_kv_snapshot, "*"),
                alive("scheduler"),
            ),
            subscribe=(
                s.schedule,
                s.abort,
                s.flush_cache,
                s.scheduler_inflight,
                any_id(s.scheduler_acks, "*"),
                s.heartbeat_all,
                s.stats_all,
                s.kv_events_all,
                s.detok,
                errors,
                INBOX,
            ),
            allow_responses=True,  # schedule acknowledgements, flush and inflight replies
        ),
        "worker": Permissions(
            publish=(
                s.detok,
                errors,
                s.grammar_fetch,
                s.kv_events_all,
                s.stats_all,
                s.heartbeat_all,
                alive("worker"),
            ),
            subscribe=(any_id(s.worker_all, "*"), s.detok_resync, INBOX),
            allow_responses=True,  # run acknowledgements, flush replies
        ),
        "grammar": Permissions(
            publish=(alive("grammar"),),
            subscribe=(s.grammar_compile, s.grammar_fetch),
            allow_responses=True,  # compile and fetch replies
        ),
        "detokenizer": Permissions(
            publish=(s.gateway_deltas_all, errors, s.abort, s.detok_resync, alive("detokenizer")),
            subscribe=(s.detok,),
        ),
        ADMIN: Permissions(publish=(">",), subscribe=(">",)),
    }


@dataclass(frozen=True)
class NatsUsers:
    """The password of each role's user (the user is named after the role)."""

    passwords: Mapping[str, str] = field(repr=False)

    def __post_init__(self) -> None:
        if set(self.passwords) != set(ROLES):
            raise ValueError(f"NatsUsers needs a password for each of {', '.join(ROLES)}")

    @classmethod
    def generate(cls) -> NatsUsers:
        return cls({role: secrets.token_urlsafe(24) for role in ROLES})

    def password(self, role: str) -> str:
        return self.passwords[_checked_role(role)]

    def url_for(self, role: str, url: str) -> str:
        """`url` with the role's `user:password@`, for a client that takes one string."""
        return with_userinfo(url, role, self.password(role))


def render_authorization(subjects: Subjects, users: NatsUsers | None = None) -> str:
    """nats-server's `authorization` block: literal passwords from `users`, or (None) each
    role's `$RADIXSERVE_NATS_PASSWORD_<ROLE>`, for a checked-in config whose server gets
    the passwords as environment variables."""
    entries = []
    for role, permissions in role_permissions(subjects).items():
        password = json.dumps(users.password(role)) if users else f"${password_variable(role)}"
        lines = [
            "    {",
            f"      user: {json.dumps(role)}",
            f"      password: {password}",
            "      permissions: {",
            f"        publish: {{ allow: {json.dumps(list(permissions.publish))} }}",
            f"        subscribe: {{ allow: {json.dumps(list(permissions.subscribe))} }}",
        ]
        if permissions.allow_responses:
            lines.append("        allow_responses: true")
        lines += ["      }", "    }"]
        entries.append("\n".join(lines))
    body = "\n".join(entries)
    return f"authorization {{\n  users = [\n{body}\n  ]\n}}\n"


def _checked_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown NATS role {role!r}; one of {', '.join(ROLES)}")
    return role
