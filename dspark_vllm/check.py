"""``python -m dspark_vllm check``: before booting an engine, whether it will draft.

It takes the engine arguments of the ``vllm serve`` line it checks (the served model, positional
or ``--model``, and the same ``--speculative-config``; ``--max-num-seqs`` and
``--tensor-parallel-size`` where the line sets them) and runs what the engine runs up to its
first HELLO, on any machine (no GPU, no weights of the target, only its config):

1. vLLM's own argument parser and config classes (``EngineArgs``, ``ModelConfig``,
   ``SpeculativeConfig``), which run this plugin's checks of the drafter folder against the
   served model and of every ``speculator_options`` key;
2. the worker's W where ``window`` is unset (STATS, as rank 0 asks it);
3. the HELLO rank 0 would send (identities from the drafter folder, geometry, slots, limits),
   under a client name of its own (``vllm-check@<host>``: never the engine's, whose session it
   would replace), then GOODBYE.

It prints ``this engine will draft: ...`` and exits 0, or ``this engine will not draft: <the
reason>`` and exits 1 (2: the command line itself is wrong).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

from dspark_client.adapter.options import default_client_name, parse_options
from dspark_client.client import RemoteDraftClient

from . import METHOD, register
from .config import drafter_of, engine_hello

__all__ = ["main", "run_check"]


def _engine_args(argv: list[str]) -> Any:
    """vLLM's EngineArgs from a ``vllm serve`` line's arguments (the model may come first,
    as ``vllm serve`` takes it)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if not current_platform.device_type:
        # No accelerator here (vLLM finds no platform): the parser's defaults build a
        # DeviceConfig, which needs a device type; the check runs no model, so the CPU's.
        current_platform.device_type = "cpu"
    if argv and not argv[0].startswith("-"):
        argv = ["--model", *argv]
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(  # type: ignore[no-untyped-call]
        prog="python -m dspark_vllm check",
        description="Check that a vLLM engine with this speculative config will draft: the"
                    " arguments of its `vllm serve` line (model, --speculative-config, ...)."))
    args = parser.parse_args(argv)
    engine = EngineArgs.from_cli_args(args)
    engine.skip_tokenizer_init = True  # the check needs the model's config, not its tokenizer
    return engine


def _max_num_seqs(engine: Any) -> tuple[int, str]:
    """The engine's max_num_seqs: as given, else vLLM's default for ``vllm serve``."""
    if engine.max_num_seqs is not None:
        return int(engine.max_num_seqs), "--max-num-seqs"
    from vllm.config import SchedulerConfig
    from vllm.usage.usage_lib import UsageContext

    world = engine.pipeline_parallel_size * engine.tensor_parallel_size
    seqs = engine.get_batch_defaults(world)[1].get(UsageContext.OPENAI_API_SERVER,
                                                   SchedulerConfig.DEFAULT_MAX_NUM_SEQS)
    return int(seqs), "vLLM's default here; pass --max-num-seqs as the serve line does"


def run_check(argv: list[str], out: TextIO) -> int:
    """The check (module docstring); 0: the engine will draft, 1: it will not."""
    from vllm.config import ParallelConfig

    register()
    engine = _engine_args(argv)
    if not engine.speculative_config:
        print("this engine will not draft: no --speculative-config", file=out)
        return 1
    try:
        target = engine.create_model_config()
        parallel = ParallelConfig(tensor_parallel_size=engine.tensor_parallel_size,
                                  pipeline_parallel_size=engine.pipeline_parallel_size)
        spec = engine.create_speculative_config(target, parallel)
    except (ValueError, TypeError, OSError) as exc:  # vLLM's and the plugin's refusals
        print(f"this engine will not draft: {exc}", file=out)
        return 1
    if spec is None or spec.custom_method != METHOD:
        print(f"this engine will not draft with {METHOD}: its speculative method is"
              f" {getattr(spec, 'method', None)!r}", file=out)
        return 1
    opts = parse_options(spec.speculator_options)
    seqs, seqs_from = _max_num_seqs(engine)
    wait = opts.remote.connect_timeout_ms / 1000.0
    name = default_client_name("check")
    start = time.monotonic()
    try:
        hello, terms_from = engine_hello(spec, opts, max_num_seqs=seqs, client_name=name,
                                         timeout=wait)
    except ValueError as exc:
        print(f"this engine will not draft: {exc}", file=out)
        return 1
    client = RemoteDraftClient(opts.remote, hello, background=False)
    try:
        # as rank 0 does: connect attempts until the connect timeout is spent
        while not client.connect_now() and not client.disabled and \
                time.monotonic() - start < wait:
            time.sleep(min(0.05, opts.remote.backoff_ms / 1000.0))
        if not client.ready:
            print(f"this engine will not draft: {client.last_error}", file=out)
            return 1
        rep = client.worker_info
        assert rep is not None
        confidence = ("" if client.has_confidence else "; its drafter has no confidence head:"
                      " adaptive verification off, every step verifies"
                      f" {spec.num_speculative_tokens} drafts")
        print(f"this engine will draft: N {hello.num_spec} (verifying up to"
              f" {spec.num_speculative_tokens}), W {hello.window}, drafter"
              f" {drafter_of(spec)} ({rep.drafter_identity.hex()[:16]}..), worker"
              f" {rep.worker_name!r} at {client.endpoint}; {hello.max_slots} slots"
              f" (max_num_seqs {seqs}: {seqs_from}); W and limits {terms_from}{confidence}",
              file=out)
        return 0
    finally:
        client.close()  # GOODBYE: the check's session and its slots go at once


USAGE = """usage: python -m dspark_vllm check MODEL --speculative-config JSON [vllm serve options]

Whether a vLLM engine started with these arguments (those of its `vllm serve` line) will draft
with remote_dspark: prints "this engine will draft: ..." and exits 0, or "this engine will not
draft: <reason>" and exits 1. `check --help` lists every option vLLM takes."""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != "check":
        print(USAGE, file=sys.stderr)
        return 0 if args[:1] in (["-h"], ["--help"]) else 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run_check(args[1:], sys.stdout)
