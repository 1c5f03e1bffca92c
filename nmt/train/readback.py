"""An update's statistics on their way to the host, read when the host needs them.

`nmt train` reads a handful of numbers per update (loss and NLL sums, gradient norm, the
ranks' save/stop flags). A `Readback` is immediate or deferred, which sets the order of the
training loop (nmt/train/loop.py): immediate, the host reads an update's numbers before it
launches the next update (a CPU, whose work is synchronous anyway); deferred, it reads them
one update late (CUDA: reading them at once would make the host wait for the GPU to finish
the update, and the GPU then wait for the host to launch the next one). Either way
`Readback.start` queues the copy: on CUDA a non-blocking device-to-host copy into a pinned
buffer and an event, which `Pending.values` waits for alone, by which time the next update
is queued behind it. Two buffers alternate so that a copy still in flight is never
overwritten by the next update's (the host reads update k before it starts the copy of
update k + 2). On a CPU the copy is synchronous and the event is not needed.

The flags travel the other way (host to device, for the all-reduce) through a pair of
pinned buffers for the same reason: `torch.tensor(x, device=cuda)` from pageable memory
would wait for the GPU's queue.
"""

from __future__ import annotations

import torch
from torch import Tensor


class _Pinned:
    """Two reusable host buffers of one length, pinned on CUDA, used alternately."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: list[Tensor] = []
        self.turn = 0

    def next(self, size: int) -> Tensor:
        if not self.buffers or self.buffers[0].numel() != size:
            cuda = self.device.type == "cuda"
            self.buffers = [torch.zeros(size, dtype=torch.float32, pin_memory=cuda)
                            for _ in range(2)]
        self.turn ^= 1
        return self.buffers[self.turn]


class Readback:
    """Device-to-host copies of one small float tensor per update (see the module doc).
    `deferred`: read one update late; None: on CUDA alone (a CPU test may ask for it)."""

    def __init__(self, device: torch.device, deferred: bool | None = None) -> None:
        self.device = device
        self.deferred = device.type == "cuda" if deferred is None else deferred
        self._host = _Pinned(device)
        self._flags = _Pinned(device)

    def flags_on_device(self, flags: list[float]) -> Tensor:
        """`flags` as a float32 device tensor, copied without waiting for the GPU."""
        buffer = self._flags.next(len(flags))
        buffer.copy_(torch.tensor(flags, dtype=torch.float32))
        return buffer.to(self.device, non_blocking=True)

    def start(self, values: Tensor) -> Pending:
        """Queue the copy of `values` (1-d, float32 on the device) to the host."""
        if self.device.type != "cuda":
            return Pending(values.detach().to(torch.float32), None)
        host = self._host.next(values.numel())
        host.copy_(values.detach(), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return Pending(host, event)


class Pending:
    """One queued copy: `values()` waits for it and returns the numbers."""

    def __init__(self, host: Tensor, event: torch.cuda.Event | None) -> None:
        self._host = host
        self._event = event
        self._values: list[float] | None = None

    def values(self) -> list[float]:
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            self._values = self._host.tolist()  # host memory: no device sync here
        return self._values
