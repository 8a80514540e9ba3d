"""Rank 0's table of an engine's requests and the worker's slots, shared by every engine
adapter: which engine row (vLLM's request-state index, SGLang's ``req_pool_indices`` entry)
holds which slot, the slot's generation, the request id naming it once a batch showed it, and
the slots to release in the next round (contract 7.1: a released slot's rows are gone; a new
generation starts it afresh). Imports no engine and no torch."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Final

import numpy as np

__all__ = ["NO_SLOT", "SlotTable"]

NO_SLOT: Final = -1

log = logging.getLogger("dspark_client.adapter")


class SlotTable:
    """Slots ``[0, max_slots)`` handed to engine rows ``[0, max_rows)``.

    ``add(row)`` gives the row a fresh slot (a new generation of it); ``drop(slot)`` frees one
    and queues its release; ``name`` ties slots to the request ids a batch shows, so that
    ``finished(ids)`` can free them by id; ``take_release()`` hands the queued releases to the
    next round."""

    def __init__(self, max_rows: int, max_slots: int, *, engine: str = "the engine") -> None:
        self.of_index = np.full(max_rows, NO_SLOT, np.int64)
        self.index_of = np.full(max_slots, NO_SLOT, np.int64)
        self.generation = np.zeros(max_slots, np.int64)
        self.named = np.zeros(max_slots, bool)
        self.owner: list[str | None] = [None] * max_slots
        self.of_request: dict[str, int] = {}
        self.free = list(range(max_slots - 1, -1, -1))  # pop() takes slot 0 first
        self.release: list[int] = []
        self.refused = 0  # requests that found every slot taken (no drafts for them)
        self._engine = engine

    def add(self, row: int) -> None:
        old = int(self.of_index[row])
        if old != NO_SLOT:  # its request left without finishing (preempted, aborted)
            self.drop(old)
        if not self.free:
            self.refused += 1
            if self.refused == 1:
                log.warning("remote DSpark: every one of the %d slots is taken (max_slots);"
                            " %s serves requests beyond them without drafts",
                            len(self.index_of), self._engine)
            return
        slot = self.free.pop()
        self.of_index[row] = slot
        self.index_of[slot] = row
        self.generation[slot] += 1
        self.named[slot] = False

    def drop(self, slot: int) -> None:
        owner = self.owner[slot]
        if owner is not None and self.of_request.get(owner) == slot:
            del self.of_request[owner]
        self.owner[slot] = None
        self.named[slot] = True  # nothing to name until it is taken again
        index = int(self.index_of[slot])
        if index != NO_SLOT and self.of_index[index] == slot:
            self.of_index[index] = NO_SLOT
        self.index_of[slot] = NO_SLOT
        self.release.append(slot)
        self.free.append(slot)

    def name(self, slots: np.ndarray, req_ids: Sequence[str]) -> None:
        """The batch's requests name the slots taken since the last batch; a request already
        naming another slot came back under a new row, and its old slot is dropped."""
        have = slots != NO_SLOT
        fresh = np.flatnonzero(have & ~self.named[np.where(have, slots, 0)])
        for i in fresh.tolist():
            slot, req_id = int(slots[i]), req_ids[i]
            old = self.of_request.get(req_id)
            if old is not None and old != slot:
                self.drop(old)
            self.owner[slot] = req_id
            self.of_request[req_id] = slot
            self.named[slot] = True

    def finished(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            slot = self.of_request.get(req_id)
            if slot is not None:
                self.drop(slot)

    def take_release(self) -> list[int]:
        """The slots dropped since the last call, for the next round's ``release``."""
        release, self.release = self.release, []
        return release
