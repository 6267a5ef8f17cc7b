"""deploy/kubernetes: every object valid against Kubernetes' own schemas (strict: an unknown field
fails), and wired the way dlora runs: the config in the ConfigMap loads with dlora's loader, the
probes ask /health on dlora's port, the grace period outlasts the drain, the workers join the head
through its Service, and every pod sees the model and the adapter copies at the paths the config
names."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dlora.config import DloraConfig, from_dict

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.31"
NOT_KUBERNETES_OBJECTS = {"kustomization.yaml", "prometheus-scrape.yaml"}  # kustomize's and Prometheus's
MANIFESTS = sorted(p for p in ROOT.glob("*.yaml") if p.name not in NOT_KUBERNETES_OBJECTS)


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def objects() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for p in MANIFESTS for d in documents(p)}


@pytest.fixture(scope="module")
def objs() -> dict[tuple[str, str], dict[str, Any]]:
    return objects()


@pytest.fixture(scope="module")
def config(objs) -> DloraConfig:
    return from_dict(yaml.safe_load(objs["ConfigMap", "dlora-config"]["data"]["config.yaml"]))


def container(objs, deployment: str) -> dict[str, Any]:
    (only,) = pod_spec(objs, deployment)["containers"]
    return only


def pod_spec(objs, deployment: str) -> dict[str, Any]:
    return objs["Deployment", deployment]["spec"]["template"]["spec"]


def script(c: dict[str, Any]) -> str:
    return " ".join([*c.get("command", []), *c.get("args", [])])


def named_port(c: dict[str, Any], name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


def mounts(objs, deployment: str) -> dict[str, tuple[str, bool, str | None]]:
    """mountPath -> (volume name, read-only, the PVC behind it)."""
    volumes = {v["name"]: v for v in pod_spec(objs, deployment)["volumes"]}
    out = {}
    for m in container(objs, deployment)["volumeMounts"]:
        claim = volumes[m["name"]].get("persistentVolumeClaim", {}).get("claimName")
        out[m["mountPath"]] = (m["name"], m.get("readOnly", False), claim)
    return out


def mounted_at(objs, deployment: str, path: str) -> tuple[str, bool, str | None] | None:
    """The mount a path lies on (the deepest one above it), or None."""
    found = [(mp, m) for mp, m in mounts(objs, deployment).items() if Path(path).is_relative_to(mp)]
    return max(found, key=lambda item: len(item[0]))[1] if found else None


def mount_holding(objs, deployment: str, path: str) -> tuple[str, bool, str | None]:
    found = mounted_at(objs, deployment, path)
    assert found is not None, f"{deployment}: nothing mounted at or above {path}"
    return found


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_object_is_valid_for_kubernetes(path):
    docs = documents(path)
    assert docs, f"{path.name} holds no object"
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_misspelled_field_fails_validation(objs):
    """Strict mode is what catches a field Kubernetes would drop without a word."""
    head = yaml.safe_load(yaml.safe_dump(objs["Deployment", "dlora-head"]))
    probe = head["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]
    probe["paht"] = probe.pop("path")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(head, KUBERNETES_VERSION, strict=True)


def test_the_kustomization_applies_every_manifest():
    kustomization = yaml.safe_load((ROOT / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [p.name for p in MANIFESTS]


def test_the_configmap_holds_a_config_dlora_loads(config):
    assert config.cluster.ray_address == "auto"  # the Ray head in the same container
    assert config.server.host == "0.0.0.0"


def test_the_head_serves_the_mounted_config(objs):
    head = container(objs, "dlora-head")
    (config_mount,) = [mp for mp, (name, _, _) in mounts(objs, "dlora-head").items() if name == "config"]
    volume = next(v for v in pod_spec(objs, "dlora-head")["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == "dlora-config"
    assert f"exec .venv/bin/dlora serve --config {config_mount}/config.yaml" in script(head)
    assert re.search(r"ray start --head --port=(\d+)", script(head)).group(1) == str(named_port(head, "gcs"))


def test_probes_ask_health_on_the_http_port(objs, config):
    head = container(objs, "dlora-head")
    assert named_port(head, "http") == config.server.port
    for probe in ("startupProbe", "readinessProbe"):
        assert head[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    # Liveness is the server answering at all; /health's 503 (draining, replicas rebuilding) is not death.
    assert head["livenessProbe"]["httpGet"] == {"path": "/version", "port": "http"}
    startup = head["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= config.cluster.replica_start_timeout_s


def test_the_grace_period_outlasts_the_prestop_sleep_and_the_drain(objs, config):
    head = container(objs, "dlora-head")
    prestop = head["lifecycle"]["preStop"]["exec"]["command"]
    assert prestop[0] == "sleep"
    grace = pod_spec(objs, "dlora-head")["terminationGracePeriodSeconds"]
    assert grace > float(prestop[1]) + config.server.drain_timeout_s + 10


def test_workers_join_the_head_through_its_service(objs):
    worker = container(objs, "dlora-worker")
    address = re.search(r"ray start --address=([\w.-]+):(\d+)", script(worker))
    assert address, script(worker)
    service = objs["Service", address.group(1)]
    head_labels = objs["Deployment", "dlora-head"]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= head_labels.items()
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == int(address.group(2))]
    head = container(objs, "dlora-head")
    assert named_port(head, port["targetPort"]) == int(address.group(2))
    # The head is ready only once workers joined and replicas loaded: its GCS must be reachable before.
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert "--block" in shlex.split(script(worker).split("exec", 1)[1])


def test_one_gpu_per_worker_and_one_worker_per_replica(objs, config):
    worker = container(objs, "dlora-worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "--num-gpus=1" in script(worker)
    assert objs["Deployment", "dlora-worker"]["spec"]["replicas"] == config.cluster.num_replicas
    assert "--num-gpus=0" in script(container(objs, "dlora-head"))  # no replica on the head


def test_the_http_service_reaches_the_head(objs, config):
    service = objs["Service", "dlora"]
    head_labels = objs["Deployment", "dlora-head"]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= head_labels.items()
    assert service["spec"]["ports"] == [{"name": "http", "port": config.server.port, "targetPort": "http"}]
    assert not service["spec"].get("publishNotReadyAddresses", False)


def test_the_model_is_on_its_volume_read_only_on_every_pod(objs, config):
    for deployment in ("dlora-head", "dlora-worker"):
        _, read_only, claim = mount_holding(objs, deployment, config.model.path)
        assert (claim, read_only) == ("dlora-models", True), deployment


def test_adapters_reach_the_workers_through_their_own_node_cache(objs, config):
    """The head alone reads adapter sources and its state dir; a worker's replicas fetch each
    adapter version into the worker's node cache (engine.node_cache_dir), a writable volume of its
    own, larger than the cache's byte cap."""
    state_dir = str(config.server.state_dir)
    assert mount_holding(objs, "dlora-head", state_dir) == ("state", False, "dlora-state")
    assert mounted_at(objs, "dlora-worker", state_dir) is None
    assert objs["PersistentVolumeClaim", "dlora-state"]["spec"]["accessModes"] == ["ReadWriteOnce"]
    for root in config.server.adapter_roots:
        assert mount_holding(objs, "dlora-head", root)[2] == "dlora-adapters"
        assert mounted_at(objs, "dlora-worker", root) is None
    cache = config.engine.node_cache_dir
    assert cache is not None
    name, read_only, _ = mount_holding(objs, "dlora-worker", cache)
    assert not read_only
    (volume,) = [v for v in pod_spec(objs, "dlora-worker")["volumes"] if v["name"] == name]
    limit = volume["emptyDir"]["sizeLimit"]
    assert limit.endswith("Gi") and int(limit[:-2]) * 1024 > config.engine.node_cache_mib


def test_prometheus_finds_the_head_by_its_annotations(objs, config):
    annotations = objs["Deployment", "dlora-head"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(config.server.port),
        "prometheus.io/path": "/metrics",
    }
    (job,) = yaml.safe_load((ROOT / "prometheus-scrape.yaml").read_text())["scrape_configs"]
    assert job["kubernetes_sd_configs"][0]["role"] == "pod"
    keep = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    assert keep == [
        {
            "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"],
            "action": "keep",
            "regex": "true",
        }
    ]
