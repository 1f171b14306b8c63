"""Histogram buckets, in one place so every service and the dashboards agree.

The request-latency buckets are the OpenTelemetry GenAI semantic conventions' advice
(`gen_ai.server.time_to_first_token`, `gen_ai.server.time_per_output_token`,
`gen_ai.server.request.duration`, `gen_ai.client.token.usage`), so a Prometheus
histogram here and an OTel one elsewhere line up bucket for bucket. The internal
latencies (NATS and Redis round trips, an engine step) have no GenAI convention:
they get finer, lower buckets of their own.
"""

from __future__ import annotations

# gen_ai.server.time_to_first_token
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
# gen_ai.server.request.duration (also queue time and grammar compile time: seconds that
# can reach minutes)
E2E_BUCKETS = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
# gen_ai.server.time_per_output_token (also the inter-token latency)
TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
# gen_ai.client.token.usage (token counts)
TOKEN_BUCKETS = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip

# A NATS request/reply or a Redis command on a LAN: sub-millisecond to a few seconds.
ROUND_TRIP_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0,
)  # fmt: skip
# One engine step (decode on a GPU: milliseconds; a long prefill on a CPU: seconds).
STEP_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0,
)  # fmt: skip
# Requests advanced by one engine step.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
