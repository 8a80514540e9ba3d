"""Receive buffers for frame bodies (docs/contract.md 7.3; DRAFTER.md "What makes it fast").

``FrameDecoder`` asks ``BufferPool.alloc(n)`` for the storage of each frame body and receives
the body straight into it, so a large rows region is never assembled from chunks. Large bodies
come from power-of-two size classes that are reused once their frame is answered; on CUDA the
factory hands out pinned host memory so the rows' host-to-device copy can be asynchronous.
Small bodies (HELLO, PING, RESET, a STEP of a few entries) are plain ``bytearray``s: malloc of a
few KiB is cheaper than any bookkeeping. Loop thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

Storage = bytearray | memoryview

# Bodies below this are plain bytearrays; at and above it they come from the pool.
POOLED_MIN_BYTES: Final = 64 << 10
# Idle buffers kept per size class at least: a few connections' worth of concurrent large
# STEPs. The worker raises it to the number of sessions held (``idle_per_class``), so every
# engine's STEP in flight finds a buffer of its class once the pool is warm.
MIN_IDLE_PER_CLASS: Final = 4


def _size_class(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


class BufferPool:
    """Reusable bodies by power-of-two size class, at most ``max_idle_bytes`` kept idle."""

    def __init__(self, factory: Callable[[int], Storage] = bytearray, *,
                 max_idle_bytes: int = 1 << 30,
                 idle_per_class: Callable[[], int] | None = None) -> None:
        self._factory = factory
        self.max_idle_bytes = max_idle_bytes
        self._idle_per_class = idle_per_class or (lambda: MIN_IDLE_PER_CLASS)
        self._idle: dict[int, list[Storage]] = {}
        self.idle_bytes = 0  # kept for reuse
        self.in_use_bytes = 0  # handed out and not yet released
        self.created_bytes = 0  # ever made by the factory (a running total)
        self.hits = 0
        self.misses = 0

    @property
    def held_bytes(self) -> int:
        """Pooled receive memory held now: in use plus idle (STATS receive_buffers_bytes)."""
        return self.in_use_bytes + self.idle_bytes

    def alloc(self, n: int) -> Storage:
        if n < POOLED_MIN_BYTES:
            return bytearray(n)
        size = _size_class(n)
        idle = self._idle.get(size)
        self.in_use_bytes += size
        if idle:
            self.hits += 1
            self.idle_bytes -= size
            return idle.pop()
        self.misses += 1
        self.created_bytes += size
        return self._factory(size)

    def release(self, storage: Storage | None) -> None:
        """Return a body's storage; the caller holds no view of it any more."""
        if storage is None:
            return
        size = len(storage)
        if size < POOLED_MIN_BYTES or size & (size - 1):
            return  # a plain small bytearray: the garbage collector has it
        self.in_use_bytes = max(self.in_use_bytes - size, 0)
        idle = self._idle.setdefault(size, [])
        keep = max(MIN_IDLE_PER_CLASS, self._idle_per_class())
        if len(idle) >= keep or self.idle_bytes + size > self.max_idle_bytes:
            return
        idle.append(storage)
        self.idle_bytes += size

    def clear(self) -> None:
        self._idle.clear()
        self.idle_bytes = 0


def pinned_factory() -> Callable[[int], Storage]:
    """Page-locked host buffers (CUDA): a receive lands where a DMA copy can read it."""
    import torch

    def alloc(n: int) -> Storage:
        t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        return t.numpy().data  # a memoryview of the array, which keeps the tensor alive

    return alloc
