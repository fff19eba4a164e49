"""The deploy/ files as the tests read them: rendered overlays, each container's service and config class, and the
addresses its environment binds and connects to."""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu", "pd")
sys.path.insert(0, str(KUBE))

import render  # noqa: E402  (deploy/kubernetes/render.py, a script beside the manifests)

CONFIG_CLASSES = {  # `python -m <module>` → its one config class
    "services.gateway": "services.gateway.config:GatewayConfig",
    "services.tokenizer": "services.tokenizer.config:TokenizerConfig",
    "services.scheduler": "services.scheduler.config:SchedulerConfig",
    "services.cache_index": "services.cache_index.config:CacheIndexConfig",
    "services.gpu_worker": "services.gpu_worker.config:WorkerConfig",
}
# Config fields that a service binds (it listens there); every other *_addr(s) / redis_url field connects.
BIND_FIELDS = {"services.gateway": ("port",), "services.tokenizer": ("tokenizer_addr", "stream_addr"),
               "services.scheduler": ("scheduler_addr", "metrics_port"), "services.cache_index": ("cache_index_addr",),
               "services.gpu_worker": ("worker_addr", "transfer_addr")}
FAKE_FIELDS = {"status.podIP": "10.0.0.7", "metadata.name": "pod-0", "spec.nodeName": "node-1"}
FAKE_SECRETS = {("radixserve-api-keys", "api-keys"): "sk-test"}


def render_overlay(name: str) -> list[dict[str, Any]]:
    return render.render(KUBE / "overlays" / name)


def config_class(module: str) -> type:
    path, _, name = CONFIG_CLASSES[module].partition(":")
    return getattr(importlib.import_module(path), name)


@dataclass(frozen=True)
class Container:
    """One container of a workload's pod template, with its environment as the kubelet would build it."""

    workload: dict[str, Any]
    spec: dict[str, Any]
    env: dict[str, str]

    @property
    def module(self) -> str | None:
        command = self.spec.get("command", [])
        return command[2] if command[:2] == ["python", "-m"] else None

    @property
    def pod_labels(self) -> dict[str, str]:
        return self.workload["spec"]["template"]["metadata"]["labels"]

    @property
    def port_numbers(self) -> set[int]:
        return {port["containerPort"] for port in self.spec.get("ports", [])}

    def config_value(self, field_name: str) -> Any:
        """The field's value from the environment, else the config class's default."""
        cls = config_class(self.module)
        default = next(f.default for f in cls.__dataclass_fields__.values() if f.name == field_name)
        return self.env.get("RADIXSERVE_" + field_name.upper(), default)


def containers(resources: list[dict[str, Any]]) -> list[Container]:
    return [Container(w, c, render.container_env(c, FAKE_FIELDS, FAKE_SECRETS))
            for w in render.workloads(resources) for c in w["spec"]["template"]["spec"]["containers"]]


def host_port(addr: str) -> tuple[str, int]:
    """tcp://host:port or redis://host:port/db → (host, port)."""
    parts = urlsplit(addr)
    return parts.hostname, parts.port


def bound_ports(container: Container) -> dict[int, str]:
    """port → the bind host of every address the container's service listens on."""
    bound = {}
    for field_name in BIND_FIELDS[container.module]:
        value = container.config_value(field_name)
        if field_name == "port":
            bound[int(value)] = container.config_value("host")
        elif field_name == "metrics_port":
            if int(value):
                bound[int(value)] = container.config_value("metrics_host")
        else:
            host, port = host_port(value)
            bound[port] = host
    return bound


def connect_addresses(container: Container) -> list[tuple[str, str]]:
    """(field, address) for every peer the container's service connects to."""
    cls = config_class(container.module)
    out = []
    for name in cls.__dataclass_fields__:
        if name in BIND_FIELDS[container.module] or not (name.endswith(("_addr", "_addrs")) or name == "redis_url"):
            continue
        for addr in str(container.config_value(name)).split(","):
            if addr.strip():
                out.append((name, addr.strip()))
    return out
