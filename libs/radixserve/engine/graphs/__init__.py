"""CUDA graphs: decode passes captured once at start-up and replayed every step."""
