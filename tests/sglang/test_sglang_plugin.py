"""The plugin as SGLang 0.5.23 finds and resolves it: its own plugin loader registers
``REMOTE_DSPARK``; ``ServerArgs`` resolves it with config-only folders and refuses bad values at
start by name; ``create_worker`` gives our worker; the README's launch line parses with SGLang's
own parser; and the hooks the plugin stands in for keep the shapes it was written against."""

from __future__ import annotations

import inspect
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from sglang_engine import server_args

ROOT = Path(__file__).resolve().parents[2]


def test_sglangs_loader_finds_and_registers_the_plugin(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    import sglang.srt.plugins as plugins
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from dspark_sglang.algo import RemoteDSparkAlgo

    monkeypatch.setenv("SGLANG_PLUGINS", "remote_dspark")  # the allow-list names it
    found = plugins.load_plugins_by_group(plugins.GENERAL_PLUGINS_GROUP)
    assert "remote_dspark" in found
    plugins.load_plugins()
    algo = SpeculativeAlgorithm.from_string("remote_dspark")
    assert isinstance(algo, RemoteDSparkAlgo) and algo.name == "REMOTE_DSPARK"
    found["remote_dspark"][0]()  # a second registration in one process is a no-op
    assert SpeculativeAlgorithm.from_string("REMOTE_DSPARK") is algo


def test_the_algorithm_answers_as_dspark_without_draft_kv() -> None:
    """Every question SGLang's enum answers (the registry's is_/supports_ set and the ones the
    scheduler calls beside them) has DSpark's answer, but the draft KV (none on the engine)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    load_plugins()
    ours, dspark = SpeculativeAlgorithm.from_string("REMOTE_DSPARK"), SpeculativeAlgorithm.DSPARK
    asked = {n for n in vars(SpeculativeAlgorithm)
             if n.startswith(("is_", "supports_"))} | {"need_topk", "carries_draft_hidden_states",
                                                    "has_draft_kv"}
    differ = {n for n in asked if getattr(ours, n)() != getattr(dspark, n)()}
    assert differ == {"has_draft_kv"}, differ
    assert ours.has_draft_kv() is False and ours.is_dspark() and ours.is_dflash_family()
    assert ours.get_num_tokens_per_req_for_target_verify(8, is_draft_worker=False) == 8


def test_server_args_resolve_with_config_only_folders(drafter_dirs: dict[str, Path],
                                                      target_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The drafter's folder holds config.json and the identity record, the target's a
    config.json: SGLang resolves DSpark's shape from the drafter (N = 7: a verify window of
    8), and the algorithm's worker class is ours."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from dspark_sglang.worker import RemoteDSparkWorker

    monkeypatch.setenv("SGLANG_REMOTE_DSPARK_OPTIONS", '{"endpoint": "tcp://127.0.0.1:9"}')
    args = server_args(drafter_dirs["host"], target_dir)
    view = resolving_view(args)
    assert (view.speculative_num_draft_tokens, view.speculative_num_steps,
            view.speculative_eagle_topk) == (8, 1, 1)
    algo = SpeculativeAlgorithm.from_string(view.speculative_algorithm)
    assert algo.create_worker(args) is RemoteDSparkWorker
    shorter = resolving_view(server_args(drafter_dirs["host"], target_dir,
                                         "--speculative-dspark-block-size", "4"))
    assert shorter.speculative_num_draft_tokens == 5


@pytest.mark.parametrize(("env", "extra", "names"), [
    ('{"timeout_ms": -1}', (), "SGLANG_REMOTE_DSPARK_OPTIONS.timeout_ms = -1"),
    ('{"auth_secret": "x"}', (), "SGLANG_REMOTE_DSPARK_OPTIONS: unknown option 'auth_secret'"),
    ("{endpoint: 1}", (), "SGLANG_REMOTE_DSPARK_OPTIONS = '{endpoint: 1}': not JSON"),
    (None, ("--speculative-dspark-block-size", "9"),
     "--speculative-dspark-block-size 9: the drafter drafts 7 tokens"),
])
def test_bad_values_are_refused_at_start_by_name(drafter_dirs: dict[str, Path],
                                                 target_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch, env: Any,
                                                 extra: tuple[str, ...], names: str) -> None:
    if env is None:
        monkeypatch.delenv("SGLANG_REMOTE_DSPARK_OPTIONS", raising=False)
    else:
        monkeypatch.setenv("SGLANG_REMOTE_DSPARK_OPTIONS", env)
    with pytest.raises(ValueError, match=re.escape(names)):
        server_args(drafter_dirs["host"], target_dir, *extra)


def test_a_drafter_folder_is_required(target_dir: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.delenv("SGLANG_REMOTE_DSPARK_OPTIONS", raising=False)
    args = prepare_server_args(["--model-path", str(target_dir), "--speculative-algorithm",
                                "REMOTE_DSPARK", "--device", "cpu"])
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        args.resolve_once()
    # (a folder without config.json: SGLang's own reading of it refuses it first)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path))):
        server_args(tmp_path, target_dir)


def test_the_docs_launch_line_parses_with_sglangs_own_parser() -> None:
    """docs/sglang.md's command: its options are ones the plugin takes, its arguments ones
    SGLang's parser takes, naming the algorithm and the drafter folder."""
    from sglang.srt.server_args import prepare_server_args

    from dspark_sglang.algo import options_from_env

    text = (ROOT / "docs" / "sglang.md").read_text()
    block = re.search(r"```bash\n(SGLANG_REMOTE_DSPARK_OPTIONS=.*?)```", text, re.S)
    assert block, "docs/sglang.md has no launch command"
    words = shlex.split(block.group(1).replace("\\\n", " "))
    env, _, rest = words[0].partition("=")
    assert env == "SGLANG_REMOTE_DSPARK_OPTIONS"
    opts = options_from_env({env: rest})
    assert opts.remote.endpoint.startswith("tcp://")
    assert words[1:4] == ["python", "-m", "sglang.launch_server"]
    args = prepare_server_args(words[4:])
    assert args.speculative_algorithm == "REMOTE_DSPARK"
    assert args.speculative_draft_model_path


def test_the_hooks_keep_the_shapes_the_plugin_was_written_against() -> None:
    """The pin: SGLang 0.5.23, and the calls DSparkWorkerV2 makes into what the plugin stands
    in for (proposer, KV injector, verify executor), with the parameters it implements. A new
    SGLang that changes one fails here, not in a serving engine."""
    import sglang
    from sglang.srt.speculative.dspark_components import dspark_worker_v2 as w
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockProposer
    from sglang.srt.speculative.dspark_components.dspark_kv_inject import (
        PrefillPlacement,
        TargetHiddenKvInjector,
    )
    from sglang.srt.speculative.dspark_components.dspark_verify import TargetVerifyExecutor

    from dspark_sglang.worker import RemoteDrafts, RemoteDSparkWorker, _RemoteVerifyExecutor

    assert sglang.__version__ == "0.5.23"
    assert "sglang==0.5.23" in (ROOT / ".ci" / "run").read_text()

    def params(f: Any) -> list[str]:
        return [p for p in inspect.signature(f).parameters if p != "self"]

    for theirs, ours in [(DraftBlockProposer.propose, RemoteDrafts.propose),
                         (TargetHiddenKvInjector.place_prefill, RemoteDrafts.place_prefill),
                         (TargetHiddenKvInjector.inject_prefill, RemoteDrafts.inject_prefill),
                         (TargetVerifyExecutor.commit_hidden,
                          _RemoteVerifyExecutor.commit_hidden),
                         (w.DSparkWorkerV2.__init__, RemoteDSparkWorker.__init__)]:
        assert params(theirs) == params(ours), theirs.__qualname__
    assert list(PrefillPlacement._fields) == ["cache_loc", "positions", "state_slot",
                                              "final_pos", "swa_loc"]
    src = inspect.getsource(w.DSparkWorkerV2)
    for call in ("self._kv_injector.place_prefill(batch)", "self._kv_injector.inject_prefill(",
                 "self._proposer.propose(", "self._verify_executor.commit_hidden(",
                 "self._verify_planner.resolve_verify_token_budget(",
                 "self._kv_injector.draft_model_runner.token_to_kv_pool"):
        assert call in src, call
    assert params(w.DSparkWorkerV2.__init__) == ["server_args", "gpu_id", "nccl_port",
                                                 "target_worker", "draft_worker_cls"]
