"""The worker's library: the engine driven from its own thread (`driver.py`) and the
conversion between wire messages and the engine's step API (`convert.py`). The worker
service (`radixserve.services.worker`) is the NATS adapter over these."""
