"""The Kubernetes manifests in deploy/kubernetes/ against schemas (nothing is applied; no cluster here):
- built-in kinds (Deployment, Service, and the pod templates inside the RayService) against Kubernetes' own JSON
  schemas in strict mode (kubernetes-validate: an unknown or misspelled field is an error);
- the RayService's own fields against the KubeRay ray.io/v1 fields it may use (listed below), its serveConfigV2
  against Ray Serve's config schema (unknown keys rejected), and its application args through our builder (the
  `tokenspout serve` flag parser).
Each check is also shown failing on a broken copy."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="requirements-ray.txt is not installed")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
K8S_VERSION = "1.33.0"

# KubeRay v1 (ray.io/v1) RayService fields, from its CRD: the ones a manifest here may use.
RAYSERVICE_FIELDS: dict[str, set[str]] = {
    "": {"apiVersion", "kind", "metadata", "spec"},
    "spec": {"serveConfigV2", "rayClusterConfig", "serviceUnhealthySecondThreshold",
             "deploymentUnhealthySecondThreshold", "serveService", "upgradeStrategy", "excludeHeadPodFromServeSvc"},
    "spec.rayClusterConfig": {"rayVersion", "enableInTreeAutoscaling", "autoscalerOptions", "headGroupSpec",
                              "workerGroupSpecs", "headServiceAnnotations", "suspend", "gcsFaultToleranceOptions"},
    "spec.rayClusterConfig.headGroupSpec": {"rayStartParams", "template", "serviceType", "headService",
                                            "enableIngress"},
    "spec.rayClusterConfig.workerGroupSpecs[]": {"groupName", "replicas", "minReplicas", "maxReplicas",
                                                 "rayStartParams", "template", "scaleStrategy", "numOfHosts",
                                                 "idleTimeoutSeconds", "suspend"},
}


def load(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def validate_k8s(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def pod_template(template: dict[str, Any]) -> dict[str, Any]:
    """A pod template as the built-in PodTemplate kind, so Kubernetes' schema checks it."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}


def check_rayservice_fields(doc: dict[str, Any]) -> None:
    def walk(node: Any, path: str) -> None:
        allowed = RAYSERVICE_FIELDS.get(path)
        if allowed is None or not isinstance(node, dict):
            return
        unknown = set(node) - allowed
        if unknown:
            raise ValueError(f"{path or 'RayService'}: unknown field(s) {sorted(unknown)}")
        for key, value in node.items():
            child = f"{path}.{key}" if path else key
            for item in value if isinstance(value, list) else [value]:
                walk(item, child + "[]" if isinstance(value, list) else child)

    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayService"
    walk(doc, "")


def check_serve_config(text: str) -> None:
    """serveConfigV2 as Ray Serve reads it (its pydantic schema ignores unknown keys: rejected here), and each
    application built from its args (our flag parser rejects unknown ones)."""
    pytest.importorskip("ray")
    from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

    from tokenspout.entrypoints import ray_serve

    raw = yaml.safe_load(text)
    config = ServeDeploySchema.model_validate(raw)
    for data, schema in [(raw, ServeDeploySchema), *((a, ServeApplicationSchema) for a in raw["applications"])]:
        unknown = set(data) - set(schema.model_fields)
        if unknown:
            raise ValueError(f"serveConfigV2: unknown key(s) {sorted(unknown)}")
    for application in config.applications:
        module, _, attr = application.import_path.partition(":")
        assert module == ray_serve.__name__ and attr == "app"
        ray_serve.app(application.args)  # builds the Serve application (no cluster needed)


def test_deployment_and_service_match_kubernetes_schema():
    docs = load("tokenspout.yaml")
    assert [d["kind"] for d in docs] == ["Deployment", "Service"]
    for doc in docs:
        validate_k8s(doc)
    container = docs[0]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:2] == ["tokenspout", "serve"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    # The kubelet's SIGKILL must come after the drain deadline and the engine's stop (deadline + ~5 s).
    command = container["command"]
    shutdown_timeout = float(command[command.index("--shutdown-timeout") + 1]) if "--shutdown-timeout" in command \
        else 30.0
    assert docs[0]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= shutdown_timeout + 10


def test_a_misspelled_field_is_rejected():
    deployment = load("tokenspout.yaml")[0]
    broken = copy.deepcopy(deployment)
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        validate_k8s(broken)
    broken = copy.deepcopy(deployment)
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_k8s(broken)


def test_rayservice_fields_pod_templates_and_serve_config():
    (doc,) = load("rayservice.yaml")
    check_rayservice_fields(doc)
    cluster = doc["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        validate_k8s(pod_template(group["template"]))
    check_serve_config(doc["spec"]["serveConfigV2"])


def test_rayservice_checks_fail_on_broken_copies():
    (doc,) = load("rayservice.yaml")
    broken = copy.deepcopy(doc)
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 4
    with pytest.raises(ValueError, match="maxReplica"):
        check_rayservice_fields(broken)
    template = copy.deepcopy(doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"])
    template["spec"]["containers"][0]["resource"] = template["spec"]["containers"][0].pop("resources")
    with pytest.raises(kubernetes_validate.ValidationError, match="resource"):
        validate_k8s(pod_template(template))
    serve_config = doc["spec"]["serveConfigV2"]
    with pytest.raises(ValueError, match="import_path"):  # a required key misspelled: Ray's schema says so
        check_serve_config(serve_config.replace("import_path", "import_pth"))
    with pytest.raises(ValueError, match="route_prefx"):  # an optional one: Ray's schema would ignore it
        check_serve_config(serve_config.replace("route_prefix", "route_prefx"))
    with pytest.raises(SystemExit):  # an unknown `tokenspout serve` flag in the args
        check_serve_config(serve_config.replace("num_threads", "num_thread"))
