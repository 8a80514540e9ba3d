"""One tensor-parallel rank of ``test_tensor_parallel_ranks_share_rank_0s_drafts``: SGLang's
process groups on the CPU (gloo, two ranks), the worker built and driven as on a rank of a
TP-2 engine, every step's drafts and confidences written to ``OUT``. Run as ``python
tp_rank.py RANK PORT ENDPOINT DRAFTER TARGET OUT``."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parents[1])]


def main() -> None:
    rank, port, endpoint, drafter, target_dir, out = int(sys.argv[1]), *sys.argv[2:7]
    import torchvision_stub

    torchvision_stub.install()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SGLang's import-time warnings (CPU fallbacks)
        import numpy as np
        from sglang.srt import runtime_context as rc
        from sglang.srt.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
            init_distributed_environment,
            initialize_model_parallel,
        )
        from sglang_engine import Engine, server_args, stand_in_target

        from dspark_sglang.worker import RemoteDSparkWorker

    os.environ["SGLANG_REMOTE_DSPARK_OPTIONS"] = json.dumps(
        {"endpoint": endpoint, "window": 16, "client_name": "tp-engine", "timeout_ms": 2000,
         "connect_timeout_ms": 10000})
    args = server_args(Path(drafter), Path(target_dir), "--tp-size", "2",
                       "--disable-overlap-schedule")
    rc.publish(args, role="scheduler", ranks=rc.SpawnRanks(world_rank=rank, gpu_id=None))
    init_distributed_environment(world_size=2, rank=rank, local_rank=rank, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel()
    target = stand_in_target(hidden=128)
    wk = RemoteDSparkWorker(args, rank, 0, target)
    eng = Engine(wk, target, Path(drafter))
    eng.prefill({"a": 11, "b": 6})
    steps = [eng.decode({"a": 2, "b": 0}), eng.decode({"a": 7, "b": 3}), eng.decode()]
    rounds = wk._proposer.rounds
    np.savez(out, drafts=np.stack([s.drafts for s in steps]),
             confidence=np.stack([s.confidence for s in steps]),
             commit=np.stack([s.commit_lens for s in steps]),
             driver=wk._proposer.is_driver, rounds=rounds.rounds if rounds is not None else 0)
    if rounds is not None:
        rounds.client.close()
    destroy_model_parallel()
    destroy_distributed_environment()


if __name__ == "__main__":
    main()
