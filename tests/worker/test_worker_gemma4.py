"""The Gemma4 drafter behind the in-process worker: two sessions' STEPs queued together run as
one device batch and draft exactly what each drafts alone (runner.py; contract 7.2 step 6),
and DeepSpec's vectors come back over the socket."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from worker_harness import check_vectors_and_batching, thread_worker

DATA = Path(__file__).resolve().parent / "drafter" / "data" / "gemma4_tiny"


@pytest.fixture(scope="module")
def gemma4() -> Any:
    from dspark_worker.drafter import load_drafter

    return load_drafter(DATA)


def test_sessions_batched_and_the_vectors_over_the_socket(gemma4: Any) -> None:
    from dspark_worker.drafter import encode_bf16_rows

    d = gemma4
    cases = json.loads((DATA / "cases.json").read_text())
    with thread_worker(d) as w:
        # session a: DeepSpec's two cases in slots 0 and 1 (9 rows each)
        rows = np.concatenate([encode_bf16_rows(np.asarray(k["taps"], np.float32))
                               for k in cases])
        check_vectors_and_batching(w, d, [{**k, "n_rows": 9} for k in cases], rows)
