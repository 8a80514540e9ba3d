"""The deployment artifacts agree with the worker they deploy (deploy/, Dockerfile, docs).

Static checks read the files and compare them with the worker's own code: its argument parser
(every flag a manifest or unit passes), its config loader (the example TOML), its default ports
and routes, pyproject's console scripts. The live check starts one real worker
(tests.support.worker_proc), drives HELLOs, STEPs, refusals and broken streams at it, scrapes
/metrics over HTTP, and requires every metric name and label value used by the dashboard and
the alert rules to be in that scrape. Where promtool is installed, the alert rules' own unit
tests (deploy/prometheus/alerts_test.yml) and a syntax check of every dashboard query run too.

    python -m tests.deploy.test_deploy --write-prometheusrule   # regenerate the PrometheusRule
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import msgspec.toml
import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from dspark_worker import cli
from dspark_worker.acceptance import MIN_RECENT_BLOCKS
from dspark_worker.config import (
    DEFAULT_LISTEN,
    DEFAULT_METRICS_LISTEN,
    WorkerConfig,
    build_config,
    parse_host_port,
)
from dspark_worker.metrics import STAGES
from dspark_worker.sessions import DropReason
from protocol.auth import sign_hello
from protocol.constants import (
    FRAME_STATUS_NAMES,
    OP_HELLO,
    OP_NAMES,
    OP_PING,
    OP_RESET,
    OP_STATS,
    OP_STEP,
    REQ_STATUS_NAMES,
    RF_NEED_DRAFT,
    RF_RELEASE,
    SAMPLE_GREEDY,
    ST_AUTH,
    ST_BAD_FRAME,
    ST_GEOMETRY,
    ST_IDENTITY,
    ST_LIMITS,
    ST_OK,
)
from protocol.framing import FrameDecoder, frame
from protocol.header import AppHeader
from protocol.messages import Hello, ReqEntry, StepReply, pack_reset, pack_step

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
PROM = DEPLOY / "prometheus"
SYSTEMD = DEPLOY / "systemd"
DASHBOARD = DEPLOY / "grafana" / "dspark.json"
OPERATIONS = ROOT / "docs" / "operations.md"
PROMETHEUSRULE = K8S / "monitoring" / "prometheusrule.yaml"

DRAFT_PORT = parse_host_port(DEFAULT_LISTEN)[1]
METRICS_PORT = parse_host_port(DEFAULT_METRICS_LISTEN)[1]
JOB = "dspark-worker"  # the job label the rules and the dashboard select
SEVERITIES = {"critical", "warning", "info"}
# An init process may stand in front of the console script in an ENTRYPOINT.
INIT_WRAPPERS = {"tini", "/usr/bin/tini", "/sbin/tini", "dumb-init", "/usr/bin/dumb-init"}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def yaml_files() -> list[Path]:
    return sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])


def load_all(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def parse_flags(argv: list[str], where: str) -> argparse.Namespace:
    """argv through the worker's own parser; an unknown flag or a bad value fails the test."""
    parser = cli.build_parser()
    try:
        return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: the worker's parser refuses {argv}")


def config_from_flags(argv: list[str], where: str) -> WorkerConfig:
    """argv as the worker would run it (flags validated by WorkerConfig; no file read)."""
    args = parse_flags(argv, where)
    overrides = {f: getattr(args, f) for f in WorkerConfig.__struct_fields__}
    return build_config(None, overrides)


def console_scripts() -> dict[str, str]:
    data = msgspec.toml.decode((ROOT / "pyproject.toml").read_bytes())
    return dict(data["project"]["scripts"])


# -- every file parses ----------------------------------------------------------------------------
@pytest.mark.parametrize("path", yaml_files(), ids=rel)
def test_yaml_parses(path: Path) -> None:
    docs = load_all(path)
    assert docs, f"{rel(path)} holds no YAML document"
    for doc in docs:
        assert isinstance(doc, dict), f"{rel(path)}: a document is not a mapping"


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.json")), ids=rel)
def test_json_parses(path: Path) -> None:
    assert isinstance(json.loads(path.read_text()), dict)


# -- Dockerfile -----------------------------------------------------------------------------------
def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        word, _, rest = whole.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def instructions(name: str) -> list[str]:
    return [args for word, args in dockerfile() if word == name]


def entrypoint() -> list[str]:
    (text,) = instructions("ENTRYPOINT")
    argv = json.loads(text)  # exec form: signals reach the worker, no shell in between
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    return argv


def test_docker_checkpoints_are_a_volume() -> None:
    volumes = [json.loads(args) if args.startswith("[") else args.split()
               for args in instructions("VOLUME")]
    assert ["/checkpoints"] in volumes


def test_docker_base_image_is_pinned() -> None:
    for args in instructions("FROM"):
        image = next(w for w in args.split() if not w.startswith("--"))
        if "@sha256:" in image:
            continue
        name, _, tag = image.rpartition(":")
        assert name and "/" not in tag, f"FROM {image}: no explicit tag"
        assert tag != "latest", f"FROM {image}: pin a version, not latest"


def test_docker_runs_as_non_root() -> None:
    users = instructions("USER")
    assert users, "the Dockerfile has no USER: the worker would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"USER {users[-1]} is root"


def test_docker_entrypoint_is_the_console_script_with_real_flags() -> None:
    argv = entrypoint()
    if argv[0] in INIT_WRAPPERS:
        assert "--" in argv, f"ENTRYPOINT {argv}: end the init's own options with --"
        argv = argv[argv.index("--") + 1:]
    scripts = console_scripts()
    assert argv[0] in scripts, f"ENTRYPOINT runs {argv[0]!r}, not one of {sorted(scripts)}"
    assert scripts[argv[0]] == "dspark_worker.cli:main"
    config = config_from_flags(argv[1:], "Dockerfile ENTRYPOINT")
    assert config.listen is not None and config.metrics_listen is not None
    # In a container the worker must listen beyond loopback, on the ports it EXPOSEs.
    assert parse_host_port(config.listen) == ("0.0.0.0", DRAFT_PORT)
    assert parse_host_port(config.metrics_listen) == ("0.0.0.0", METRICS_PORT)


def test_docker_exposes_the_default_ports() -> None:
    ports = {int(p.split("/")[0]) for args in instructions("EXPOSE") for p in args.split()}
    assert ports == {DRAFT_PORT, METRICS_PORT}


def healthcheck_argv() -> list[str]:
    (check,) = instructions("HEALTHCHECK")
    argv = json.loads(check[check.index("CMD") + 3:].strip())  # exec form
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    return argv


def entrypoint_flag(name: str) -> str | None:
    values = [a.split("=", 1)[1] for a in entrypoint() if a.startswith(f"{name}=")]
    return values[-1] if values else None


def test_docker_healthcheck_follows_the_configured_metrics_address() -> None:
    """The check reads the port file the ENTRYPOINT makes the worker write, so it asks the
    address --metrics-listen really bound (tests below run it against a real worker)."""
    argv = healthcheck_argv()
    assert argv[:4] == ["python", "-I", "-m", "dspark_worker.healthcheck"], argv
    port_file = entrypoint_flag("--port-file")
    assert port_file is not None, "the ENTRYPOINT writes no port file for the HEALTHCHECK"
    assert argv[4:] == [port_file]
    assert not re.search(r":\d+", " ".join(argv)), "the HEALTHCHECK names a fixed port"


def docker_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for args in instructions("ENV"):
        for word in shlex.split(args):
            key, _, value = word.partition("=")
            env[key] = value
    return env


def test_docker_writable_paths_are_the_ones_kubernetes_mounts_writable() -> None:
    """Under readOnlyRootFilesystem only the emptyDir mounts can be written: HOME, the caches
    (CUDA, Triton, torch) and the port file must live there."""
    c = worker_container()
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    pod = k8s_objects()["StatefulSet"]["spec"]["template"]["spec"]
    empty_dirs = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    writable = [m["mountPath"].rstrip("/") + "/" for m in c["volumeMounts"]
                if m["name"] in empty_dirs and not m.get("readOnly")]
    env = docker_env()
    paths = {"HOME": env.get("HOME", "/home/dspark"), "XDG_CACHE_HOME":
             env.get("XDG_CACHE_HOME", "(unset: $HOME/.cache)"),
             "--port-file": entrypoint_flag("--port-file") or ""}
    for what, path in paths.items():
        assert any((path.rstrip("/") + "/").startswith(w) for w in writable), (
            f"{what}={path} is not under a writable mount {writable}")


def test_docker_installs_one_torch_the_tested_one() -> None:
    """torch comes from its own layer only; the layer of the other requirements leaves it
    out (so pip cannot add a second torch with a second set of CUDA wheels), and pip check
    fails the build if TORCH_VERSION and the worker extra's pin disagree."""
    runs = instructions("RUN")
    torch_installs = [r for r in runs if re.search(r"pip install .*torch==", r)]
    assert len(torch_installs) == 1, torch_installs
    (req,) = [r for r in runs if "requirements.txt" in r and "tomllib" in r]
    code = re.search(r'python -c "(.*?)" >', req, re.S)
    assert code is not None, req
    out = subprocess.run([sys.executable, "-c", code.group(1)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    listed = out.stdout.split()
    project = msgspec.toml.decode((ROOT / "pyproject.toml").read_bytes())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["worker"]
    assert [r for r in wanted if not r.startswith("torch")] == out.stdout.splitlines()
    assert not [r for r in listed if r.startswith("torch")]
    assert any("pip check" in r for r in runs)
    (base,) = instructions("FROM")
    assert "cuda" not in base.lower(), "a CUDA base image would carry CUDA next to the wheels"


def torch_pins() -> dict[str, str]:
    ci = re.search(r"pip install[^\n]*torch==([\w.+]+)", (ROOT / ".ci" / "run").read_text())
    (arg,) = [a for a in instructions("ARG") if a.startswith("TORCH_VERSION=")]
    project = msgspec.toml.decode((ROOT / "pyproject.toml").read_bytes())["project"]
    (extra,) = [r for r in project["optional-dependencies"]["worker"] if r.startswith("torch")]
    pinned = re.fullmatch(r"torch==([\w.+]+)", extra.replace(" ", ""))
    assert ci is not None, ".ci/run no longer installs a pinned torch"
    assert pinned is not None, f"the worker extra does not pin torch: {extra!r}"
    return {".ci/run": ci.group(1), "Dockerfile": arg.split("=", 1)[1],
            "pyproject [worker]": pinned.group(1)}


def test_torch_is_the_version_ci_tests_everywhere() -> None:
    pins = torch_pins()
    assert len(set(pins.values())) == 1, pins


def readme_block(heading: str, index: int) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"## {heading}")
    end = text.find("\n## ", start + 1)
    blocks = re.findall(r"```bash\n(.*?)```", text[start:end], re.S)
    return str(blocks[index]).strip()


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    m = re.search(r"^README_TEST='(.*)'$", ci, re.M)
    assert m is not None, ".ci/run does not hold the README's test command"
    assert m.group(1) == readme_block("The two commands", 1)
    # ... and runs both halves of it.
    assert 'eval "${README_TEST%% && *}"' in ci and 'eval "${README_TEST##* && }"' in ci




def test_dockerignore_lets_the_copied_sources_in() -> None:
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    assert patterns[0] == "*", ".dockerignore should allow-list (start with *)"
    for args in instructions("COPY"):
        words = [w for w in args.split() if not w.startswith("--")]
        for src in words[:-1]:
            assert src.rstrip("/") in allowed, f"COPY {src}: excluded by .dockerignore"


# -- Kubernetes -----------------------------------------------------------------------------------
def k8s_objects() -> dict[str, dict[str, Any]]:
    objs: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in load_all(path):
            if "kind" in doc and doc["kind"] != "Kustomization":
                objs[doc["kind"]] = doc
    return objs


def worker_container() -> dict[str, Any]:
    sts = k8s_objects()["StatefulSet"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return dict(container)


def container_ports() -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in worker_container()["ports"]}


def k8s_config() -> WorkerConfig:
    return config_from_flags(worker_container()["args"], "statefulset.yaml args")


def test_k8s_args_are_real_flags_and_ports_match() -> None:
    config = k8s_config()
    ports = container_ports()
    assert config.listen is not None and config.metrics_listen is not None
    assert parse_host_port(config.listen)[1] == ports["draft"] == DRAFT_PORT
    assert parse_host_port(config.metrics_listen)[1] == ports["metrics"] == METRICS_PORT


def probes() -> dict[str, dict[str, Any]]:
    c = worker_container()
    return {kind: c[kind] for kind in ("startupProbe", "livenessProbe", "readinessProbe")
            if kind in c}


def test_k8s_probes() -> None:
    p = probes()
    assert p["readinessProbe"]["httpGet"]["path"] == "/healthz"
    # /healthz is 503 while draining: a liveness probe on it would kill the drain.
    assert p["livenessProbe"]["httpGet"]["path"] == "/livez"
    ports = container_ports()
    for kind, probe in p.items():
        port = probe["httpGet"]["port"]
        number = ports[port] if isinstance(port, str) else port
        assert number == METRICS_PORT, f"{kind} probes port {port}"


def test_k8s_secret_is_mounted_where_the_worker_reads_it() -> None:
    objs = k8s_objects()
    config = k8s_config()
    assert config.auth_secret_file is not None, "the StatefulSet runs without authentication"
    pod = objs["StatefulSet"]["spec"]["template"]["spec"]
    secret = objs["Secret"]
    secret_volumes = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    mounts = {m["name"]: m["mountPath"] for m in worker_container()["volumeMounts"]}
    keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    found = []
    for name, vol in secret_volumes.items():
        assert vol["secretName"] == secret["metadata"]["name"]
        items = {i["key"]: i["path"] for i in vol.get("items", [])} or {k: k for k in keys}
        found += [f"{mounts[name].rstrip('/')}/{path}" for path in items.values()]
    assert config.auth_secret_file in found, (config.auth_secret_file, found)
    # Readable by the worker's user: fsGroup owns the files, the mode lets the group read.
    assert pod["securityContext"].get("fsGroup") is not None
    assert all(vol.get("defaultMode", 0o644) & 0o040 for vol in secret_volumes.values())


def test_k8s_secret_template_is_not_applied() -> None:
    """Applying the placeholder would overwrite the operator's real secret."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert "secret.yaml" not in kustomization["resources"]


def test_k8s_kustomizations_name_existing_files() -> None:
    paths = sorted(DEPLOY.rglob("kustomization.yaml"))
    assert len(paths) >= 3
    for path in paths:
        for res in yaml.safe_load(path.read_text())["resources"]:
            target = path.parent / res
            assert target.is_file() or (target / "kustomization.yaml").is_file(), (
                f"{rel(path)}: {res} is neither a file nor a kustomization")


def pod_labels() -> dict[str, str]:
    return dict(k8s_objects()["StatefulSet"]["spec"]["template"]["metadata"]["labels"])


def test_k8s_replicas_never_share_a_node() -> None:
    pod = k8s_objects()["StatefulSet"]["spec"]["template"]["spec"]
    terms = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    on_node = [t for t in terms if t["topologyKey"] == "kubernetes.io/hostname"]
    assert on_node, "no required anti-affinity per node"
    for term in on_node:
        assert term["labelSelector"]["matchLabels"].items() <= pod_labels().items()
    for spread in pod.get("topologySpreadConstraints", []):
        assert spread["labelSelector"]["matchLabels"].items() <= pod_labels().items()


def test_k8s_priority_class_is_a_hook() -> None:
    pod = k8s_objects()["StatefulSet"]["spec"]["template"]["spec"]
    assert "priorityClassName" in pod  # "" in the base: the cluster default until set


def test_k8s_checkpoint_claim_is_read_only_many() -> None:
    objs = k8s_objects()
    pod = objs["StatefulSet"]["spec"]["template"]["spec"]
    (vol,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    claim = vol["persistentVolumeClaim"]
    assert claim["readOnly"] is True
    mounts = {m["name"]: m for m in worker_container()["volumeMounts"]}
    assert mounts[vol["name"]]["readOnly"] is True
    pvc = objs["PersistentVolumeClaim"]
    assert pvc["metadata"]["name"] == claim["claimName"]
    # Replicas on different nodes share it: ReadWriteOnce would attach to one node only.
    assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert "checkpoints-pvc.yaml" not in kustomization["resources"]  # a template


# -- kustomize: the base, the monitoring objects and the example overlay build ----------------
OVERLAY = DEPLOY / "kubernetes-overlays" / "example"
KUBECTL = shutil.which("kubectl")
REQUIRE_KUBECTL = os.environ.get("DSPARK_REQUIRE_KUBECTL") == "1"


def kustomize(path: Path) -> list[dict[str, Any]]:
    if KUBECTL is None:
        if REQUIRE_KUBECTL:
            pytest.fail("kubectl is required here (DSPARK_REQUIRE_KUBECTL=1)")
        pytest.skip("kubectl is not installed (CI uses it where the machine has it)")
    res = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return [d for d in yaml.safe_load_all(res.stdout) if d]


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in docs}


def test_kustomize_builds_the_base_and_monitoring() -> None:
    base = by_kind(kustomize(K8S))
    assert set(base) == {"StatefulSet", "Service", "PodDisruptionBudget", "NetworkPolicy",
                         "ConfigMap"}
    assert base["ConfigMap"]["metadata"]["name"] == "dspark-engine"  # the engines' RemoteConfig
    assert "Secret" not in base  # applying the template would overwrite the real secret
    args = base["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert any(a.startswith("--auth-secret-file=") for a in args)
    monitoring = by_kind(kustomize(K8S / "monitoring"))
    assert set(monitoring) == {"PodMonitor", "PrometheusRule"}


def test_kustomize_overlay_sets_its_values() -> None:
    values = yaml.safe_load((OVERLAY / "values.yaml").read_text())["data"]
    docs = kustomize(OVERLAY)
    objs = by_kind(docs)
    config_maps = [d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"]
    assert config_maps == ["dspark-engine"], "values.yaml is local configuration, never applied"
    # The monitoring namespace: on the metrics port's rule, and only there.
    rules = objs["NetworkPolicy"]["spec"]["ingress"]
    (metrics_rule,) = [r for r in rules if {p["port"] for p in r["ports"]} == {METRICS_PORT}]
    (source,) = metrics_rule["from"]
    assert source["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": values["monitoringNamespace"]}
    # Every runbook URL: the overlay's base, each alert's own anchor kept.
    anchors = {r["alert"]: r["annotations"]["runbook_url"].partition("#")[2]
               for r in alert_rules()}
    seen = 0
    for group in objs["PrometheusRule"]["spec"]["groups"]:
        for rule in group["rules"]:
            url = rule["annotations"]["runbook_url"]
            assert url == f"{values['runbookUrl']}#{anchors[rule['alert']]}", url
            seen += 1
    assert seen == len(anchors)
    # The PriorityClass hook, set to a class the overlay defines.
    pod = objs["StatefulSet"]["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == values["priorityClassName"]
    assert objs["PriorityClass"]["metadata"]["name"] == values["priorityClassName"]
    # Auth stays on and the anti-affinity stays in.
    args = pod["containers"][0]["args"]
    assert any(a.startswith("--auth-secret-file=") for a in args)
    assert pod["affinity"]["podAntiAffinity"]
    namespaced = [d for d in docs if d["kind"] != "PriorityClass"]
    assert {d["metadata"].get("namespace") for d in namespaced} == {"dspark"}


def test_k8s_grace_period_covers_the_drain() -> None:
    pod = k8s_objects()["StatefulSet"]["spec"]["template"]["spec"]
    cfg = k8s_config()
    assert pod["terminationGracePeriodSeconds"] > cfg.drain_s + cfg.shutdown_timeout_s


def test_k8s_engine_config_names_the_headless_service() -> None:
    """The engines' RemoteConfig loads, and its DNS endpoint is the headless Service's name and
    draft port: scaling the StatefulSet changes nothing on the engine side."""
    from dspark_client.config import RemoteConfig
    from dspark_client.discovery import parse_dns_endpoint

    objs = k8s_objects()
    cm = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "engine-config.yaml").read_text())
    cfg = RemoteConfig.from_dict(json.loads(cm["data"]["remote.json"]))
    name, port = parse_dns_endpoint(cfg.endpoint)
    svc = objs["Service"]
    assert svc["spec"]["clusterIP"] == "None" and name == svc["metadata"]["name"]
    assert port in [p["port"] for p in svc["spec"]["ports"] if p["name"] == "draft"]
    assert objs["StatefulSet"]["spec"]["serviceName"] == name
    secret_mount = "/etc/dspark/auth/secret"
    assert cfg.auth_secret_file == secret_mount


def test_k8s_service_podmonitor_and_networkpolicy_use_real_ports() -> None:
    objs = k8s_objects()
    ports = container_ports()
    pod_labels = objs["StatefulSet"]["spec"]["template"]["metadata"]["labels"]
    for sp in objs["Service"]["spec"]["ports"]:
        assert ports[sp["targetPort"]] == sp["port"]
    pm = objs["PodMonitor"]["spec"]
    assert pm["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pod_labels[pm["jobLabel"]] == JOB
    (endpoint,) = pm["podMetricsEndpoints"]
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
    np_ports = {p["port"] for rule in objs["NetworkPolicy"]["spec"]["ingress"]
                for p in rule["ports"]}
    assert np_ports == {DRAFT_PORT, METRICS_PORT}


def render_prometheusrule() -> str:
    groups = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
    doc = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
           "metadata": {"name": "dspark-worker",
                        "labels": {"app.kubernetes.io/name": "dspark-worker"}},
           "spec": {"groups": groups}}
    head = ("# GENERATED from deploy/prometheus/alerts.yml; do not edit. Regenerate with\n"
            "#   python -m tests.deploy.test_deploy --write-prometheusrule\n"
            "# Your Prometheus object's ruleSelector must match this object's labels.\n")
    return head + str(yaml.safe_dump(doc, sort_keys=False, width=100))


def test_k8s_prometheusrule_carries_the_alert_rules() -> None:
    assert PROMETHEUSRULE.read_text() == render_prometheusrule(), (
        "deploy/kubernetes/monitoring/prometheusrule.yaml differs from alerts.yml; run"
        " python -m tests.deploy.test_deploy --write-prometheusrule")


# -- systemd --------------------------------------------------------------------------------------
def unit(path: Path) -> dict[str, list[str]]:
    """key -> values (systemd allows a key several times) across all sections."""
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


UNITS = sorted(SYSTEMD.glob("*.service"))


@pytest.mark.parametrize("path", UNITS, ids=rel)
def test_systemd_unit_runs_the_worker_with_real_flags(path: Path) -> None:
    u = unit(path)
    (exec_start,) = u["ExecStart"]
    argv = shlex.split(exec_start.replace("%i", "0"))
    assert Path(argv[0]).name in console_scripts()
    args = parse_flags(argv[1:], f"{rel(path)} ExecStart")
    assert args.config is not None, "the unit should read a config file"
    assert Path(args.config).suffix == ".toml"
    example = build_config(SYSTEMD / "worker.toml")
    (stop,) = u["TimeoutStopSec"]
    assert float(stop) > example.shutdown_timeout_s, "systemd would SIGKILL the drain"
    assert u["User"] != ["root"]
    assert u["RestartPreventExitStatus"] == ["2"]  # a bad config is not fixed by restarting


def test_systemd_example_config_loads() -> None:
    config = build_config(SYSTEMD / "worker.toml")
    assert config.auth_secret_file is not None
    assert config.metrics_listen is not None
    assert parse_host_port(config.metrics_listen)[1] == METRICS_PORT


# -- Prometheus rules and scrape config -----------------------------------------------------------
def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((PROM / "alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        out += [t["expr"] for t in panel.get("targets", [])]
        for inner in panel.get("panels", []):
            out += [t["expr"] for t in inner.get("targets", [])]
    return out


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors: lower case, punctuation dropped, spaces to hyphens."""
    anchors = set()
    for line in markdown.splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            anchors.add(text.replace(" ", "-"))
    return anchors


def test_alerts_are_documented_and_labelled() -> None:
    anchors = heading_anchors(OPERATIONS.read_text())
    names = [r["alert"] for r in alert_rules()]
    assert len(names) == len(set(names))
    for rule in alert_rules():
        name = rule["alert"]
        assert rule["labels"]["severity"] in SEVERITIES, name
        ann = rule["annotations"]
        assert ann["summary"] and ann["description"], name
        url = ann["runbook_url"]
        assert "docs/operations.md#" in url, name
        anchor = url.rsplit("#", 1)[1]
        assert anchor in anchors, f"{name}: runbook anchor #{anchor} not in operations.md"


def test_scrape_config_targets_the_metrics_port_and_loads_the_rules() -> None:
    cfg = yaml.safe_load((PROM / "prometheus.yml").read_text())
    for rule_file in cfg["rule_files"]:
        assert (PROM / rule_file).is_file()
    jobs = cfg["scrape_configs"]
    for job in jobs:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        relabel_job = [r.get("replacement") for r in job.get("relabel_configs", [])
                       if r.get("target_label") == "job"]
        assert (relabel_job or [job["job_name"]])[-1] == JOB, job["job_name"]
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                assert int(target.rsplit(":", 1)[1]) == METRICS_PORT, target


def test_up_is_only_read_for_the_worker_job() -> None:
    for expr in [r["expr"] for r in alert_rules()] + dashboard_exprs():
        for m in re.finditer(r"\bup\b(\{[^}]*\})?", expr):
            assert m.group(1) and f'job="{JOB}"' in m.group(1), expr


PROMTOOL = shutil.which("promtool")
# CI installs promtool and sets this, so there the rules' unit tests always run.
REQUIRE_PROMTOOL = os.environ.get("DSPARK_REQUIRE_PROMTOOL") == "1"


@pytest.mark.skipif(PROMTOOL is None and not REQUIRE_PROMTOOL,
                    reason="promtool is not installed (CI installs it)")
def test_promtool_checks_and_unit_tests_the_rules(tmp_path: Path) -> None:
    assert PROMTOOL is not None, "promtool is required here (DSPARK_REQUIRE_PROMTOOL=1)"
    run = [PROMTOOL, "check", "rules", "alerts.yml"]
    subprocess.run(run, cwd=PROM, check=True, capture_output=True, timeout=60)
    res = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yml"], cwd=PROM,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    # Every dashboard query, variables filled in, as a recording rule: promtool parses them.
    exprs = [e.replace("$__rate_interval", "5m").replace("$job", ".*")
             .replace("$instance", ".*").replace("$engine", ".*") for e in dashboard_exprs()]
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    (tmp_path / "dash.yml").write_text(yaml.safe_dump(rules))
    res = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "dash.yml")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_dashboard_variables() -> None:
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert "instance" in variables
    for panel in dash["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    assert variables["engine"]["query"]["query"].startswith("label_values(dspark_client_")
    for expr in dashboard_exprs():
        for series in re.findall(r"dspark_worker_\w+(?:\{[^}]*\})?", expr):
            assert 'job=~"$job", instance=~"$instance"' in series, (series, expr)
        if "dspark_client_" in expr:
            assert 'instance=~"$engine"' in expr, expr


# -- docs -----------------------------------------------------------------------------------------
def test_configuration_reference_is_up_to_date() -> None:
    spec = importlib.util.spec_from_file_location(
        "gen_config_reference", ROOT / "tools" / "gen_config_reference.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (ROOT / "docs" / "configuration.md").read_text() == gen.render(), (
        "docs/configuration.md is out of date: run python tools/gen_config_reference.py")
    readme = (ROOT / "README.md").read_text()
    assert readme == gen.render_readme(readme), (
        "README.md's configuration table is out of date: run python"
        " tools/gen_config_reference.py")
    # every flag of the parser has its row in the README
    for action in gen._options(cli.build_parser()):
        assert gen._flags(action) in readme, action.dest
    # Its TOML block of defaults loads through the worker's own loader.
    toml = re.search(r"```toml\n(.*?)```", gen.render(), re.S)
    assert toml is not None
    assert msgspec.toml.decode(toml.group(1).encode()) == {
        f: getattr(WorkerConfig(), f) for f in WorkerConfig.__struct_fields__
        if getattr(WorkerConfig(), f) is not None}


def test_operations_stats_schema_is_the_code_s() -> None:
    dispatch = (ROOT / "dspark_worker" / "dispatch.py").read_text()
    code = re.search(r"STATS JSON .*?::\n\n(.*?)\n\n", dispatch, re.S)
    doc = re.search(r"## STATS\n.*?```\n(.*?)```", OPERATIONS.read_text(), re.S)
    assert code is not None and doc is not None

    def norm(block: str) -> list[str]:
        return [ln.strip() for ln in block.strip().splitlines()]

    assert norm(doc.group(1)) == norm(code.group(1))


def test_architecture_names_real_files() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    packages = "protocol|dspark_worker|dspark_client|dspark_vllm|dspark_sglang"
    for path in set(re.findall(rf"`((?:{packages})/[\w/]+\.py)`", text)):
        assert (ROOT / path).is_file(), path


# -- a real worker: every metric the dashboard and the rules read exists --------------------------
class Peer:
    """Blocking frames over TCP (protocol only, no worker code)."""

    def __init__(self, host: str, port: int, session: int) -> None:
        self.sock = socket.create_connection((host, port), timeout=10)
        self.decoder = FrameDecoder()
        self.session = session
        self.seq = 0
        self.pending: list[Any] = []

    def request(self, op: int, body: bytes = b"", session: int | None = None) -> tuple[int, bytes]:
        self.seq += 1
        self.sock.sendall(frame(op, self.seq, self.session if session is None else session,
                                body))
        while not self.pending:
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("the worker closed the connection")
            self.pending += self.decoder.feed(data)
        f = self.pending.pop(0)
        return f.header.status, bytes(f.body)

    def hello(self, msg: Hello, secret: bytes, session: int | None = None) -> int:
        sid = self.session if session is None else session
        signed = sign_hello(secret, sid, self.seq + 1, msg)
        return self.request(OP_HELLO, signed.pack(), session=sid)[0]

    def closed_by_worker(self, timeout: float = 5.0) -> bool:
        """Read (and drop) whatever the worker sends until it closes; False on a timeout."""
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(65536):
                pass
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self.sock.close()


def bf16_rows(count: int, row_bytes: int, seed: int) -> bytes:
    vals = np.random.default_rng(seed).uniform(-2, 2, (count, row_bytes // 2)).astype(np.float32)
    return (vals.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def drive(host: str, port: int, secret: bytes) -> None:
    """Traffic that makes every family and every label value the rules read appear."""
    a = Peer(host, port, session=0x1234)
    status, body = a.request(OP_STATS, session=0)
    assert status == ST_OK
    stats = json.loads(body)
    g = stats["geometry"]
    row_bytes = g["row_bytes"]
    hello = Hello(sample_mode=SAMPLE_GREEDY, window=g["window"], num_spec=g["num_spec"],
                  max_slots=4, max_rows_per_step=64, row_bytes=row_bytes,
                  vocab_size=g["vocab_size"], n_taps=g["n_taps"], hidden=g["hidden"],
                  drafter_identity=bytes.fromhex(stats["drafter_identity"]),
                  markov_identity=bytes.fromhex(stats["markov_identity"]),
                  client_name="deploy-test")
    refused = [
        (ST_GEOMETRY, dict(window=g["window"] + 1)),
        (ST_LIMITS, dict(max_slots=stats["limits"]["max_slots"] + 1)),
        (ST_IDENTITY, dict(drafter_identity=bytes(32))),
    ]
    for want, change in refused:
        assert a.hello(msgspec.structs.replace(hello, **change), secret) == want
    assert a.hello(hello, b"not the secret") == ST_AUTH
    assert a.hello(hello, secret, session=0) == ST_BAD_FRAME  # session 0 cannot HELLO
    assert a.hello(hello, secret) == ST_OK
    # A request with context (drafts), one without (RS_NO_WINDOW), a continuation, a release.
    step = pack_step(1, [ReqEntry(slot=0, generation=1, anchor_pos=10, anchor_token=3,
                                  n_rows=10, flags=RF_NEED_DRAFT),
                         ReqEntry(slot=1, generation=1, anchor_pos=5, anchor_token=3,
                                  flags=RF_NEED_DRAFT)],
                     bf16_rows(10, row_bytes, 1), row_bytes)
    status, body = a.request(OP_STEP, step)
    assert status == ST_OK
    assert StepReply.unpack(body).status.tolist() == [0, 2]  # OK, NO_WINDOW
    step = pack_step(2, [ReqEntry(slot=0, generation=1, anchor_pos=11, anchor_token=4,
                                  n_rows=1, flags=RF_NEED_DRAFT)],
                     bf16_rows(1, row_bytes, 2), row_bytes)
    assert a.request(OP_STEP, step)[0] == ST_OK
    assert a.request(OP_RESET, pack_reset([1]))[0] == ST_OK
    assert a.request(OP_PING)[0] == ST_OK
    step = pack_step(3, [ReqEntry(slot=0, generation=1, anchor_pos=11, anchor_token=4,
                                  flags=RF_RELEASE)], b"", row_bytes)
    assert a.request(OP_STEP, step)[0] == ST_OK
    # The same engine respawned: a new session under the same client name replaces the old
    # (its predecessor's connection is gone).
    a.sock.close()
    time.sleep(0.2)
    b = Peer(host, port, session=0x5678)
    assert b.hello(hello, secret) == ST_OK
    # One slot continued long enough for the per-session acceptance gauges (each STEP judges
    # the block before it: nothing accepted).
    for i in range(MIN_RECENT_BLOCKS + 1):
        n_rows = 10 if i == 0 else 1
        step = pack_step(10 + i, [ReqEntry(slot=0, generation=1, anchor_pos=10 + i,
                                           anchor_token=3, n_rows=n_rows, flags=RF_NEED_DRAFT)],
                         bf16_rows(n_rows, row_bytes, 3), row_bytes)
        assert b.request(OP_STEP, step)[0] == ST_OK
    # Streams that break the framing, each closed with its reason.
    bad = Peer(host, port, 1)
    bad.sock.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(8))  # not DSPK: bad_magic
    huge = Peer(host, port, 1)
    huge.sock.sendall(AppHeader(op=OP_STEP, seq=1, session=1, body_len=1 << 31).pack())
    old = Peer(host, port, 1)  # another contract version: ST_VERSION, then closed
    old.sock.sendall(AppHeader(op=OP_PING, seq=1, session=0, body_len=0, version=2).pack())
    stall = Peer(host, port, 1)
    stall.sock.sendall(frame(OP_PING, 1, 0)[:10])  # and nothing more: partial_timeout
    for peer in (bad, huge, old, stall):
        assert peer.closed_by_worker(), "the worker kept a broken stream open"
    for peer in (a, b, bad, huge, old, stall):
        peer.close()


def scrape(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        with contextlib.closing(exc):
            return exc.code, exc.read().decode()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from tests.support.drafters import perturbed_reference
    from tests.support.worker_proc import start_worker

    secret_file = tmp_path_factory.mktemp("auth") / "secret"
    secret = b"deploy-test-secret"
    secret_file.write_bytes(secret + b"\n")
    secret_file.chmod(0o600)
    # A canary too (the reference drafter perturbed), so that its families are scraped.
    canary = perturbed_reference(tmp_path_factory.mktemp("canary") / "candidate")
    with start_worker("--max-total-slots", "8", "--window", "64", "--max-slots", "8",
                      "--max-rows-per-step", "64", "--partial-frame-timeout-s", "0.3",
                      "--auth-secret-file", str(secret_file), "--log-level", "WARNING",
                      "--canary-checkpoint", str(canary), "--canary-fraction", "1") as w:
        assert w.host is not None and w.port is not None and w.metrics_url is not None
        drive(w.host, w.port, secret)
        deadline = time.monotonic() + 10
        while True:  # the last closes are counted when the worker notices them
            status, text = scrape(w.metrics_url + "/metrics")
            if 'reason="partial_timeout"' in text or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert status == 200
        yield {"metrics": text, "url": w.metrics_url, "worker": w, "secret": secret}


def series(text: str) -> tuple[set[str], dict[tuple[str, str], set[str]]]:
    """Sample names in the scrape, and the values seen per (sample name, label)."""
    names: set[str] = set()
    values: dict[tuple[str, str], set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            names.add(s.name)
            for label, value in s.labels.items():
                values.setdefault((s.name, label), set()).add(value)
    return names, values


METRIC = re.compile(r"\b(dspark_worker_\w+)(\{[^}]*\})?")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
# Label values the protocol defines, for those the test cannot make happen (INTERNAL ...).
KNOWN_VALUES = {
    "op": set(OP_NAMES.values()),
    "stage": set(STAGES),
}


def known_values(name: str, label: str) -> set[str]:
    if label == "status":
        return set(REQ_STATUS_NAMES.values() if "request_status" in name
                   else FRAME_STATUS_NAMES.values())
    if label == "reason" and "sessions_dropped" in name:
        return {r.value for r in DropReason}
    return KNOWN_VALUES.get(label, set())


def used_metrics() -> list[tuple[str, str, str]]:
    """(where, metric name, its matchers) for every dspark metric the rules and panels read."""
    out = []
    for rule in alert_rules():
        out += [(rule["alert"], m.group(1), m.group(2) or "")
                for m in METRIC.finditer(rule["expr"])]
    for expr in dashboard_exprs():
        out += [(DASHBOARD.name, m.group(1), m.group(2) or "") for m in METRIC.finditer(expr)]
    return out


# Exported on CUDA only (on the CPU the drafter's tensors are part of the resident set).
CUDA_ONLY = {"dspark_worker_device_memory_allocated_bytes",
             "dspark_worker_device_memory_reserved_bytes"}


def test_every_metric_used_exists_in_a_real_scrape(live: dict[str, Any]) -> None:
    names, _ = series(live["metrics"])
    missing = sorted({(where, name) for where, name, _ in used_metrics()
                      if name not in names and name not in CUDA_ONLY})
    assert not missing, f"not in the worker's /metrics: {missing}"
    source = (ROOT / "dspark_worker" / "metrics.py").read_text()
    for name in CUDA_ONLY:
        assert f'f"{{PREFIX}}{name.removeprefix("dspark_worker")}"' in source, name


@pytest.fixture(scope="module")
def engine_metrics(live: dict[str, Any]) -> str:
    """An engine's view: a real client (authenticated) drives rounds against the live worker,
    its collector sits in a fresh registry, and that registry is scraped over HTTP."""
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import CollectorRegistry, make_wsgi_app

    import dspark_client as dc

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    worker = live["worker"]
    drafter = Path(importlib.util.find_spec("dspark_worker").submodule_search_locations[0],
                   "drafter", "reference")
    hello = dc.hello_from_checkpoint(drafter, window=64, max_slots=4, max_rows_per_step=64,
                                     client_name="deploy-test-engine")
    client = dc.RemoteDraftClient(dc.RemoteConfig(endpoint=worker.endpoint, timeout_ms=10_000,
                                                  auth_secret=live["secret"]), hello)
    registry = CollectorRegistry()
    registry.register(dc.prometheus_collector(client))
    try:
        assert client.wait_ready(30.0)
        rounds = dc.DraftRounds(client)
        rows = np.zeros((8, hello.row_bytes), np.uint8)
        for i in range(3):
            res = rounds.run([dc.SlotRequest(slot=0, generation=1, anchor_pos=8 + i,
                                             anchor_token=3, rows=rows[:8 if i == 0 else 1],
                                             n_out=hello.num_spec)])
            assert res.ok, res.reason
        rounds.run([], release=[0])
        server = make_server("127.0.0.1", 0, make_wsgi_app(registry), handler_class=Quiet)
        thread = threading.Thread(target=server.handle_request, daemon=True)
        thread.start()
        try:
            status, text = scrape(f"http://127.0.0.1:{server.server_address[1]}/metrics")
        finally:
            thread.join(10)
            server.server_close()
        assert status == 200
        return text
    finally:
        client.close()


def test_every_engine_metric_used_exists_in_a_real_client_scrape(engine_metrics: str) -> None:
    names, _ = series(engine_metrics)
    used = {m.group(1) for expr in dashboard_exprs()
            for m in re.finditer(r"\b(dspark_client_\w+)", expr)}
    assert len(used) >= 8, "the dashboard has no engine row"
    assert not sorted(used - names), f"not in the client's collector: {sorted(used - names)}"


def test_every_engine_metric_family_is_documented(engine_metrics: str) -> None:
    doc = OPERATIONS.read_text()
    for family in text_string_to_metric_families(engine_metrics):
        shown = family.name + ("_total" if family.type == "counter" else "")
        assert f"`{shown}" in doc, f"{shown} is not in docs/operations.md"


def test_every_label_value_used_is_real(live: dict[str, Any]) -> None:
    _, values = series(live["metrics"])
    for where, name, matchers in used_metrics():
        for label, op, value in MATCHER.findall(matchers):
            if label in ("job", "instance") or "$" in value:
                continue
            seen = values.get((name, label), set()) | known_values(name, label)
            assert seen, f"{where}: {name} has no label {label!r}"
            wanted = value.split("|") if op in ("=~", "!~") else [value]
            for v in wanted:
                assert v in seen, f"{where}: {name}{{{label}{op}\"{value}\"}}: {v!r} never" \
                                  f" appears (seen: {sorted(seen)})"


def test_broken_streams_are_counted_by_reason(live: dict[str, Any]) -> None:
    _, values = series(live["metrics"])
    reasons = values[("dspark_worker_connections_closed_total", "reason")]
    assert {"bad_magic", "too_large", "version", "partial_timeout"} <= reasons


def test_every_metric_family_is_documented(live: dict[str, Any]) -> None:
    doc = OPERATIONS.read_text()
    for family in text_string_to_metric_families(live["metrics"]):
        if family.name.endswith("_created"):
            continue
        shown = family.name + ("_total" if family.type == "counter" else "")
        assert f"`{shown}" in doc, f"{shown} is not in docs/operations.md"


def test_no_rule_or_panel_reads_created_series() -> None:
    """*_created series are dropped by some setups: restarts come from start_time_seconds."""
    for expr in [r["expr"] for r in alert_rules()] + dashboard_exprs():
        assert "_created" not in expr, expr
    (restarting,) = [r for r in alert_rules() if r["alert"] == "DSparkWorkerRestarting"]
    assert "dspark_worker_start_time_seconds" in restarting["expr"]


def run_healthcheck(port_file: Path | str) -> subprocess.CompletedProcess[str]:
    """The image's HEALTHCHECK command, with this port file, on this checkout's code (without
    -I, which would ignore PYTHONPATH and run an installed copy)."""
    argv = [a for a in healthcheck_argv() if a != "-I"]
    argv = [sys.executable if argv[0] == "python" else argv[0], *argv[1:-1], str(port_file)]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_healthcheck_asks_the_metrics_address_in_the_port_file(live: dict[str, Any],
                                                                tmp_path: Path) -> None:
    worker = live["worker"]
    ok = run_healthcheck(worker.port_file)
    assert ok.returncode == 0, ok.stderr
    assert f"{live['url']}/healthz: 200" in ok.stdout
    missing = run_healthcheck(tmp_path / "none.json")
    assert missing.returncode == 1 and "not ready" in missing.stderr
    # A wildcard bind is asked on loopback; a dead address fails with one line.
    ports = json.loads(worker.port_file.read_text())
    port = ports["metrics"].rsplit(":", 1)[1]
    (tmp_path / "wild.json").write_text(json.dumps({**ports, "metrics": f"0.0.0.0:{port}"}))
    assert run_healthcheck(tmp_path / "wild.json").returncode == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    (tmp_path / "dead.json").write_text(json.dumps({**ports, "metrics": f"127.0.0.1:{dead}"}))
    res = run_healthcheck(tmp_path / "dead.json")
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_healthcheck_without_metrics_checks_the_draft_port() -> None:
    from tests.support.worker_proc import start_worker

    with start_worker("--metrics-listen", "none", "--max-total-slots", "4", "--window", "64",
                      "--max-slots", "4", "--no-warmup", "--log-level", "WARNING") as w:
        ok = run_healthcheck(w.port_file)
        assert ok.returncode == 0, ok.stderr
        assert "accepts connections" in ok.stdout
        port_file = w.port_file.read_text()
        w.stop()
    stopped = Path(tempfile.mkdtemp()) / "ports.json"
    stopped.write_text(port_file)
    try:
        assert run_healthcheck(stopped).returncode == 1
    finally:
        shutil.rmtree(stopped.parent)


def test_probe_paths_answer_on_the_real_worker(live: dict[str, Any]) -> None:
    paths = {p["httpGet"]["path"] for p in probes().values()} | {"/healthz", "/livez"}
    for path in sorted(paths):
        status, body = scrape(live["url"] + path)
        assert status == 200, f"{path}: {status} {body!r}"


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-prometheusrule"]:
        PROMETHEUSRULE.write_text(render_prometheusrule())
    else:
        sys.exit("usage: python -m tests.deploy.test_deploy --write-prometheusrule")
