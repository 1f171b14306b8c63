"""Triton kernels for the triton attention backend.

`decode` attends one new token per request with split-KV (flash-decoding); `extend`
attends several new tokens per request over a cached prefix plus the new tokens;
`indices` builds the flat KV slot tables both read. Importing this package imports
triton, so only the triton backend imports it, and only when it is chosen.
"""
