"""deploy/kubernetes/ against the schemas: the core kinds (Deployment, Service, HPA, ConfigMap) with the Kubernetes
JSON schemas that the kubernetes-validate package ships (strict: unknown fields are errors, as kubeconform -strict);
the custom resources (KubeRay's RayService, KEDA's ScaledObject) with their CRDs' schemas vendored small in
tests/data/crd-schemas (scripts/vendor_crd_schema.py), their pod templates with the Kubernetes PodTemplate schema.
Beyond the schemas: the container's arguments are `muxd serve` flags, the RayService's Serve application is `muxd
cluster` with flags it takes, the autoscalers target the Deployment on a metric muxd exports, the SLO parses."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from appliance.cluster.settings import ClusterSettings
from appliance.config import Config
from appliance.config_flags import parse_serve_args
from appliance.slo.contract import parse_contract

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (test extra)")

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "deploy" / "kubernetes"
SCHEMAS = Path(__file__).resolve().parent / "data" / "crd-schemas"
K8S_VERSION = "1.33.0"
CRDS = {("ray.io/v1", "RayService"): "rayservice-ray.io-v1.json",
        ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda.sh-v1alpha1.json"}


def _docs() -> list[tuple[str, dict]]:
    return [(path.name, doc) for path in sorted(MANIFESTS.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def _strict(schema):
    """kubeconform's -strict: an object schema that lists its properties rejects any other."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out and not out.get("x-pod-template"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _pod_templates(node, path=""):
    """(where, template) of every pod template inside a custom resource."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "template" and isinstance(value, dict) and "spec" in value:
                yield f"{path}.{key}", value
            else:
                yield from _pod_templates(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _pod_templates(value, f"{path}[{i}]")


def _by_kind(kind: str) -> dict:
    [doc] = [d for _, d in _docs() if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("name, doc", _docs(), ids=lambda v: v if isinstance(v, str) else v.get("kind"))
def test_every_manifest_matches_its_schema(name, doc):
    key = (doc["apiVersion"], doc["kind"])
    if key in CRDS:
        schema = _strict(json.loads((SCHEMAS / CRDS[key]).read_text()))
        jsonschema.validate(doc, schema, cls=jsonschema.Draft7Validator)
        for where, template in _pod_templates(doc["spec"]):
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": where},
                                          "template": template}, K8S_VERSION, strict=True)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validators_catch_mistakes():
    service = _by_kind("Service")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({**service, "spec": {**service["spec"], "prots": []}}, K8S_VERSION, strict=True)
    ray = _by_kind("RayService")
    schema = _strict(json.loads((SCHEMAS / CRDS[("ray.io/v1", "RayService")]).read_text()))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**ray, "spec": {**ray["spec"], "serveConfigV3": ""}}, schema)


def test_the_deployment_runs_muxd_serve_with_flags_it_takes():
    deployment = _by_kind("Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    config = parse_serve_args(container["args"])
    assert config.model.model.startswith("/models/") and config.server.shutdown_timeout < \
        deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    probes = {container[p]["httpGet"]["path"] for p in ("livenessProbe", "readinessProbe")}
    assert probes == {"/health", "/ready"}
    parse_contract(_by_kind("ConfigMap")["data"]["slo.yaml"], "deploy/kubernetes/deployment.yaml")


def test_the_autoscalers_target_the_deployment_on_the_queue_muxd_exports():
    from appliance.server.metrics import Metrics

    exported = Metrics("m").render({}).decode()
    assert "vllm:num_requests_waiting{" in exported
    hpa, keda = _by_kind("HorizontalPodAutoscaler"), _by_kind("ScaledObject")
    for scaler in (hpa, keda):
        assert scaler["spec"]["scaleTargetRef"]["name"] == _by_kind("Deployment")["metadata"]["name"]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    assert "vllm:num_requests_waiting" in keda["spec"]["triggers"][0]["metadata"]["query"]


def test_the_rayservice_serves_muxd_cluster_with_flags_it_takes():
    serve_config = yaml.safe_load(_by_kind("RayService")["spec"]["serveConfigV2"])
    [app] = serve_config["applications"]
    module, _, name = app["import_path"].partition(":")
    assert (module, name) == ("appliance.cluster.deploy", "app_builder")
    cluster_fields = {f.name for f in dataclasses.fields(ClusterSettings)}
    settings = ClusterSettings(**{k: v for k, v in app["args"].items() if k in cluster_fields})
    engine = Config.flat(**{k: v for k, v in app["args"].items() if k not in cluster_fields})
    assert settings.autoscaling and settings.router == "slo" and engine.model.model.startswith("/models/")
    workers = _by_kind("RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert max(w["maxReplicas"] for w in workers) >= settings.max_count  # room for every replica's GPU
