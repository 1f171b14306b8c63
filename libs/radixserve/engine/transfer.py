"""Host <-> device copies that never wait for the device work queued before them.

On CUDA a plain `.to(device)`, `.tolist()` or `torch.tensor(..., device=...)` synchronises
the stream: the host would wait for every kernel queued so far, which is exactly what
overlap scheduling must not do. These go through pinned host memory with
`non_blocking=True` instead (the caching host allocator keeps a pinned buffer alive
until its copy has run). On the CPU they are plain copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload_int64(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """`values` as an int64 tensor on `device`, in one host-to-device copy that does not
    wait for the device (the per-step index uploads: one list of ints per step)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64, device=device)
    return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the host) on `device`, without waiting for queued device work."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def upload_into(dst: torch.Tensor, host: torch.Tensor) -> None:
    """Copy `host` into the device tensor `dst` without waiting for queued device work
    (the copy runs in stream order, after the work queued before it)."""
    if dst.device.type != "cuda":
        dst.copy_(host)
        return
    dst.copy_(host.pin_memory(), non_blocking=True)


class HostCopy:
    """Device tensors copied to the host behind the work queued so far.

    The copies are queued at construction; `wait()` waits for them alone (a CUDA event
    recorded right after them), not for device work queued later, and returns the host
    tensors (None stays None).
    """

    def __init__(self, tensors: Sequence[torch.Tensor | None]) -> None:
        self._host: list[torch.Tensor | None] = []
        self._event: torch.cuda.Event | None = None
        for tensor in tensors:
            if tensor is None or tensor.device.type != "cuda":
                self._host.append(tensor)
                continue
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._host.append(host)
            if self._event is None:
                self._event = torch.cuda.Event()
        if self._event is not None:
            self._event.record()

    def wait(self) -> list[torch.Tensor | None]:
        if self._event is not None:
            self._event.synchronize()
        return self._host
