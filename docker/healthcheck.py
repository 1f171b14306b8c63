"""Container health check: exit 0 when this container's service answers over HTTP, else 1.

    python /opt/radixserve/healthcheck.py                  # the URL the environment implies
    python /opt/radixserve/healthcheck.py --require radixserve:cache_config_info

The URL is `$RADIXSERVE_HEALTH_URL` when set (compose's gateway: its `/health/ready`, as it
runs a metrics port too); else the service's own `/metrics` port (`$RADIXSERVE_METRICS_PORT`);
else the gateway's `/health/ready` on `$RADIXSERVE_GATEWAY_PORT` (8000), which answers 200
only while the gateway can serve (on the bus, not draining, and a tokenizer, scheduler,
grammar service, detokenizer and ready worker heard from). `--require NAME` (or
`$RADIXSERVE_HEALTH_REQUIRE`) also wants a series of that metric in the answer: the worker
uses one that exists only once its model is loaded, so "healthy" means "ready to serve".

Standard library only, no radixserve import: it starts in a few tens of milliseconds in
every image, as Docker's HEALTHCHECK and Kubernetes exec probes run it often.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping

ENV_HEALTH_URL = "RADIXSERVE_HEALTH_URL"
ENV_HEALTH_REQUIRE = "RADIXSERVE_HEALTH_REQUIRE"
ENV_METRICS_PORT = "RADIXSERVE_METRICS_PORT"
ENV_GATEWAY_PORT = "RADIXSERVE_GATEWAY_PORT"
DEFAULT_GATEWAY_PORT = "8000"


def health_url(env: Mapping[str, str]) -> str:
    explicit = env.get(ENV_HEALTH_URL, "").strip()
    if explicit:
        return explicit
    metrics_port = env.get(ENV_METRICS_PORT, "").strip()
    if metrics_port and metrics_port != "0":
        return f"http://127.0.0.1:{metrics_port}/metrics"
    gateway_port = env.get(ENV_GATEWAY_PORT, "").strip() or DEFAULT_GATEWAY_PORT
    return f"http://127.0.0.1:{gateway_port}/health/ready"


def has_series(body: str, metric: str) -> bool:
    """A sample line of `metric` (not only its # HELP / # TYPE comments)."""
    for line in body.splitlines():
        if line.startswith(metric) and line[len(metric) : len(metric) + 1] in ("{", " "):
            return True
    return False


def check(url: str, require: str, timeout_s: float) -> str | None:
    """None when healthy, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:
            body = answer.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return f"{url} answered {exc.code}"
    except (OSError, ValueError) as exc:
        return f"{url} unreachable: {exc}"
    if require and not has_series(body, require):
        return f"{url} has no {require} yet"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="default: from the environment (see above)")
    parser.add_argument("--require", default=None, help="a metric that must have a series")
    parser.add_argument("--timeout-s", type=float, default=10.0)
    ns = parser.parse_args(argv)
    url = ns.url or health_url(os.environ)
    require = ns.require if ns.require is not None else os.environ.get(ENV_HEALTH_REQUIRE, "")
    problem = check(url, require.strip(), ns.timeout_s)
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
