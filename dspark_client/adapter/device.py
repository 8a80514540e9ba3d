"""The torch side every engine adapter shares (imported by the adapters only: the rest of
``dspark_client`` stays torch-free): rank 0's gather of tap rows into one host buffer, and the
device buffers each round's drafts and confidences are broadcast in and read from."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["RoundTensors", "TapRowGather", "client_tag"]


def client_tag(device: torch.device, data_parallel_rank: int) -> str:
    """What tells this engine's rank 0 from another engine's on the same host, stable across
    restarts: the physical GPU it runs on (two engines never share one), else its
    data-parallel rank."""
    if device.type != "cuda" or device.index is None:
        return f"dp{data_parallel_rank}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    physical = visible[device.index].strip() if device.index < len(visible) and \
        visible[device.index].strip() else str(device.index)
    return f"gpu{physical}"


class TapRowGather:
    """Rows of the target's tap hidden states as the HELLO's bf16 bytes, in one host buffer
    (pinned beside a GPU: one DMA per round), grown by doubling and kept."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: torch.Tensor | None = None

    def gather(self, taps: Sequence[torch.Tensor], begin: np.ndarray, count: np.ndarray
               ) -> np.ndarray | None:
        """``uint8 [sum(count), row_bytes]``: rows ``[begin[i], begin[i] + count[i])`` of the
        batch, request after request, each the ``taps`` (``[T, H]`` each, in the drafter's
        order) side by side. None when there are no rows."""
        total = int(count.sum())
        if not total:
            return None
        # Row i of the result is batch row begin[r] + (i - offset[r]) of its request r.
        offset = np.cumsum(count) - count
        where = np.repeat(begin - offset, count) + np.arange(total)
        at = torch.from_numpy(where).to(self.device, non_blocking=True)
        rows = torch.cat([t.index_select(0, at) for t in taps], dim=1)
        data = rows.to(torch.bfloat16).contiguous().view(torch.uint8)
        host = self._buffer(total, data.shape[1])
        host.copy_(data)
        return host.numpy()

    def _buffer(self, n: int, width: int) -> torch.Tensor:
        buf = self._host
        if buf is None or buf.shape[0] < n or buf.shape[1] != width:
            rows = max(n, 2 * (buf.shape[0] if buf is not None else 64))
            buf = self._host = torch.empty(rows, width, dtype=torch.uint8,
                                           pin_memory=self.device.type == "cuda")
        return buf[:n]


class RoundTensors:
    """``draft_tokens`` int64 ``[R, K]`` and ``confidence`` float32 ``[R, K]`` on the device,
    what every rank reads after a round, filled from rank 0's ``[n, 2K]`` round array
    (``dspark_client.adapter.engine``) through one copy and one broadcast."""

    def __init__(self, max_rows: int, K: int, device: torch.device) -> None:
        self.K = K
        self.draft_tokens = torch.zeros(max_rows, K, dtype=torch.int64, device=device)
        self.confidence = torch.zeros(max_rows, K, dtype=torch.float32, device=device)
        self._packed = torch.zeros(max_rows, 2 * K, dtype=torch.int64, device=device)

    def publish(self, n: int, host: np.ndarray | None, group: Any = None) -> None:
        """Rows ``[0, n)``: rank 0's ``host`` array (None on the other ranks), broadcast from
        rank 0 over ``group`` (anything with ``broadcast(tensor, src=0)``, as vLLM's and
        SGLang's group coordinators; None with one rank), then unpacked on every rank."""
        packed = self._packed[:n]
        if host is not None:
            packed.copy_(torch.from_numpy(host))
        if group is not None:
            group.broadcast(packed, src=0)
        self._unpack(n)

    def clear(self, n: int) -> None:
        """Rows ``[0, n)`` without drafts, on each rank alone (no broadcast): a batch every
        rank knows has no round (warmup, profiling, capture)."""
        self._packed[:n].zero_()
        self._unpack(n)

    def _unpack(self, n: int) -> None:
        packed = self._packed[:n]
        self.draft_tokens[:n] = packed[:, :self.K]
        self.confidence[:n] = packed[:, self.K:].to(torch.int32).view(torch.float32)
