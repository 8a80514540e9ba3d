"""Context rings: per lane, the projected context K/V of the newest W positions (CONTRACT 7.2
steps 4 and 5, section 8; DRAFTER.md "Inputs from the target").

One :class:`RingPool` serves every session: a lane is one slot's window, and a batch of lanes
from several sessions gathers from the same two tensors. Rows are projected once on arrival (one
batched ``fc -> hidden_norm -> k/v`` for all rows of a STEP and every layer at once,
``DraftModel.project_context_kv``) and scattered to ring index
``position % W``; attention never needs the ring in position order (there is no causal mask and
RoPE is already in K), only the mask of valid slots.

Window bookkeeping is host-side numpy: per lane the window ``[start, end)`` in positions, empty
when ``start == end``. The rules (7.2 step 4), for an entry with rows ``[a - n, a)``:

- reset (RF_RESET or a new generation): the rows become the window (empty when n == 0);
- rows that start at or before the window's end and not before its start overwrite from there
  and the window ends at ``a`` (rows past ``a`` are dropped);
- any other rows (a gap, or a start before the window's start) restart the window with them;
- no rows: a window ending after ``a`` is cut at ``a``;
- only the newest W rows are kept (and only those are projected and written).

``window_rows(lane, a)`` (7.2 step 5) is how many rows the window holds that end exactly at
``a``, at most W; 0 when the window ends elsewhere.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from protocol.errors import BusyError

from .model import ContextSource, DraftModel

IntArray = npt.NDArray[np.int64]


class PoolExhaustedError(BusyError):
    """Fewer free lanes than asked for: the worker cannot take the session now (ST_BUSY)."""


def plan_windows(start: IntArray, end: IntArray, anchor_pos: IntArray, n_rows: IntArray,
                 reset: npt.NDArray[np.bool_], window: int) -> tuple[IntArray, IntArray,
                                                                    IntArray, IntArray]:
    """7.2 step 4 for entries whose current windows are [start, end): the new windows and, per
    entry, the range of its own rows to write ``[write_from, a)`` in positions."""
    first = anchor_pos - n_rows  # [E] position of each entry's first row
    has_rows = n_rows > 0
    nonempty = end > start
    overwrite = has_rows & ~reset & nonempty & (first >= start) & (first <= end)
    new_start = np.where(overwrite, start, first)
    new_end = anchor_pos.copy()
    # no rows, not reset: keep the window, cut at the anchor
    keep = ~has_rows & ~reset
    cut_end = np.minimum(end, anchor_pos)
    new_end = np.where(keep, cut_end, new_end)
    new_start = np.where(keep, np.minimum(start, cut_end), new_start)
    # newest W only
    new_start = np.maximum(new_start, new_end - window)
    empty = new_end <= new_start
    new_start = np.where(empty, new_end, new_start)
    write_from = np.where(has_rows, np.maximum(first, anchor_pos - window), anchor_pos)
    return new_start, new_end, write_from, first


class RingPool:
    """Projected context K/V for ``capacity_lanes`` lanes of ``window`` positions each.

    ``k`` and ``v`` are [L, lanes, kv_heads, W, head_dim] in the model dtype, the two planes of
    ``kv``, reserved up front (``nbytes``); a family whose K and V are one tensor (K3's latent,
    ``DraftModel.ring_planes`` 1) has one plane, and ``k`` and ``v`` are both it. Lane ids are
    numpy int64 arrays. Not thread-safe: one owner (the runner)."""

    def __init__(self, model: DraftModel, capacity_lanes: int, window: int) -> None:
        if capacity_lanes <= 0:
            raise ValueError(f"capacity_lanes {capacity_lanes} must be positive")
        if window <= 0:
            raise ValueError(f"window {window} must be positive")
        c = model.config
        self.model = model
        self.capacity_lanes = int(capacity_lanes)
        self.window = int(window)
        self.device = model.fc.weight.device
        self.dtype = model.fc.weight.dtype
        self.row_bytes = c.row_bytes
        self.planes = model.ring_planes
        shape = (self.planes, c.num_hidden_layers, self.capacity_lanes, c.num_key_value_heads,
                 self.window, c.head_dim)
        # Zeros, not empty: masked slots are multiplied by 0 in attention and must be finite.
        # K and V in one tensor, so that one scatter writes both.
        self.kv = torch.zeros(shape, dtype=self.dtype, device=self.device)  # [2, L, P, Hkv, W, D]
        self.k = self.kv[0]  # [L, P, Hkv, W, D]
        self.v = self.kv[self.planes - 1]  # [L, P, Hkv, W, D]
        # Scatter indices that do not depend on the rows: K/V, layer, head.
        self._kv_index = torch.arange(self.planes, device=self.device).view(-1, 1, 1, 1)
        self._layer_index = torch.arange(c.num_hidden_layers, device=self.device).view(1, -1, 1, 1)
        self._head_index = torch.arange(c.num_key_value_heads, device=self.device).view(1, 1, 1,
                                                                                       -1)
        self._start = np.zeros(self.capacity_lanes, dtype=np.int64)
        self._end = np.zeros(self.capacity_lanes, dtype=np.int64)
        self._in_use = np.zeros(self.capacity_lanes, dtype=bool)
        self._pinned = self.device.type == "cuda"
        self._stage = _Staging()  # pinned host buffer for incoming rows (CUDA)

    # -- other drafters over the same rings ----------------------------------------------------
    @property
    def layout(self) -> tuple[Any, ...]:
        """What a lane holds: planes, layers, KV heads, W, head dim, dtype, device. Drafters
        of one layout can share the ring memory (``sibling``)."""
        return ring_layout(self.model, self.window)

    def sibling(self, model: DraftModel) -> RingPool:
        """A pool for ``model`` over this pool's ring memory and lanes: a lane allocated
        through either is taken in both, and each lane's K/V are projected by the drafter of
        the session holding it. ValueError when the model's ring layout differs (another
        count of layers or KV heads, head dim, dtype or device)."""
        theirs = ring_layout(model, self.window)
        if theirs != self.layout:
            names = ("planes", "layers", "kv heads", "W", "head_dim", "dtype", "device")
            diff = ", ".join(f"{n} {a} (serving {b})" for n, a, b
                             in zip(names, theirs, self.layout, strict=True) if a != b)
            raise ValueError(f"its ring layout differs: {diff}")
        other = object.__new__(RingPool)
        other.__dict__.update(self.__dict__)  # the same tensors, window arrays and staging
        other.model = model
        return other

    # -- sizes --------------------------------------------------------------------------------
    @property
    def bytes_per_lane(self) -> int:
        c = self.model.config
        elem = torch.finfo(self.dtype).bits // 8
        return (self.planes * c.num_hidden_layers * self.window * c.num_key_value_heads
                * c.head_dim * elem)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    @property
    def free_lanes(self) -> int:
        return int((~self._in_use).sum())

    # -- lanes --------------------------------------------------------------------------------
    def allocate(self, n: int) -> IntArray:
        """n free lanes (lowest ids first) with empty windows; PoolExhaustedError if fewer."""
        free = np.flatnonzero(~self._in_use)
        if n < 0 or free.size < n:
            raise PoolExhaustedError(
                f"ring pool has {free.size} free lanes of {self.capacity_lanes};"
                f" {n} requested", field="lanes", value=n, limit=int(free.size))
        lanes = free[:n].astype(np.int64)
        self._in_use[lanes] = True
        self._start[lanes] = 0
        self._end[lanes] = 0
        return lanes

    def free(self, lanes: npt.ArrayLike) -> None:
        ids = self._lanes(lanes)
        self._in_use[ids] = False
        self._start[ids] = 0
        self._end[ids] = 0

    def release(self, lanes: npt.ArrayLike) -> None:
        """Forget the windows of these lanes (RF_RELEASE, RESET); the lanes stay allocated."""
        ids = self._lanes(lanes)
        self._start[ids] = 0
        self._end[ids] = 0

    def windows(self, lanes: npt.ArrayLike) -> tuple[IntArray, IntArray]:
        """Copies of the windows' [start, end) in positions."""
        ids = self._lanes(lanes)
        return self._start[ids].copy(), self._end[ids].copy()

    def window_rows(self, lanes: npt.ArrayLike, anchor_pos: npt.ArrayLike) -> IntArray:
        """7.2 step 5: rows held that end exactly at anchor_pos (at most W), else 0."""
        ids = self._lanes(lanes)
        anchor = np.asarray(anchor_pos, dtype=np.int64)
        held = np.minimum(self._end[ids] - self._start[ids], self.window)
        return np.where(self._end[ids] == anchor, held, 0).astype(np.int64)

    # -- rows ---------------------------------------------------------------------------------
    def apply(self, lanes: npt.ArrayLike, anchor_pos: npt.ArrayLike, n_rows: npt.ArrayLike,
              reset: npt.ArrayLike, rows: npt.ArrayLike | bytes | memoryview | None) -> None:
        """Apply the rows of one STEP (7.2 step 4) for entries over distinct lanes.

        Entry i's rows are positions ``[anchor_pos[i] - n_rows[i], anchor_pos[i])``, held in
        ``rows`` (uint8 [sum(n_rows), row_bytes] or a buffer of that many bytes) in entry order.
        Every check runs before anything changes, and the bookkeeping is committed only after
        the projection and the scatter, so a failure leaves every window's bounds as they were
        (ring slots the failed scatter reached may hold the new rows; the worker drops the
        session on such a failure anyway, CONTRACT 7.2 step 7).
        """
        ids = self._lanes(lanes)
        anchor = np.asarray(anchor_pos, dtype=np.int64).reshape(-1)
        counts = np.asarray(n_rows, dtype=np.int64).reshape(-1)
        resets = np.asarray(reset, dtype=bool).reshape(-1)
        if not (anchor.shape == counts.shape == resets.shape == ids.shape):
            raise ValueError(f"lanes {ids.shape}, anchor_pos {anchor.shape}, n_rows "
                             f"{counts.shape} and reset {resets.shape} must have one shape")
        if ids.size > 1 and (np.diff(np.sort(ids)) == 0).any():
            raise ValueError(f"lanes {ids.tolist()} repeat within one apply")
        if (counts < 0).any() or (counts > anchor).any():
            i = int(np.flatnonzero((counts < 0) | (counts > anchor))[0])
            raise ValueError(f"entry {i}: n_rows {int(counts[i])} outside [0, anchor_pos "
                             f"{int(anchor[i])}]")
        total = int(counts.sum())
        table = self._row_table(rows, total)

        new_start, new_end, write_from, first = plan_windows(
            self._start[ids], self._end[ids], anchor, counts, resets, self.window)
        n_write = anchor - write_from  # [E]
        n_total = int(n_write.sum())
        if n_total:
            ends = np.cumsum(n_write)  # [E]
            local = np.arange(n_total) - np.repeat(ends - n_write, n_write)  # [R] within entry
            row_lane = np.repeat(ids, n_write)  # [R]
            row_pos = np.repeat(write_from, n_write) + local  # [R]
            if n_total == total:  # every row is written (no entry carried more than W)
                picked = table
            else:  # the newest W rows of each entry: a host gather
                offsets = np.cumsum(counts) - counts  # [E] each entry's first row in the table
                picked = table[np.repeat(offsets + (write_from - first), n_write) + local]
            with torch.inference_mode():
                self._write(picked, row_lane, row_pos)
        self._start[ids] = new_start
        self._end[ids] = new_end

    def _row_table(self, rows: npt.ArrayLike | bytes | memoryview | None,
                   total: int) -> npt.NDArray[np.uint8]:
        if rows is None:
            rows = np.zeros((0, self.row_bytes), dtype=np.uint8)
        if isinstance(rows, bytes | bytearray | memoryview):
            table = np.frombuffer(rows, dtype=np.uint8)
        else:
            table = np.asarray(rows)
            if table.dtype != np.uint8:
                raise ValueError(f"rows have dtype {table.dtype}, expected uint8 bytes")
        if table.size != total * self.row_bytes:
            raise ValueError(f"rows hold {table.size} bytes; {total} rows of {self.row_bytes}"
                             f" bytes need {total * self.row_bytes}")
        return table.reshape(total, self.row_bytes)

    def _write(self, table: npt.NDArray[np.uint8], lane: IntArray, pos: IntArray) -> None:
        """Project the rows (one batch, every layer at once) and scatter K and V to
        (lane, pos % W) in one write."""
        r = table.shape[0]
        meta = np.stack([lane, pos, pos % self.window])  # [3, R]
        bf16 = self._upload_rows(table)  # [R, tap_width] bf16 on device
        meta_t = self._upload(meta)  # [3, R] int64
        kv = self.model.project_context_kv(bf16.to(self.dtype), meta_t[1])  # [2, L, R, Hkv, D]
        lane_t = meta_t[0].view(1, 1, r, 1)  # [1, 1, R, 1]
        slot_t = meta_t[2].view(1, 1, r, 1)  # [1, 1, R, 1]
        # broadcast to [2, L, R, Hkv]: kv [2, L, R, Hkv, D] into [2, L, P, Hkv, W, D]
        self.kv.index_put_((self._kv_index, self._layer_index, lane_t, self._head_index, slot_t),
                           kv)

    def _upload_rows(self, table: npt.NDArray[np.uint8]) -> Tensor:
        host = _as_int16(table)  # [R, tap_width]
        if not self._pinned:
            return _host_tensor(host).view(torch.bfloat16).to(self.device)  # [R, tap_width]
        if not host.flags.writeable:
            # Rows in a client's shared-memory region (contract section 13), page-locked when it
            # was attached: one DMA read straight from it, finished before this returns, so the
            # rows are consumed before the reply (the client may rewrite them after it).
            return _host_tensor(host).to(self.device).view(torch.bfloat16)  # [R, tap_width]
        need = host.size
        st = self._stage
        if st.buffer is None or st.buffer.numel() < need:
            st.buffer = torch.empty(max(need, 1 << 20), dtype=torch.int16, pin_memory=True)
        elif st.done is not None:
            # The previous STEP's copy may still read the staging buffer: wait for it (it has
            # almost always finished) before the host overwrites it.
            st.done.synchronize()
        stage = st.buffer[:need].view(host.shape)  # [R, tap_width] pinned
        stage.numpy()[...] = host  # one host copy, straight from the frame's bytes
        out = stage.to(self.device, non_blocking=True)  # [R, tap_width] int16
        st.done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        st.done.record()
        return out.view(torch.bfloat16)  # [R, tap_width]

    def _upload(self, array: npt.NDArray[np.int64]) -> Tensor:
        t = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
        if self._pinned:
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    # -- drafting -----------------------------------------------------------------------------
    def context(self, lanes: IntArray | None, lanes_t: Tensor, start: Tensor,
                rows: Tensor) -> RingContext:
        """The context of these lanes for the backbone: valid slots hold the positions
        ``[start, start + rows)`` of each lane. ``lanes_t``, start, rows: [B] int64 on the
        device (lanes_t equal to the host ``lanes``; None: not known on the host, as in a
        captured step, and always gathered)."""
        return RingContext(self, lanes, lanes_t, start, rows)

    def _lanes(self, lanes: npt.ArrayLike) -> IntArray:
        ids = np.asarray(lanes, dtype=np.int64).reshape(-1)
        if ids.size and ((ids < 0).any() or (ids >= self.capacity_lanes).any()):
            raise ValueError(f"lanes {ids.tolist()} outside [0, {self.capacity_lanes})")
        if ids.size and not self._in_use[ids].all():
            bad = ids[~self._in_use[ids]]
            raise ValueError(f"lanes {bad.tolist()} are not allocated")
        return ids


def ring_layout(model: DraftModel, window: int) -> tuple[Any, ...]:
    """What one lane of ``model``'s rings holds: planes (2: K and V; 1: one latent), layers,
    KV heads, W, head dim, dtype, device."""
    c = model.config
    return (model.ring_planes, c.num_hidden_layers, c.num_key_value_heads, window, c.head_dim,
            model.fc.weight.dtype, model.fc.weight.device)


class _Staging:
    """The pinned host buffer rows are copied through on CUDA, and the event of the last copy
    out of it; one for a pool and its siblings (they run on one thread)."""

    __slots__ = ("buffer", "done")

    def __init__(self) -> None:
        self.buffer: Tensor | None = None
        self.done: torch.cuda.Event | None = None


class RingContext(ContextSource):
    """Context for a batch of lanes read from the pool, one layer at a time."""

    def __init__(self, pool: RingPool, lanes: IntArray | None, lanes_t: Tensor, start: Tensor,
                 rows: Tensor) -> None:
        self.pool = pool
        w = pool.window
        # Lanes lo..lo+B-1 in order (a session's slots, allocated together) read a view, no copy.
        self._span: slice | None = None
        b = 0 if lanes is None else lanes.size
        if lanes is not None and b and int(lanes[-1]) - int(lanes[0]) == b - 1 and (
                np.diff(lanes) == 1).all():
            self._span = slice(int(lanes[0]), int(lanes[0]) + b)
        self._lanes_t = lanes_t
        slot = torch.arange(w, device=pool.device).unsqueeze(0)  # [1, W]
        # Ring slot s holds position p = s (mod W); inside [start, start + rows) it is valid.
        self.valid = torch.remainder(slot - start.unsqueeze(1), w) < rows.unsqueeze(1)  # [B, W]
        self._slot, self._end, self._rows = slot, start + rows, rows

    def layer(self, index: int) -> tuple[Tensor, Tensor]:
        k, v = self.pool.k[index], self.pool.v[index]  # [P, Hkv, W, D]
        if self._span is not None:
            return k[self._span], v[self._span]  # [B, Hkv, W, D]
        return k.index_select(0, self._lanes_t), v.index_select(0, self._lanes_t)

    def newest(self, count: int) -> Tensor:
        keep = self._rows.clamp_max(count)  # [B] rows of [end - keep, end)
        start = self._end - keep
        age = torch.remainder(self._slot - start.unsqueeze(1), self.pool.window)  # [B, W]
        return age < keep.unsqueeze(1)


def encode_bf16_rows(values: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """Float rows [R, tap_width] -> wire tap rows uint8 [R, tap_width * 2] (bf16, round to
    nearest even, little-endian). For tests, benchmarks and in-process callers."""
    t = torch.as_tensor(np.asarray(values, dtype=np.float32)).to(torch.bfloat16)
    rows, width = t.shape
    return t.view(torch.int16).numpy().view(np.uint8).reshape(rows, width * 2)


def decode_bf16_rows(rows: npt.NDArray[np.uint8], tap_width: int) -> npt.NDArray[np.float32]:
    """Wire tap rows uint8 [R, tap_width * 2] -> float32 [R, tap_width]."""
    host = torch.from_numpy(_as_int16(rows).reshape(-1, tap_width).copy())
    return host.view(torch.bfloat16).float().numpy()


def _host_tensor(host: npt.NDArray[Any]) -> Tensor:
    """A tensor over ``host`` without a copy, also when it is read-only (a read-only mapping of
    a client's region): torch warns that writing through it would be undefined, and nothing
    here writes to it."""
    if host.flags.writeable:
        return torch.from_numpy(host)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(host)


def _as_int16(table: npt.NDArray[np.uint8]) -> npt.NDArray[np.int16]:
    """uint8 [R, 2w] -> int16 [R, w] over the same bytes (copied only if not contiguous).
    Through 1-D so that a length-1 axis cannot carry an odd stride into torch."""
    rows = table.shape[0] if table.ndim == 2 else -1
    flat = np.ascontiguousarray(table).reshape(-1).view(np.int16)
    return flat.reshape(rows, -1) if flat.size else flat.reshape(max(rows, 0), 0)
