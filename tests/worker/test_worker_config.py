"""Configuration: TOML file, command-line overrides, messages naming field and value, --help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dspark_worker import cli
from dspark_worker.config import (
    DEFAULT_LISTEN,
    DEFAULT_WINDOW,
    ConfigError,
    WorkerConfig,
    build_config,
    frame_limit,
)


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "worker.toml"
    p.write_text(text)
    return str(p)


def test_defaults() -> None:
    c = WorkerConfig()
    assert c.listen == DEFAULT_LISTEN and c.window == DEFAULT_WINDOW and c.device == "auto"
    assert c.metrics_listen == "127.0.0.1:7601" and c.session_idle_s == 600.0
    assert c.resolved_worker_name.startswith("dspark@")
    assert frame_limit(c, 768) == 32 + 48 * c.max_slots + c.max_rows_per_step * 768


def test_file_then_command_line(tmp_path: Path) -> None:
    path = write(tmp_path, 'window = 48\nmax_slots = 8\nworker_name = "from-file"\n'
                           'listen = "none"\nunix = "/tmp/x.sock"\nsession_idle_s = 30\n'
                           'warmup = false\n')
    c = cli.parse_config(["--config", path, "--worker-name", "from-cli", "--max-slots", "4"])
    assert (c.window, c.max_slots, c.worker_name) == (48, 4, "from-cli")
    assert c.listen is None and c.unix == "/tmp/x.sock" and c.session_idle_s == 30.0
    assert c.warmup is False
    assert cli.parse_config(["--config", path, "--warmup"]).warmup is True


def test_every_field_settable_from_file(tmp_path: Path) -> None:
    text = "\n".join([
        'checkpoint = "/ckpt"', 'target_checkpoint = "/target"', 'device = "cpu"',
        'dtype = "float32"', "threads = 2", "window = 64", "max_slots = 32",
        "max_rows_per_step = 128",
        "max_sessions = 4", "max_sessions_per_peer = 2", "max_total_slots = 64",
        "max_slots_per_connection = 16", "max_slots_per_peer = 48", "reservation_idle_s = 3",
        "peer_prefix_v4 = 24", "peer_prefix_v6 = 56", "loopback_one_peer = false",
        "max_connections = 8",
        "max_frame_bytes = 1000000", "max_shm_region_bytes = 0", "max_shm_mapped_bytes = 0",
        "session_idle_s = 10.5",
        "partial_frame_timeout_s = 2", "handshake_timeout_s = 4", "connection_idle_s = 7",
        "shed_queue_steps = 3", "shutdown_timeout_s = 5", "drain_s = 2.5",
        'listen = "0.0.0.0:9000"', 'unix = "/run/d.sock"', 'metrics_listen = "[::1]:9001"',
        'worker_name = "w1"', 'auth_secret_file = "/s"', 'port_file = "/p"',
        'log_level = "debug"', "warmup = false", 'cuda_graphs = "off"',
        "dspark_draft_topk = 1024", "max_versions = 4", 'canary_checkpoint = "/canary"',
        "canary_fraction = 0.5"])
    c = build_config(write(tmp_path, text))
    given = {line.split(" = ")[0] for line in text.splitlines()}
    assert given == set(WorkerConfig.__struct_fields__)  # the file names every field
    assert c.max_frame_bytes == 1_000_000 and c.metrics_listen == "[::1]:9001"
    assert c.drain_s == 2.5
    assert (c.peer_prefix_v4, c.peer_prefix_v6, c.loopback_one_peer) == (24, 56, False)
    assert c.max_shm_region_bytes == 0 and c.sessions_per_peer == 2
    assert (c.slots_per_connection, c.slots_per_peer, c.reservation_idle_s) == (16, 48, 3.0)
    assert c.cuda_graphs == "off" and c.dspark_draft_topk == 1024
    assert c.max_versions == 4 and c.canary_checkpoint == "/canary" and c.canary_fraction == 0.5


@pytest.mark.parametrize(("text", "field", "value"), [
    ("window = 0", "window", 0),
    ("window = 70000", "window", 70000),
    ('window = "big"', "window", "big"),
    ('window = "1024"', "window", "1024"),  # a number in quotes is a string, not the number
    ('session_idle_s = "30"', "session_idle_s", "30"),
    ("warmup = 1", "warmup", 1),
    ("max_slots = -1", "max_slots", -1),
    ("max_versions = 1", "max_versions", 1),
    ("peer_prefix_v4 = 33", "peer_prefix_v4", 33),
    ("peer_prefix_v6 = 0", "peer_prefix_v6", 0),
    ("canary_fraction = 0", "canary_fraction", 0),
    ("canary_fraction = 1.5", "canary_fraction", 1.5),
    ('device = "tpu"', "device", "tpu"),
    ('listen = "localhost"', "listen", "localhost"),
    ('listen = "host:99999"', "listen", "host:99999"),
    ("session_idle_s = 0", "session_idle_s", 0),
    ("drain_s = -1", "drain_s", -1),
    ('log_level = "loud"', "log_level", "loud"),
    ("max_frame_bytes = 10", "max_frame_bytes", 10),
    ("max_shm_region_bytes = -1", "max_shm_region_bytes", -1),
    ('worker_name = "' + "x" * 33 + '"', "worker_name", "x" * 33),
    ("max_slot = 4", "max_slot", 4),  # a typo: unknown field
    # Both listeners on one port: refused before anything loads.
    ('listen = "127.0.0.1:7611"\nmetrics_listen = "127.0.0.1:7611"', "metrics_listen",
     "127.0.0.1:7611"),
    ('listen = "0.0.0.0:7611"\nmetrics_listen = "127.0.0.1:7611"', "metrics_listen",
     "127.0.0.1:7611"),
])
def test_bad_values_name_field_and_value(tmp_path: Path, text: str, field: str,
                                         value: object) -> None:
    with pytest.raises(ConfigError) as e:
        build_config(write(tmp_path, text))
    assert e.value.field == field and e.value.value == value
    assert field in str(e.value) and repr(value) in str(e.value)


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        build_config(write(tmp_path, "window = = 3"))
    with pytest.raises(ConfigError, match="No such file"):
        build_config(str(tmp_path / "absent.toml"))


def test_bad_flag_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.parse_config(["--window", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "window: 0 is not a positive integer" in err


def test_help_lists_every_option() -> None:
    text = cli.build_parser().format_help()
    flags = {"--" + f.replace("_", "-") for f in WorkerConfig.__struct_fields__}
    assert {row[0] for row in cli.OPTIONS} == set(WorkerConfig.__struct_fields__)
    for flag in flags | {"--config", "--help"}:
        assert flag in text, flag


def test_module_and_console_script_are_one_program() -> None:
    out = subprocess.run([sys.executable, "-m", "dspark_worker", "--help"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.startswith("usage: dspark-worker") and "--max-total-slots" in out


def test_threads_flag_and_key(tmp_path: Path) -> None:
    from dspark_worker.app import set_threads
    from dspark_worker.config import DEFAULT_THREADS

    assert DEFAULT_THREADS == 1 and cli.parse_config([]).threads == 1
    assert cli.parse_config(["--threads", "3"]).threads == 3
    toml = tmp_path / "w.toml"
    toml.write_text("threads = 0\n")
    assert cli.parse_config(["--config", str(toml)]).threads == 0
    with pytest.raises(ConfigError, match="threads: -1 is not a non-negative integer"):
        WorkerConfig(threads=-1)
    import torch

    before = torch.get_num_threads()
    try:
        assert set_threads(2) == 2 == torch.get_num_threads()
        assert set_threads(0) == 2  # 0 keeps what is in force
    finally:
        torch.set_num_threads(before)


def test_cuda_without_a_gpu_fails_in_one_line() -> None:
    import torch

    from dspark_worker.app import StartupError, check_device

    check_device("cpu")
    if torch.cuda.is_available():  # a GPU host: nothing to refuse
        check_device("cuda")
        return
    with pytest.raises(StartupError) as info:
        check_device("cuda:0")
    msg = str(info.value)
    assert "\n" not in msg and "use --device cpu" in msg and "--device cuda:0" in msg


def test_a_bad_value_names_where_it_came_from(tmp_path: Path) -> None:
    """A value from the file is blamed on the file, one from a flag on the flag, in words."""
    path = write(tmp_path, 'window = "big"\nmax_slots = 8')
    with pytest.raises(ConfigError) as e:
        build_config(path, {"max_slots": 16})
    text = str(e.value)
    assert text.startswith(f"config file {path!r}: window: 'big' is not an integer")
    assert "command line" not in text and "Expected" not in text
    with pytest.raises(ConfigError) as e:
        build_config(write(tmp_path, "max_slots = 8"), {"window": 0})
    assert str(e.value).startswith("--window: 0 is not a positive integer")  # named once


def test_a_dtype_is_taken_in_its_other_spellings() -> None:
    """``bf16``, ``fp16``, ``fp32`` (as torch and vLLM users write them) are the dtypes'
    names here; anything else is refused with the flag named once."""
    assert build_config(None, {"dtype": "bf16"}).dtype == "bfloat16"
    assert build_config(None, {"dtype": "FP16"}).dtype == "float16"
    assert build_config(None, {"dtype": "fp32"}).dtype == "float32"
    with pytest.raises(ConfigError) as e:
        build_config(None, {"dtype": "bf17"})
    assert str(e.value) == "--dtype: 'bf17' is not one of auto, float32, bfloat16, float16"
