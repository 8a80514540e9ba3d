"""Rank 0's ring of the newest W tap rows per slot (docs/contract.md sections 7.5 and 8).

A resync sends a slot's newest ``min(W, anchor_pos)`` rows again, so rank 0 must still hold
them when the worker has lost them (a reconnect, a new session, a timeout). ``TapRing`` keeps
them in one preallocated ``uint8 [max_slots, W, row_bytes]`` array; the row of position ``p``
lives at ``p % W``, and per slot the ring tracks the contiguous run of positions
``[start, end)`` it holds (``end - start <= W``).

Writes follow the worker's own rule (7.2 step 4), so both sides hold the same run: rows that
start inside the held run (or right at its end) overwrite from there and the run ends where
they end; a gap or a start before the run restarts it.

The per-slot methods serve tests, tools and the rare paths; a round uses the batch ones
(``write_batch``, ``available_batch``, ``gather_batch``), one numpy call each for all its slots.

Memory: ``max_slots * W * row_bytes`` bytes (256 slots, W = 128, 25.6 KiB rows: 840 MB). The
array is made with ``np.empty``, so pages are only touched when rows arrive.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["TapRing"]


class TapRing:
    def __init__(self, max_slots: int, window: int, row_bytes: int) -> None:
        for name, value in (("max_slots", max_slots), ("window", window),
                            ("row_bytes", row_bytes)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TapRing {name} {value!r} must be a positive int")
        self.max_slots = max_slots
        self.window = window
        self.row_bytes = row_bytes
        self.data: npt.NDArray[np.uint8] = np.empty((max_slots, window, row_bytes), np.uint8)
        # Held run per slot: positions [start, end). start == end: nothing held.
        self.start: npt.NDArray[np.int64] = np.zeros(max_slots, np.int64)
        self.end: npt.NDArray[np.int64] = np.zeros(max_slots, np.int64)
        # Row (slot, p % W) as one item of row_bytes: numpy copies each with one memcpy
        # (a quarter faster than a [n, row_bytes] uint8 scatter, bench/README.md).
        self._rows_dtype = np.dtype((np.void, row_bytes))
        self._flat = self.data.reshape(-1).view(self._rows_dtype)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def clear(self, slot: int) -> None:
        self.start[slot] = self.end[slot] = 0

    def held(self, slot: int) -> tuple[int, int]:
        """The positions ``[start, end)`` the slot holds."""
        return int(self.start[slot]), int(self.end[slot])

    def available(self, slot: int, anchor_pos: int) -> int:
        """How many rows the slot holds that end exactly at ``anchor_pos`` (at most W)."""
        start, end = self.held(slot)
        if not start <= anchor_pos <= end:
            return 0
        return anchor_pos - start

    def available_batch(self, slots: npt.NDArray[np.int64],
                        anchor_pos: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """``available`` for many slots at once."""
        start, end = self.start[slots], self.end[slots]
        held = (start <= anchor_pos) & (anchor_pos <= end)
        return np.where(held, anchor_pos - start, 0)

    def write(self, slot: int, first_pos: int, rows: npt.NDArray[Any]) -> None:
        """Rows ``[n, row_bytes]`` of positions ``[first_pos, first_pos + n)``."""
        shape = rows.shape
        if len(shape) != 2 or shape[1] != self.row_bytes:
            raise ValueError(f"slot {slot}: rows of shape {shape}, expected"
                             f" [n, {self.row_bytes}]")
        n = shape[0]
        if first_pos < 0:
            raise ValueError(f"slot {slot}: rows start at position {first_pos} < 0")
        if n == 0:
            return
        skip = self.advance(slot, first_pos, n)
        src = rows[skip:]
        W = self.window
        i0 = (first_pos + skip) % W
        k = src.shape[0]
        first = min(k, W - i0)
        ring = self.data[slot]
        ring[i0:i0 + first] = src[:first]
        if first < k:
            ring[:k - first] = src[first:]

    def advance(self, slot: int, first_pos: int, n: int) -> int:
        """The bookkeeping of ``write`` without the copy: the held run after rows of positions
        ``[first_pos, first_pos + n)`` arrive. Returns how many of them (from the front) fall
        out of the window."""
        start, end = self.held(slot)
        last = first_pos + n
        # Continue or overwrite inside the held run; a gap, a start before the run, or nothing
        # held restarts it. Only the newest W rows survive.
        new_start = start if start < end and start <= first_pos <= end else first_pos
        new_start = max(new_start, last - self.window)
        self.start[slot], self.end[slot] = new_start, last
        return max(0, new_start - first_pos)

    def write_batch(self, slots: npt.NDArray[np.int64], first_pos: npt.NDArray[np.int64],
                    counts: npt.NDArray[np.int64], rows: npt.NDArray[np.uint8],
                    offsets: npt.NDArray[np.int64] | None = None) -> None:
        """``write`` for many distinct slots in one scatter: slot ``slots[i]`` takes the
        ``counts[i]`` rows ``rows[offsets[i]:][:counts[i]]`` (back to back in ``rows`` when
        ``offsets`` is None) as positions ``first_pos[i]`` on. Shapes are the caller's to
        check."""
        if offsets is None:
            offsets = np.cumsum(counts) - counts
        # Slots without rows change nothing (``write`` returns at once for them).
        if counts.min() <= 0:
            has = counts > 0
            slots, first_pos, counts, offsets = (slots[has], first_pos[has], counts[has],
                                                 offsets[has])
            if not len(slots):
                return
        start, end = self.start[slots], self.end[slots]
        last = first_pos + counts
        # The rule of ``advance``, for every slot at once.
        kept_run = (start < end) & (start <= first_pos) & (first_pos <= end)
        new_start = np.maximum(np.where(kept_run, start, first_pos), last - self.window)
        self.start[slots], self.end[slots] = new_start, last
        # The rows that stay (the newest min(W, count) of each) start here.
        skip = np.maximum(new_start - first_pos, 0)
        kept = counts - skip
        dst, at = self._places(slots, first_pos + skip, kept)
        src = self._items(rows)
        src_first = offsets + skip
        if (src_first - at == src_first[0]).all():  # back to back: the source is a view
            self._flat[dst] = src[src_first[0]:src_first[0] + len(dst)]
        else:
            self._flat[dst] = src[np.repeat(src_first - at, kept) + np.arange(len(dst))]

    def gather_batch(self, slots: npt.NDArray[np.int64], anchor_pos: npt.NDArray[np.int64],
                     counts: npt.NDArray[np.int64], out: npt.NDArray[np.uint8]) -> int:
        """``gather`` for many slots in one call: the rows of positions ``[anchor_pos[i] -
        counts[i], anchor_pos[i])`` of ``slots[i]`` back to back into ``out``. Returns the rows
        written (``out`` C-contiguous)."""
        if not out.flags.c_contiguous:
            raise ValueError("gather_batch writes into a C-contiguous out only")
        first = anchor_pos - counts
        bad = (counts < 0) | ((counts > 0) & ((first < self.start[slots])
                                              | (anchor_pos > self.end[slots])))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            self.gather(int(slots[i]), int(anchor_pos[i]), int(counts[i]), out)  # raises
        dst, _ = self._places(slots, first, counts)
        np.take(self._flat, dst, out=self._items(out[:len(dst)]))
        return len(dst)

    def _items(self, rows: npt.NDArray[np.uint8]) -> npt.NDArray[np.void]:
        """``uint8 [n, row_bytes]`` as n items of ``row_bytes``: a view when contiguous (the
        gather's ``out`` always is), else a contiguous copy (a source)."""
        if not rows.flags.c_contiguous:
            rows = np.ascontiguousarray(rows)
        return rows.view(self._rows_dtype).reshape(-1)

    def _places(self, slots: npt.NDArray[np.int64], first_pos: npt.NDArray[np.int64],
                counts: npt.NDArray[np.int64]
                ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Flat row indices of positions ``[first_pos[i], first_pos[i] + counts[i])`` in
        ``slots[i]``'s ring, slot after slot, and where each slot's run starts in them."""
        if not len(counts):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        at = np.cumsum(counts) - counts
        # Row j of the result is position first_pos[i] + (j - at[i]) of its slot i.
        pos = np.repeat(first_pos - at, counts) + np.arange(int(at[-1] + counts[-1]))
        pos %= self.window
        pos += np.repeat(slots * self.window, counts)
        return pos, at

    def truncate(self, slot: int, end_pos: int) -> None:
        """Forget rows at or after ``end_pos`` (the worker cuts a window that ends after the
        anchor the same way, 7.2 step 4)."""
        if self.end[slot] > end_pos:
            self.end[slot] = max(end_pos, 0)
            self.start[slot] = min(self.start[slot], self.end[slot])

    def gather(self, slot: int, anchor_pos: int, n: int, out: npt.NDArray[np.uint8]) -> None:
        """Copy the rows of positions ``[anchor_pos - n, anchor_pos)`` into ``out[:n]``."""
        start, end = self.start[slot], self.end[slot]
        first_pos = anchor_pos - n
        if n < 0 or first_pos < start or anchor_pos > end:
            raise ValueError(f"slot {slot}: rows [{first_pos}, {anchor_pos}) are not all held"
                             f" (held [{start}, {end}))")
        if n == 0:
            return
        W = self.window
        i0 = first_pos % W
        first = min(n, W - i0)
        ring = self.data[slot]
        out[:first] = ring[i0:i0 + first]
        if first < n:
            out[first:n] = ring[:n - first]

    def rows(self, slot: int, anchor_pos: int, n: int) -> npt.NDArray[np.uint8]:
        """A new array with the rows of ``[anchor_pos - n, anchor_pos)`` (tests, tools)."""
        out = np.empty((n, self.row_bytes), np.uint8)
        self.gather(slot, anchor_pos, n, out)
        return out
