"""The worker's engine: model, KV cache, batch scheduler, sampling.

NOTE: nothing under this package may import NATS, Redis or HTTP libraries; the
services adapt it to the bus.
"""
