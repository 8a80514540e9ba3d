"""The plugin as vLLM 0.34 sees it: its plugin loader registers ``remote_dspark``, its
``SpeculativeConfig`` takes the method with ``speculator_options`` and refuses what it cannot
run, each refusal naming the value; the engine host needs only the drafter's config.json and
the worker's dspark_identity.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from vllm_engine import CPU, LAYERS, model_config, speculative_config, target_folder, vllm_config

from tests.support.worker_proc import worker_stats


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return model_config(target_folder(tmp_path_factory.mktemp("target")))


def test_vllms_plugin_loader_registers_remote_dspark(monkeypatch: pytest.MonkeyPatch) -> None:
    """From a registry without it, vLLM's own loader finds the entry point and registers the
    method; the config vLLM resolves is a DSpark config whose speculator class is a
    BaseSpeculator, as ``init_speculator`` requires."""
    import vllm.plugins
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.gpu.spec_decode import speculator_config as sc
    from vllm.v1.worker.gpu.spec_decode.dspark.config import DSparkSpeculatorConfig
    from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

    monkeypatch.setattr(sc, "_CUSTOM_CONFIGS", {})
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    assert "remote_dspark" not in sc.registered_speculative_methods()
    vllm.plugins.load_general_plugins()
    assert "remote_dspark" in sc.registered_speculative_methods()
    config_cls = sc.get_custom_speculator_config_class("remote_dspark")
    assert config_cls is not None and issubclass(config_cls, DSparkSpeculatorConfig)
    assert not config_cls.adaptive_verification_uses_draft_logits  # confidences rank drafts
    assert config_cls.speculator_class is not None
    assert issubclass(resolve_obj_by_qualname(config_cls.speculator_class), BaseSpeculator)
    # Loaded again (vLLM may): the same registration, no error.
    import logging

    import dspark_vllm

    dspark_vllm.register()
    # Our lines go through the handlers vLLM's logger has when they are logged (vLLM
    # configures its logging after plugins load, and again in each process), once each.
    seen: list[logging.LogRecord] = []

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    vllm_log = logging.getLogger("vllm")
    handler = Seen(logging.INFO)
    vllm_log.addHandler(handler)
    try:
        logging.getLogger("dspark_client").info("through vLLM's handler")
        logging.getLogger("dspark_vllm").debug("below vLLM's level")
    finally:
        vllm_log.removeHandler(handler)
    assert [r.getMessage() for r in seen] == ["through vLLM's handler"]


def test_speculative_config_takes_the_method_and_its_options(
        target: Any, drafter_dirs: dict[str, Path], worker: Any) -> None:
    """The drafter's block, taps (as vLLM's aux layers) and no draft KV: what vLLM sets up."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config,
    )

    from dspark_vllm.config import RemoteDSparkSpeculatorConfig

    spec = speculative_config(target, drafter_dirs["host"], dspark_draft_topk=None,
                              speculator_options={"endpoint": worker.endpoint, "window": 16,
                                                  "timeout_ms": 40, "jitter": 0.1,
                                                  "client_name": "vllm-test"})
    assert spec.custom_method == "remote_dspark" and spec.method == "dspark"
    assert isinstance(spec.speculator_config, RemoteDSparkSpeculatorConfig)
    assert spec.num_speculative_tokens == 7  # the drafter's block_size
    assert spec.uses_aux_hidden_states
    assert get_eagle3_aux_layers_from_config(spec) == (1, 2, 3)  # taps 0, 1, 2
    config = vllm_config(target, spec, max_num_seqs=4)
    assert config.num_lookahead_tokens == 0  # no draft KV written on the engine
    assert spec.speculator_config.max_num_draft_seqs(512) is None
    fewer = speculative_config(target, drafter_dirs["host"], num_speculative_tokens=4,
                               speculator_options={"endpoint": worker.endpoint})
    assert fewer.num_speculative_tokens == 4


@pytest.mark.parametrize(("options", "message"), [
    ({"bogus": 1}, "speculator_options: unknown option 'bogus'"),
    ({"auth_secret": "hunter2"}, "give the secret in a file: auth_secret_file"),
    ({"timeout_ms": -1}, "speculator_options.timeout_ms = -1.0: must be a finite number"),
    ({"timeout_ms": "fast"}, "timeout_ms = 'fast': must be a number (got str)"),
    ({"timeout_ms": "50"}, "timeout_ms = '50': must be a number (got str)"),
    ({"follow_drafter": 1}, "follow_drafter = 1: must be true or false (got int)"),
    ({"endpoints": "tcp://a:1"}, "endpoints = 'tcp://a:1': must be a list of endpoint"),
    ({"window": "1024"}, "window = '1024': must be an integer (got str)"),
    ({"endpiont": "tcp://a:1"}, "unknown option 'endpiont' (did you mean 'endpoint'?)"),
    ({"timeout_ms": 1e12}, "timeout_ms = 1000000000000.0: must be at most 10000"),
    ({"connect_timeout_ms": 1e9}, "connect_timeout_ms = 1000000000.0: must be at most 60000"),
    ({"max_rows_per_step": 2 ** 40}, "max_rows_per_step = 1099511627776: must be in"
                                     " [1, 1048576]"),
    ({"endpoint": f"tcp://{'a' * 64}.example:1"}, "label 'aaaa"),
    ({"endpoint": "http://x:1"}, "speculator_options.endpoint = 'http://x:1'"),
    ({"window": 0}, "speculator_options.window = 0: must be in [1, 65535]"),
    ({"window": 64, "max_rows_per_step": 32}, "max_rows_per_step = 32: must be at least"),
    ({"client_name": "x" * 33}, "client_name = 'xxx"),
    ({"client_name": "eng\x00a"}, "client_name = 'eng\\x00a': holds a NUL byte"),
    ({"max_slots": True}, "max_slots = True: must be an integer"),
])
def test_speculator_options_are_refused_by_name(target: Any, drafter_dirs: dict[str, Path],
                                                options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="speculator_options") as err:
        speculative_config(target, drafter_dirs["host"], speculator_options=options)
    assert message in str(err.value)


def test_vllms_own_refusals(target: Any, drafter_dirs: dict[str, Path]) -> None:
    """Options the method does not take are refused with vLLM's own message; what the
    drafter cannot do for this target with ours, naming both sides."""
    with pytest.raises(ValueError, match="draft_lm_head_quantization is not supported with"
                                         " speculative method 'remote_dspark'"):
        speculative_config(target, drafter_dirs["host"], draft_lm_head_quantization="fp8")
    with pytest.raises(ValueError, match="more than the drafter's block of 7"):
        speculative_config(target, drafter_dirs["host"], num_speculative_tokens=8)
    with pytest.raises(ValueError, match="drafts greedily"):
        speculative_config(target, drafter_dirs["host"], draft_sample_method="probabilistic")
    with pytest.raises(ValueError, match="needs model: the drafter's folder"):
        speculative_config(target, None)


def test_a_drafter_for_another_target_is_refused(tmp_path: Path,
                                                 drafter_dirs: dict[str, Path]) -> None:
    wide = model_config(target_folder(tmp_path / "wide", hidden=256))
    with pytest.raises(ValueError, match="hidden size 128; the served model's is 256"):
        speculative_config(wide, drafter_dirs["host"])
    other_vocab = model_config(target_folder(tmp_path / "vocab", vocab=300))
    with pytest.raises(ValueError, match="vocabulary is 260 tokens, the served model's 300"):
        speculative_config(other_vocab, drafter_dirs["host"])
    deep = tmp_path / "deep"
    shutil.copytree(drafter_dirs["host"], deep)
    cfg = json.loads((deep / "config.json").read_text())
    cfg["target_layer_ids"] = [0, 1, LAYERS]
    (deep / "config.json").write_text(json.dumps(cfg))
    target = model_config(target_folder(tmp_path / "t"))
    with pytest.raises(ValueError, match=r"tap layers \[0, 1, 4\] must be distinct and in"
                                         r" \[-1, 4\)"):
        speculative_config(target, deep)


def test_a_drafter_folder_without_identities_is_refused(target: Any, tmp_path: Path,
                                                        drafter_dirs: dict[str, Path]) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(drafter_dirs["host"] / "config.json", bare / "config.json")
    with pytest.raises(ValueError, match=r"neither the drafter's weights .* nor the"
                                         r" dspark_identity\.json"):
        speculative_config(target, bare)
    (bare / "dspark_identity.json").write_text('{"format": 1, "drafter_identity": "00"}')
    with pytest.raises(ValueError, match="not an identity record the worker wrote"):
        speculative_config(target, bare)
    with pytest.raises(ValueError, match=r"no config\.json"):
        speculative_config(target, tmp_path)


def test_config_json_and_the_identity_file_are_all_the_engine_host_needs(
        target: Any, drafter_dirs: dict[str, Path], worker: Any) -> None:
    """The ``host`` folder holds only config.json and the dspark_identity.json the worker
    wrote: the speculator's HELLO from it is accepted (identities, geometry, limits)."""
    from dspark_vllm.speculator import RemoteDSparkSpeculator

    assert sorted(p.name for p in drafter_dirs["host"].iterdir()) == [
        "config.json", "dspark_identity.json"]
    spec = speculative_config(target, drafter_dirs["host"], speculator_options={
        "endpoint": worker.endpoint, "window": 16, "client_name": "host-files",
        "max_slots": 3})
    speculator = RemoteDSparkSpeculator(vllm_config(target, spec, max_num_seqs=5), CPU)
    client = speculator.rounds.client
    assert client.ready, client.last_error
    assert client.hello.max_slots == 3 and client.hello.client_name == "host-files"
    assert any(s["max_slots"] == 3 for s in worker_stats(worker)["sessions"])
    client.close()


def test_the_readmes_vllm_serve_line_parses_with_vllms_own_arguments(
        target: Any, drafter_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's one line, through ``vllm serve``'s argument parser, gives a speculative
    config this plugin takes (its drafter folder is the test's: the README's is a placeholder).
    The parser's defaults include a DeviceConfig, which needs a device type: no vLLM platform
    is detected on a machine without an accelerator, so the test names the CPU's."""
    import re
    import shlex

    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setattr(current_platform, "device_type", "cpu")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## With vLLM"):]
    line = re.search(r"^vllm serve (.*)$", section, flags=re.M)
    assert line is not None
    argv = shlex.split(line.group(1))
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--model", *argv])
    raw = dict(args.speculative_config)
    assert raw["method"] == "remote_dspark" and raw["enable_adaptive_verification"] is True
    assert raw.pop("model")  # the README's placeholder folder
    spec = speculative_config(target, drafter_dirs["host"],
                              **{k: v for k, v in raw.items() if k != "method"})
    assert spec.custom_method == "remote_dspark"
    assert spec.speculator_options == raw["speculator_options"]


def test_following_the_workers_drafter_needs_config_json_alone(
        target: Any, tmp_path: Path, drafter_dirs: dict[str, Path], worker: Any) -> None:
    """With ``follow_drafter`` the HELLO names no identities (contract 6.5): config.json alone
    gives the geometry, and the worker takes the session."""
    from dspark_vllm.speculator import RemoteDSparkSpeculator

    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(drafter_dirs["host"] / "config.json", bare / "config.json")
    spec = speculative_config(target, bare, speculator_options={
        "endpoint": worker.endpoint, "window": 16, "follow_drafter": True,
        "client_name": "follower"})
    speculator = RemoteDSparkSpeculator(vllm_config(target, spec, max_num_seqs=2), CPU)
    client = speculator.rounds.client
    assert client.ready, client.last_error
    assert client.follows
    client.close()


def test_the_weights_are_hashed_once_and_not_when_following(
        target: Any, tmp_path: Path, drafter_dirs: dict[str, Path], worker: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A drafter folder with weights but no dspark_identity.json: the config check reads its
    geometry without hashing them, the speculator's HELLO hashes them once (and the worker
    takes it); following the worker's drafter hashes nothing."""
    import protocol.identity
    from dspark_vllm.speculator import RemoteDSparkSpeculator

    weights = tmp_path / "weights"
    shutil.copytree(drafter_dirs["full"], weights)
    (weights / "dspark_identity.json").unlink()
    hashed: list[int] = []
    real = protocol.identity.identities_from_refs

    def counted(refs: Any, config: Any = None) -> Any:
        hashed.append(1)
        return real(refs, config)

    monkeypatch.setattr(protocol.identity, "identities_from_refs", counted)
    options = {"endpoint": worker.endpoint, "window": 16, "client_name": "hash-once"}
    spec = speculative_config(target, weights, speculator_options=options)
    assert hashed == []
    speculator = RemoteDSparkSpeculator(vllm_config(target, spec, max_num_seqs=2), CPU)
    client = speculator.rounds.client
    assert hashed == [1]
    assert client.ready, client.last_error
    client.close()
    spec = speculative_config(target, weights, speculator_options={
        **options, "follow_drafter": True, "client_name": "hash-none"})
    speculator = RemoteDSparkSpeculator(vllm_config(target, spec, max_num_seqs=2), CPU)
    assert speculator.rounds.client.ready, speculator.rounds.client.last_error
    assert hashed == [1]
    speculator.rounds.client.close()
