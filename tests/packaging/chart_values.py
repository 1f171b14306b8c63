"""The value sets the chart tests render (`rendered` in conftest.py), and the services
every one of them deploys."""

from __future__ import annotations

from typing import Any

from tests.packaging.kube import GPU_VALUES, load_values

SERVICES = ("gateway", "tokenizer", "scheduler", "grammar", "detokenizer", "worker")
# Everything optional switched on: ingress, HPAs, KEDA, ServiceMonitor, external OTLP,
# a model volume, an explicit context length.
ALL_FEATURES: dict[str, Any] = {
    "config": {"otlpEndpoint": "http://otel-collector.observability:4318", "contextLength": 4096},
    "modelDir": {"existingClaim": "models"},
    "gateway": {"autoscaling": {"enabled": True}},
    "tokenizer": {"autoscaling": {"enabled": True}},
    "worker": {"keda": {"enabled": True}},
    "serviceMonitor": {"enabled": True},
    "ingress": {
        "enabled": True,
        "className": "nginx",
        "tls": [{"hosts": ["radixserve.local"], "secretName": "tls"}],
    },
    "networkPolicy": {
        "otlpTo": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}}}
        ]
    },
}
EXTERNAL_INFRA: dict[str, Any] = {
    "nats": {"enabled": False, "url": "nats://nats.infra:4223"},
    "redis": {"enabled": False, "url": "redis://redis.infra:6380/0"},
    "natsAuth": {"existingSecret": "nats-users"},
    "redisAuth": {"existingSecret": "redis-user"},
}


def _gpu_values() -> dict[str, Any]:
    return load_values(GPU_VALUES)


VALUE_SETS = {
    "default": lambda: None,
    "gpu": _gpu_values,
    "all-features": lambda: ALL_FEATURES,
    "external-infra": lambda: EXTERNAL_INFRA,
}
