"""The worker's library: the engine driven from its own thread (`driver.py`), the
conversion between wire messages and the engine's step API (`convert.py`), and the
worker's metrics and request spans (`metrics.py`). The worker service
(`radixserve.services.worker`) is the NATS adapter over these."""
