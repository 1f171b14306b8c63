"""How the e2e tests run the `radixserve` command: this interpreter, and an environment
in which `up` starts its own NATS and Redis."""

from __future__ import annotations

import os
import signal
import sys

from radixserve.infra.settings import ENV_NATS_URL, ENV_REDIS_URL

CLI = [sys.executable, "-m", "radixserve.cli"]


def cli_env() -> dict[str, str]:
    # `up` must start its own servers here, whatever the test session points at.
    return {k: v for k, v in os.environ.items() if k not in (ENV_NATS_URL, ENV_REDIS_URL)}


def sigint_as_in_a_terminal() -> None:
    """`preexec_fn` for `up`: SIGINT at its default, as a terminal's Ctrl-C finds it. A
    suite started in the background (`cmd &`, nohup) has SIGINT ignored, and a child
    inherits that: Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
