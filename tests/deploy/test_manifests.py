"""deploy/ checked offline: every Kubernetes overlay renders (in Python, and equal to `kubectl kustomize` where
kubectl exists) and validates against the Kubernetes schemas; docker-compose.yml validates against the compose spec;
and both agree with the code: each RADIXSERVE_* variable is a real config field whose value the config accepts,
each address a service connects to is a port its peer binds, declares and lets in, and each metric an autoscaler
reads is one that /metrics serves."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import check_jsonschema
import jsonschema
import kubernetes_validate
import pytest
import yaml

from shared.config import load_config
from tests.deploy.manifests import (FAKE_FIELDS, KUBE, OVERLAYS, ROOT, Container, bound_ports, config_class,
                                    connect_addresses, containers, host_port, render, render_overlay)

K8S_VERSIONS = ("1.28.0", "1.37.0")  # the oldest Kubernetes these manifests claim (docs/DEPLOY.md), the newest
LOOPBACK = ("127.0.0.1", "localhost")
WILDCARD = "0.0.0.0"
# Reply paths: addresses a service advertises in its messages (bound at the pod's own IP), and who sends there.
ADVERTISED_TO = {"stream_addr": ("worker", "scheduler"), "worker_addr": ("scheduler", "cache-index", "worker"),
                 "transfer_addr": ("worker",), "cache_index_addr": ("worker",)}


def component(labels: dict[str, str]) -> str:
    return labels["app.kubernetes.io/component"]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render_overlay(request.param)


def test_every_overlay_renders_and_validates_against_the_kubernetes_schemas(overlay) -> None:
    name, resources = overlay
    assert {r["kind"] for r in resources} == {"Deployment", "HorizontalPodAutoscaler", "NetworkPolicy",
                                              "PodDisruptionBudget", "Service", "StatefulSet"}, name
    for resource in resources:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(resource, version, strict=True)


def test_a_broken_manifest_fails_the_schema_check() -> None:
    deployment = next(r for r in render_overlay("cpu") if r["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed: the Python render stands alone")
@pytest.mark.parametrize("name", OVERLAYS)
def test_python_render_equals_kubectl_kustomize(name: str) -> None:
    out = subprocess.run(["kubectl", "kustomize", str(KUBE / "overlays" / name)], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    key = lambda r: (r["apiVersion"], r["kind"], r["metadata"]["name"])  # noqa: E731
    assert {key(r): r for r in yaml.safe_load_all(out)} == {key(r): r for r in render_overlay(name)}


def test_the_same_node_cuda_ipc_component_applies_to_both_pd_roles(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [str(KUBE / "overlays" / "pd")], "components": [str(KUBE / "components" / "same-node-cuda-ipc")]}))
    workers = [c for c in containers(render.render(tmp_path)) if c.module == "services.gpu_worker"]
    assert sorted(c.env["RADIXSERVE_ROLE"] for c in workers) == ["decode", "prefill"]
    assert {c.env["RADIXSERVE_HOST_ID"] for c in workers} == {FAKE_FIELDS["spec.nodeName"]}
    assert all(c.workload["spec"]["template"]["spec"]["hostIPC"] for c in workers)


def test_env_vars_are_config_fields_whose_values_the_config_accepts(overlay, monkeypatch) -> None:
    extra = set(re.findall(r'os\.environ\.get\("(RADIXSERVE_[A-Z_]+)"', _source_text()))  # read outside configs
    assert {"RADIXSERVE_LOG_JSON", "RADIXSERVE_CACHE_DIR"} <= extra
    for container in containers(overlay[1]):
        if container.module is None:
            continue
        cls = config_class(container.module)
        for var in container.env:
            if var.startswith("RADIXSERVE_") and var not in extra:
                assert var[len("RADIXSERVE_"):].lower() in cls.__dataclass_fields__, (container.spec["name"], var)
        for var, value in container.env.items():
            monkeypatch.setenv(var, value)
        config = load_config(cls, argv=[])  # parses every value and runs the class's own checks
        for var, value in container.env.items():
            monkeypatch.delenv(var)
            field_name = var[len("RADIXSERVE_"):].lower()
            if var not in extra and var.startswith("RADIXSERVE_") and isinstance(getattr(config, field_name), str):
                assert getattr(config, field_name) == value


def _source_text() -> str:
    return "".join(p.read_text() for d in ("shared", "services", "radixserve") for p in (ROOT / d).rglob("*.py"))


def test_every_bound_port_is_declared_and_loopback_ones_stay_in_the_pod(overlay) -> None:
    for container in containers(overlay[1]):
        if container.module is None:
            continue
        for port, host in bound_ports(container).items():
            if port == 0:
                continue
            if host in LOOPBACK:
                assert port not in container.port_numbers, (container.spec["name"], port)
            else:
                assert host in (WILDCARD, FAKE_FIELDS["status.podIP"]), (container.spec["name"], host)
                assert port in container.port_numbers, (container.spec["name"], port)


def test_every_connect_address_reaches_a_port_its_peer_binds_and_lets_in(overlay) -> None:
    resources = overlay[1]
    all_containers = [c for c in containers(resources) if c.module is not None]
    num_edges = 0
    for container in all_containers:
        for field_name, addr in connect_addresses(container):
            host, port = host_port(addr)
            if host in LOOPBACK:  # a container of the same pod
                peers = [c for c in all_containers if c.workload is container.workload and c is not container]
                assert any(bound_ports(c).get(port) in LOOPBACK for c in peers), (container.spec["name"], addr)
                continue
            targets = _service_targets(resources, host, port)
            assert targets, f"{container.spec['name']}.{field_name}: {addr} names no Service port"
            for target in targets:
                assert _is_allowed(resources, container.pod_labels, target.pod_labels, port), (addr, target)
                if target.module is not None:
                    assert port in bound_ports(target), (addr, target.spec["name"])
            num_edges += 1
    assert num_edges >= 8


def test_advertised_addresses_let_in_every_sender(overlay) -> None:
    resources = overlay[1]
    for container in containers(resources):
        for field_name, senders in ADVERTISED_TO.items():
            if container.module is None or field_name not in type_fields(container):
                continue
            host, port = host_port(container.config_value(field_name))
            if host != FAKE_FIELDS["status.podIP"]:
                continue
            for sender in senders:
                labels = {"app.kubernetes.io/name": "radixserve", "app.kubernetes.io/component": sender}
                assert _is_allowed(resources, labels, container.pod_labels, port), (field_name, sender)


def type_fields(container: Container) -> set[str]:
    return set(config_class(container.module).__dataclass_fields__)


def _service_targets(resources: list[dict[str, Any]], host: str, port: int) -> list[Container]:
    """The containers behind host:port: a Service name, or <pod>.<headless Service> of a StatefulSet."""
    labels = host.split(".")
    services = {r["metadata"]["name"]: r for r in resources if r["kind"] == "Service"}
    service = services.get(labels[-1]) if len(labels) <= 2 else None
    if service is None:
        return []
    if len(labels) == 2:  # one StatefulSet pod by ordinal
        assert service["spec"].get("clusterIP") == "None", host
        sets = [r for r in resources if r["kind"] == "StatefulSet" and r["spec"]["serviceName"] == labels[1]]
        pod, _, ordinal = labels[0].rpartition("-")
        assert sets and pod == sets[0]["metadata"]["name"] and int(ordinal) < sets[0]["spec"]["replicas"], host
    service_port = next((p for p in service["spec"]["ports"] if p["port"] == port), None)
    if service_port is None:
        return []
    selector = service["spec"]["selector"]
    found = []
    for container in containers(resources):
        if selector.items() <= container.pod_labels.items():
            named = {p.get("name"): p["containerPort"] for p in container.spec.get("ports", [])}
            if named.get(service_port["targetPort"]) == port:
                found.append(container)
    return found


def _is_allowed(resources: list[dict[str, Any]], source: dict[str, str], target: dict[str, str], port: int) -> bool:
    """Whether some NetworkPolicy over the target pods lets the source pods in on port."""
    for policy in (r for r in resources if r["kind"] == "NetworkPolicy"):
        if not policy["spec"]["podSelector"]["matchLabels"].items() <= target.items():
            continue
        for rule in policy["spec"].get("ingress", []):
            if port not in [p["port"] for p in rule.get("ports", [])]:
                continue
            peers = rule.get("from")
            if not peers or any("namespaceSelector" in p and "podSelector" not in p for p in peers):
                return True
            if any(p.get("podSelector", {}).get("matchLabels", {}).items() <= source.items() for p in peers):
                return True
    return False


def test_a_pod_without_a_policy_rule_is_refused() -> None:
    resources = render_overlay("cpu")
    redis = {"app.kubernetes.io/name": "radixserve", "app.kubernetes.io/component": "redis"}
    worker = {"app.kubernetes.io/name": "radixserve", "app.kubernetes.io/component": "worker"}
    scheduler = {"app.kubernetes.io/name": "radixserve", "app.kubernetes.io/component": "scheduler"}
    assert _is_allowed(resources, scheduler, redis, 6379)
    assert not _is_allowed(resources, worker, redis, 6379)
    assert not _is_allowed(resources, scheduler, redis, 6380)


def test_grace_periods_cover_the_drains(overlay) -> None:
    for container in containers(overlay[1]):
        if container.module not in ("services.gateway", "services.gpu_worker"):
            continue
        pod = container.workload["spec"]["template"]["spec"]
        pre_stop = container.spec.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        pre_stop_s = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        drain_s = float(container.config_value("drain_timeout_s"))
        assert drain_s >= 10, container.spec["name"]  # a drain is set (the worker's default is none)
        assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + drain_s + 10, container.spec["name"]


def test_the_api_key_comes_from_a_secret_and_gateways_are_ready_only_with_a_worker(overlay) -> None:
    gateway = next(c for c in containers(overlay[1]) if c.module == "services.gateway")
    keys = next(v for v in gateway.spec["env"] if v["name"] == "RADIXSERVE_API_KEYS")
    assert keys["valueFrom"]["secretKeyRef"] == {"name": "radixserve-api-keys", "key": "api-keys"}
    assert gateway.spec["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def test_autoscalers_read_metrics_that_metrics_serves() -> None:
    served = _served_metric_names()
    adapter = yaml.safe_load((KUBE / "autoscaling" / "prometheus-adapter-rules.yaml").read_text())
    rules = yaml.safe_load(adapter["data"]["config.yaml"])["externalRules"]
    external = {rule["name"]["as"] for rule in rules}
    for rule in rules:
        assert set(re.findall(r"radixserve_[a-z_]+", rule["metricsQuery"] + rule["seriesQuery"])) <= served
    hpa_metrics = {m["external"]["metric"]["name"] for name in OVERLAYS for r in render_overlay(name)
                   if r["kind"] == "HorizontalPodAutoscaler" for m in r["spec"]["metrics"] if m["type"] == "External"}
    assert hpa_metrics == external == {"radixserve_waiting_requests", "radixserve_worker_kv_usage",
                                       "radixserve_prefill_waiting_requests"}
    kubernetes_validate.validate(adapter, K8S_VERSIONS[-1], strict=True)
    keda = yaml.safe_load((KUBE / "autoscaling" / "keda-scaledobject.yaml").read_text())
    gpu_deployments = {r["metadata"]["name"] for r in render_overlay("gpu") if r["kind"] == "Deployment"}
    assert keda["spec"]["scaleTargetRef"]["name"] in gpu_deployments
    assert {n for t in keda["spec"]["triggers"] for n in re.findall(r"radixserve_[a-z_]+", t["metadata"]["query"])
            } <= served
    docs = (ROOT / "docs" / "DEPLOY.md").read_text()
    assert set(re.findall(r"\bradixserve_[a-z_]+", docs)) - external - {"radixserve_scheduler_dropped_messages"} \
        <= served | {n + "_total" for n in served}


def _served_metric_names() -> set[str]:
    """The metric families the gateway and scheduler registries define (the scheduler's include its workers')."""
    text = "".join((ROOT / "services" / name).read_text() for name in
                   ("scheduler/metrics.py", "scheduler/service.py", "gateway/metrics.py"))
    names = set(re.findall(r'"(radixserve_[a-z_]+)"', text))
    names |= {"radixserve_gateway_" + n for n in re.findall(r'Counter\(prefix \+ "([a-z_]+)"', text)}
    names |= {"radixserve_gateway_" + n for n in re.findall(r'(?:Gauge|Histogram)\(prefix \+ "([a-z_]+)"', text)}
    assert {"radixserve_num_requests_waiting", "radixserve_kv_cache_usage_perc",
            "radixserve_scheduler_queued_requests", "radixserve_gateway_requests_in_flight"} <= names
    return names


def _compose_schema() -> dict[str, Any]:
    path = Path(check_jsonschema.__file__).parent / "builtin_schemas" / "vendor" / "compose-spec.json"
    return json.loads(path.read_text())


def test_docker_compose_validates_against_the_compose_spec() -> None:
    schema = _compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema, format_checker=jsonschema.FormatChecker())
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert [e.message for e in validator.iter_errors(compose)] == []
    compose["services"]["gateway"]["port"] = ["8000:8000"]  # a misspelt key is caught
    assert [e.message for e in validator.iter_errors(compose)] != []


def test_docker_compose_env_vars_are_config_fields_and_addresses_name_services() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    for name, service in services.items():
        command = service.get("command", "").split()
        if command[:2] != ["python", "-m"]:
            continue
        cls = config_class(command[2])
        for var, value in service.get("environment", {}).items():
            field_name = var[len("RADIXSERVE_"):].lower()
            assert field_name in cls.__dataclass_fields__, (name, var)
            if field_name.endswith(("_addrs", "_url")) or (field_name.endswith("_addr") and "0.0.0.0" not in value):
                for addr in value.split(","):
                    host, port = host_port(addr)
                    peer = services[host]
                    peer_env = " ".join(str(v) for v in peer.get("environment", {}).values())
                    assert host == "redis" or f"0.0.0.0:{port}" in peer_env, (name, var, addr)
