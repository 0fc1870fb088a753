"""deploy/kubernetes/ without a cluster or kubectl: every manifest against the Kubernetes schemas (kubernetes-validate's
bundled ones, offline, strict: an unknown field is an error) for the oldest and newest Kubernetes supported; the
overlay rendered as kustomize would and validated too; what no core schema covers (the Prometheus adapter's rule)
checked field by field; and the manifests against the code: the probe paths are the server's routes, the port is
the image's, every FOLIO_* variable is a server setting with a valid value, the pod runs as the image's user with
writable space where the server writes, the drain fits in the grace period, the memory fits the model, and the
autoscaler reads a metric the adapter serves from series Folio exports.

`python -m pytest tests/deploy/test_kubernetes.py -v -k schema` prints one line per manifest and version."""

from __future__ import annotations

import ast
import inspect
import math
import re
from pathlib import Path
from typing import Any
from unittest import mock

import kubernetes_validate
import pytest
import torch
import yaml

from app.main import create_app
from app.settings import Settings
from model.checkpoint import read_config
from model.config import GPTConfig
from model.engine import Engine
from model.gpt import GPT
from tests import REPO
from tests.deploy.dockerfile import DOCKERFILE, runtime_env, stages
from tests.deploy.promql import metric_names

KUBE = REPO / "deploy" / "kubernetes"
OVERLAY = KUBE / "overlays" / "weights-pvc"
ADAPTER = KUBE / "prometheus-adapter" / "values.yaml"
VERSIONS = ("1.30", "1.37")  # the oldest Kubernetes the manifests are for, and the newest with bundled schemas

# what the server takes after SIGTERM besides the drain itself: uvicorn's graceful shutdown is the drain + 2 s
# (app/__main__.py), then the lifespan joins the engine thread for up to Engine.stop's timeout
UVICORN_EXTRA_SECONDS = 2
ENGINE_JOIN_SECONDS = inspect.signature(Engine.stop).parameters["timeout"].default
# Python, torch, FastAPI, the kernels' pool: RSS of a server less its weights, packed copy and KV cache, measured
# at 328 MiB (bundled model) and 353 MiB (GPT-2 small), rounded up
RUNTIME_OVERHEAD_BYTES = 384 * 2**20
GPT2_SMALL = GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768, bias=True)


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kustomization(directory: Path) -> dict[str, Any]:
    return documents(directory / "kustomization.yaml")[0]


# Kubernetes' patchMergeKey of the lists the overlay patches: a strategic merge patch merges their items by it
MERGE_KEYS = {"containers": "name", "env": "name", "volumes": "name", "volumeMounts": "mountPath",
              "ports": "containerPort"}


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """What kustomize makes of `base` patched by `patch` (enough of a strategic merge for these manifests)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{k: strategic_merge(base[k], v, k) if k in base else v for k, v in patch.items()}}
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        key, merged = MERGE_KEYS[field], list(base)
        for item in patch:
            at = next((i for i, old in enumerate(merged) if old[key] == item[key]), None)
            if at is None:
                merged.append(item)
            else:
                merged[at] = strategic_merge(merged[at], item)
        return merged
    return patch


def build(directory: Path) -> list[dict[str, Any]]:
    """The resources `kubectl apply -k directory` applies: its resources (directories recursively), patched."""
    k = kustomization(directory)
    resources: list[dict[str, Any]] = []
    for entry in k["resources"]:
        path = (directory / entry).resolve()
        resources += build(path) if path.is_dir() else documents(path)
    for p in k.get("patches", []):
        for patch in documents(directory / p["path"]):
            at = next(i for i, r in enumerate(resources)
                      if (r["kind"], r["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"]))
            resources[at] = strategic_merge(resources[at], patch)
    return resources


def by_kind(resources: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {r["kind"]: r for r in resources}
    assert len(out) == len(resources), "one resource of each kind"
    return out


BASE = by_kind(build(KUBE))
WITH_PVC = by_kind(build(OVERLAY))


def pod(resources: dict[str, dict[str, Any]] = BASE) -> dict[str, Any]:
    return resources["Deployment"]["spec"]["template"]["spec"]


def container(resources: dict[str, dict[str, Any]] = BASE) -> dict[str, Any]:
    (c,) = pod(resources)["containers"]
    return c


def env(resources: dict[str, dict[str, Any]] = BASE) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(resources)["env"]}


def quantity(value: str) -> float:
    """A Kubernetes quantity as a number: '512Mi' -> 536870912, '2' -> 2, '500m' -> 0.5."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "m": 1e-3}
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value)).groups()
    return float(number) * units.get(unit, 1)


# -- the schemas ------------------------------------------------------------------------------------------


def schema_cases() -> list[Any]:
    cases = []
    files = [KUBE / f for f in kustomization(KUBE)["resources"]] + [OVERLAY / "pvc.yaml"]
    for path in files:
        for doc in documents(path):
            name = f"{path.relative_to(KUBE)} {doc['kind']}/{doc['metadata']['name']}"
            cases += [pytest.param(doc, v, id=f"{name} k8s-{v}") for v in VERSIONS]
    rendered = "overlays/weights-pvc (rendered) Deployment/folio"
    cases += [pytest.param(WITH_PVC["Deployment"], v, id=f"{rendered} k8s-{v}") for v in VERSIONS]
    return cases


@pytest.mark.parametrize(("manifest", "version"), schema_cases())
def test_manifest_matches_the_kubernetes_schema(manifest: dict[str, Any], version: str) -> None:
    assert kubernetes_validate.validate(manifest, version, strict=True) == version


def test_the_schema_check_rejects_a_misspelt_field() -> None:
    """The validation above is strict and real: a typo in a probe is caught, offline."""
    bad = yaml.safe_load(yaml.safe_dump(BASE["Deployment"]))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5
    with pytest.raises(kubernetes_validate.ValidationError, match="periodSecond"):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)


def test_kustomizations_list_every_manifest() -> None:
    listed = set(kustomization(KUBE)["resources"])
    assert listed == {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml"}
    overlay = kustomization(OVERLAY)
    assert overlay["resources"] == ["../..", "pvc.yaml"] and overlay["patches"] == [{"path": "deployment-patch.yaml"}]
    assert set(BASE) == {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"}
    assert set(WITH_PVC) == set(BASE) | {"PersistentVolumeClaim"}


# -- the manifests against the code -----------------------------------------------------------------------


def test_probes_are_the_servers_routes_on_its_port() -> None:
    routes = {path for path, ops in create_app(Settings()).openapi()["paths"].items() if "get" in ops}
    c = container()
    probes = {kind: c[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {k: p["path"] for k, p in probes.items()} == {
        "startupProbe": "/health/startup", "readinessProbe": "/health/ready", "livenessProbe": "/health/live"}
    assert {p["path"] for p in probes.values()} <= routes
    (port,) = c["ports"]
    assert all(p["port"] == port["name"] for p in probes.values())
    image_port = int(runtime_env()["FOLIO_PORT"])
    assert port["containerPort"] == image_port == int(env()["FOLIO_PORT"])
    assert ("EXPOSE", str(image_port)) in list(stages().values())[-1]
    assert BASE["Service"]["spec"]["ports"][0]["targetPort"] == port["name"]
    scrape = BASE["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert int(scrape["prometheus.io/port"]) == image_port and scrape["prometheus.io/path"] in routes
    # a failed startup or liveness probe restarts the container: startup must allow a slow load
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120


def pod_settings(resources: dict[str, dict[str, Any]]) -> Settings:
    """The server's settings from the container's variables, as the pod's node checks them: --threads is bounded by
    the cores of the machine it runs on, and that node has at least the container's CPU limit."""
    cores = math.ceil(quantity(container(resources)["resources"]["limits"]["cpu"]))
    with mock.patch("os.cpu_count", return_value=cores):
        return Settings(**{k.removeprefix("FOLIO_").lower(): v for k, v in env(resources).items()})


@pytest.mark.parametrize("resources", [BASE, WITH_PVC], ids=["base", "weights-pvc"])
def test_every_variable_is_a_server_setting_with_a_valid_value(resources: dict[str, dict[str, Any]]) -> None:
    fields = {f"FOLIO_{name.upper()}": name for name in Settings.model_fields}
    variables = env(resources)
    assert set(variables) <= set(fields), sorted(set(variables) - set(fields))
    pod_settings(resources)  # raises on a value the server would refuse


def test_service_links_cannot_override_settings() -> None:
    """A Service named folio puts FOLIO_PORT=tcp://<ip>:80 into its namespace's pods unless links are off."""
    links = f"{BASE['Service']['metadata']['name'].upper()}_PORT"
    assert links.removeprefix("FOLIO_").lower() in Settings.model_fields
    assert pod()["enableServiceLinks"] is False


def test_the_pod_runs_as_the_images_user_with_a_read_only_root() -> None:
    runtime = list(stages().values())[-1]
    (user,) = [a for k, a in runtime if k == "USER"]
    uid, gid = (int(x) for x in user.split(":"))
    assert re.search(rf"useradd .*--uid {uid}\b", DOCKERFILE.read_text())
    security = pod()["securityContext"]
    assert (security["runAsUser"], security["runAsGroup"], security["runAsNonRoot"]) == (uid, gid, True)
    c = container()
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    # where the server writes is a volume: /tmp (tempfile, matplotlib's config dir)...
    volumes = {v["name"]: v for v in pod()["volumes"]}
    writable = [m["mountPath"] for m in c["volumeMounts"] if "emptyDir" in volumes[m["name"]]]
    image = runtime_env()
    for path in ("/tmp", image["MPLCONFIGDIR"]):
        assert any(path == w or path.startswith(w + "/") for w in writable), path
    # ...and the CPU kernels are built into the image, where the server only reads them (it builds into
    # FOLIO_KERNEL_DIR, or ~/.cache under the read-only /app, only when they are missing)
    kernels = image["FOLIO_KERNEL_DIR"]
    assert f"FOLIO_KERNEL_DIR={kernels} python -m model.kernels" in DOCKERFILE.read_text()
    assert re.search(rf"COPY --from=kernels {kernels} {kernels}", DOCKERFILE.read_text())


def prestop_sleep(command: list[str]) -> float:
    """The seconds of the preStop hook `python -c "import time; time.sleep(N)"` (and that it is nothing else)."""
    assert command[:2] == ["python", "-c"] and len(command) == 3, command
    module = ast.parse(command[2])
    calls = [n for n in ast.walk(module) if isinstance(n, ast.Call)]
    assert [ast.unparse(c.func) for c in calls] == ["time.sleep"], command
    return float(ast.literal_eval(calls[0].args[0]))


def test_the_drain_finishes_within_the_grace_period() -> None:
    """Kubernetes counts the grace period from the preStop hook; SIGTERM comes after it, then the drain."""
    grace = pod()["terminationGracePeriodSeconds"]
    sleep = prestop_sleep(container()["lifecycle"]["preStop"]["exec"]["command"])
    drain = float(env().get("FOLIO_DRAIN_TIMEOUT", Settings.model_fields["drain_timeout"].default))
    assert sleep >= 1  # endpoints are removed asynchronously: keep serving a moment after the pod is deleted
    assert sleep + drain + UVICORN_EXTRA_SECONDS + ENGINE_JOIN_SECONDS < grace, (sleep, drain, grace)


def memory_needed(config: GPTConfig, max_batch_size: int) -> int:
    """Bytes a CPU fp32 server needs: the weights, the kernels' packed copy of the linear weights, the KV cache
    (2 x n_layer x rows x block_size x n_embd floats) and the runtime (deploy/kubernetes/deployment.yaml)."""
    with torch.device("meta"):
        model = GPT(config)
    weights = sum(p.numel() for p in model.parameters()) * 4
    packed = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)) * 4
    kv_cache = 2 * config.n_layer * max_batch_size * config.block_size * config.n_embd * 4
    return weights + packed + kv_cache + RUNTIME_OVERHEAD_BYTES


@pytest.mark.parametrize(("resources", "config"), [
    (BASE, GPTConfig(**read_config(REPO / "weights" / "shakespeare-char")["model"])),
    (WITH_PVC, GPT2_SMALL),
], ids=["base: bundled shakespeare-char", "weights-pvc: GPT-2 small"])
def test_resources_fit_the_model(resources: dict[str, dict[str, Any]], config: GPTConfig) -> None:
    r = container(resources)["resources"]
    assert r["requests"] == r["limits"]  # the Guaranteed QoS class
    settings = pod_settings(resources)
    assert quantity(r["limits"]["memory"]) >= memory_needed(config, settings.max_batch_size)
    # the kernels' spinning pool (torch's thread count) fits under the CPU limit with a core to spare
    assert 1 <= settings.threads <= math.floor(quantity(r["limits"]["cpu"])) - 1


def test_memory_arithmetic_matches_the_comment() -> None:
    """deployment.yaml's comment gives the KV cache of both models; the same formula gives the same figures."""
    comment = (KUBE / "deployment.yaml").read_text()
    assert "2 x 6 x 16 x 128 x 192 x 4 B = 18 MiB" in comment
    assert "2 x 12 x 16 x 1024 x 768 x 4 B = 1152 MiB" in comment
    bundled = GPTConfig(**read_config(REPO / "weights" / "shakespeare-char")["model"])
    for config, mib in ((bundled, 18), (GPT2_SMALL, 1152)):
        assert 2 * config.n_layer * 16 * config.block_size * config.n_embd * 4 == mib * 2**20


def test_the_overlay_serves_the_volume_the_entrypoint_reads() -> None:
    entrypoint = (REPO / "docker" / "entrypoint.sh").read_text()
    volume = re.search(r'volume="\$\{FOLIO_WEIGHTS_VOLUME:-([^}]+)\}"', entrypoint).group(1)
    mounts = {m["name"]: m for m in container(WITH_PVC)["volumeMounts"]}
    assert mounts["weights"]["mountPath"] == volume and mounts["weights"]["readOnly"] is True
    claim = {v["name"]: v for v in pod(WITH_PVC)["volumes"]}["weights"]["persistentVolumeClaim"]
    pvc = WITH_PVC["PersistentVolumeClaim"]
    assert claim["claimName"] == pvc["metadata"]["name"] and pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert "FOLIO_CHECKPOINT" not in env(WITH_PVC)  # it would override the volume


def test_selectors_match_the_pods() -> None:
    labels = BASE["Deployment"]["spec"]["template"]["metadata"]["labels"]
    selectors = [BASE["Deployment"]["spec"]["selector"]["matchLabels"], BASE["Service"]["spec"]["selector"],
                 BASE["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
                 *(c["labelSelector"]["matchLabels"] for c in pod()["topologySpreadConstraints"])]
    for selector in selectors:
        assert selector.items() <= labels.items(), selector


def test_the_autoscaler_reads_the_adapters_metric_from_exported_series(exported_metric_names: set[str]) -> None:
    hpa, deployment = BASE["HorizontalPodAutoscaler"]["spec"], BASE["Deployment"]
    target = hpa["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        deployment["apiVersion"], deployment["kind"], deployment["metadata"]["name"])
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    # scale out before requests queue: the target is below the running batch's size
    assert 0 < quantity(metric["pods"]["target"]["averageValue"]) < int(env()["FOLIO_MAX_BATCH_SIZE"])
    # voluntary disruptions leave one pod serving
    assert hpa["minReplicas"] > BASE["PodDisruptionBudget"]["spec"]["maxUnavailable"] >= 1
    # the adapter's rule (prometheus-community/prometheus-adapter chart values) serves that metric per pod
    values = documents(ADAPTER)[0]
    (rule,) = values["rules"]["custom"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    series = metric_names(rule["seriesQuery"])
    assert len(series) == 1 and re.fullmatch(rule["name"]["matches"], next(iter(series)))
    assert "<<.LabelMatchers>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
    read = series | metric_names(rule["metricsQuery"])
    assert read == {"folio_running_batch_size", "folio_queue_depth"} and read <= exported_metric_names
