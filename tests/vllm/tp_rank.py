"""One tensor-parallel rank of ``test_vllm_tensor_parallel``: vLLM's distributed setup on the
CPU (gloo), the remote speculator built and driven as on a rank of a TP-2 engine, every step's
drafts and confidences written to ``OUT``. Run as ``python tp_rank.py RANK PORT ENDPOINT
DRAFTER OUT``."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parents[1])]


def main() -> None:
    rank, port, endpoint, drafter, out = int(sys.argv[1]), sys.argv[2], *sys.argv[3:6]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vLLM's and torch's import-time deprecations
        import numpy as np
        from vllm.config import set_current_vllm_config
        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
            init_distributed_environment,
            initialize_model_parallel,
        )
        from vllm.plugins import load_general_plugins
        from vllm_engine import (
            CPU,
            Engine,
            model_config,
            speculative_config,
            target_folder,
            vllm_config,
        )

        from dspark_vllm.speculator import RemoteDSparkSpeculator

    load_general_plugins()
    target = model_config(target_folder(Path(out).parent / f"target{rank}"))
    spec = speculative_config(target, drafter, speculator_options={
        "endpoint": endpoint, "window": 16, "client_name": "tp-engine", "timeout_ms": 2000,
        "connect_timeout_ms": 10000})
    config = vllm_config(target, spec, max_num_seqs=4)
    # vLLM refuses adaptive verification without CUDA graphs; the speculator only reads it.
    spec.enable_adaptive_verification = True
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=2, rank=rank, local_rank=rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=2)
    speculator = RemoteDSparkSpeculator(config, CPU)
    eng = Engine(speculator, max_num_reqs=4, num_spec=7, window=16, seed=7)
    eng.admit("a", 11)
    eng.admit("b", 6)
    steps = [eng.step({"a": (11, 0), "b": (6, 0)}), eng.step({"a": (8, 2), "b": (8, 7)}),
             eng.step({"a": (5, 4), "b": (8, 0)})]
    np.savez(out, drafts=np.stack([s.drafts for s in steps]),
             confidence=np.stack([s.confidence for s in steps]),
             driver=speculator.is_driver, has_client=speculator.rounds is not None,
             adaptive=speculator.enable_adaptive_verification,
             rounds=speculator.rounds.rounds if speculator.rounds is not None else 0)
    # Leave as an engine shuts down: the process group's threads ended before the interpreter
    # (left running, gloo's teardown now and then aborts the process at exit).
    if speculator.rounds is not None:
        speculator.rounds.client.close()
    destroy_model_parallel()
    destroy_distributed_environment()


if __name__ == "__main__":
    main()
