"""Render a kustomization in Python: the subset of kustomize these manifests use, so CI needs no kustomize binary.

    python deploy/kubernetes/render.py deploy/kubernetes/overlays/cpu > cpu.yaml

Supported fields: resources (files and kustomization directories), components, patches (JSON 6902 operations from a
file or inline, targeted by kind, current name and labelSelector), namePrefix/nameSuffix (on metadata.name only: no
references are rewritten, so use them only where nothing refers to the renamed object), images (newName, newTag)
and replicas. Any other field is refused, so a kustomization that outgrows this renderer fails loudly; where
kubectl is installed, tests/deploy compares this output with `kubectl kustomize`.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]
KNOWN_FIELDS = {"apiVersion", "kind", "resources", "components", "patches", "namePrefix", "nameSuffix", "images",
                "replicas"}


class RenderError(ValueError):
    pass


def render(path: Path) -> list[Resource]:
    """The resources that `kubectl kustomize path` prints, in the order their files name them."""
    return _build(Path(path), is_component=False, inherited=[])


def render_text(path: Path) -> str:
    return yaml.safe_dump_all(render(path), sort_keys=False)


def _build(root: Path, is_component: bool, inherited: list[Resource]) -> list[Resource]:
    kustomization = _kustomization(root)
    expected = "Component" if is_component else "Kustomization"
    if kustomization.get("kind", "Kustomization") != expected:
        raise RenderError(f"{root}: a {kustomization.get('kind')} where a {expected} belongs")
    resources = inherited
    for entry in kustomization.get("resources", []):
        resources = resources + _load(root / entry)
    for entry in kustomization.get("components", []):
        resources = _build(root / entry, is_component=True, inherited=resources)
    for patch in kustomization.get("patches", []):
        _apply_patch(root, patch, resources)
    for resource in resources:
        for image in kustomization.get("images", []):
            _set_image(resource, image)
        for replicas in kustomization.get("replicas", []):  # NOTE: by the name before this level's prefix/suffix
            if resource["metadata"]["name"] == replicas["name"] and "replicas" in resource.get("spec", {}):
                resource["spec"]["replicas"] = replicas["count"]
        _rename(resource, kustomization.get("namePrefix", ""), kustomization.get("nameSuffix", ""))
    return resources


def _kustomization(root: Path) -> dict[str, Any]:
    path = root / "kustomization.yaml"
    if not path.is_file():
        raise RenderError(f"{root}: no kustomization.yaml")
    kustomization = yaml.safe_load(path.read_text()) or {}
    unknown = set(kustomization) - KNOWN_FIELDS
    if unknown:
        raise RenderError(f"{path}: this renderer does not support {sorted(unknown)}")
    return kustomization


def _load(path: Path) -> list[Resource]:
    if path.is_dir():
        return _build(path, is_component=False, inherited=[])
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _apply_patch(root: Path, patch: dict[str, Any], resources: list[Resource]) -> None:
    text = (root / patch["path"]).read_text() if "path" in patch else patch["patch"]
    operations = yaml.safe_load(text)
    if not isinstance(operations, list):
        raise RenderError(f"{root}: only JSON 6902 patches (a list of operations) are supported")
    targets = [r for r in resources if _matches(r, patch.get("target", {}))]
    if not targets:
        raise RenderError(f"{root}: patch {patch.get('path', '(inline)')} matches no resource")
    for resource in targets:
        for operation in operations:
            apply_operation(resource, operation)


def _matches(resource: Resource, target: dict[str, Any]) -> bool:
    metadata = resource["metadata"]
    if "kind" in target and resource["kind"] != target["kind"]:
        return False
    if "name" in target and metadata["name"] != target["name"]:
        return False
    if "labelSelector" in target:
        labels = metadata.get("labels", {})
        for term in target["labelSelector"].split(","):
            key, value = term.split("=")
            if labels.get(key.strip()) != value.strip():
                return False
    return True


def apply_operation(doc: Resource, operation: dict[str, Any]) -> None:
    """One JSON 6902 operation (add, replace, remove, test) applied in place."""
    *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in operation["path"].split("/")[1:]]
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    op = operation["op"]
    if op == "test":
        current = node[int(last)] if isinstance(node, list) else node.get(last)
        if current != operation["value"]:
            raise RenderError(f"test failed at {operation['path']}: {current!r} != {operation['value']!r}")
    elif op == "add" and isinstance(node, list):
        value = copy.deepcopy(operation["value"])
        node.append(value) if last == "-" else node.insert(int(last), value)
    elif op in ("add", "replace"):
        if op == "replace" and (last not in node if isinstance(node, dict) else int(last) >= len(node)):
            raise RenderError(f"replace of a missing {operation['path']}")
        node[int(last) if isinstance(node, list) else last] = copy.deepcopy(operation["value"])
    elif op == "remove":
        del node[int(last) if isinstance(node, list) else last]
    else:
        raise RenderError(f"unsupported patch operation {op!r}")


def _rename(resource: Resource, prefix: str, suffix: str) -> None:
    if prefix or suffix:
        resource["metadata"]["name"] = prefix + resource["metadata"]["name"] + suffix


def _set_image(resource: Resource, image: dict[str, str]) -> None:
    for container in pod_containers(resource):
        name, _, tag = container["image"].partition(":")
        if name == image["name"]:
            tag = image.get("newTag", tag)
            container["image"] = image.get("newName", name) + (f":{tag}" if tag else "")


def pod_containers(resource: Resource) -> list[dict[str, Any]]:
    """The containers of a workload's pod template (none for other kinds)."""
    pod = resource.get("spec", {}).get("template", {}).get("spec", {})
    return pod.get("initContainers", []) + pod.get("containers", [])


def workloads(resources: list[Resource]) -> list[Resource]:
    """The Deployments and StatefulSets: what runs pods."""
    return [r for r in resources if r["kind"] in ("Deployment", "StatefulSet")]


def container_env(container: dict[str, Any], fields: dict[str, str], secrets: dict[tuple[str, str], str]
                  ) -> dict[str, str]:
    """A container's environment as the kubelet builds it: fieldRef values from fields (e.g. status.podIP),
    secretKeyRef values from secrets[(name, key)], and $(VAR) replaced by variables defined before it."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _expand(var["value"], env)
        elif "fieldRef" in var.get("valueFrom", {}):
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = secrets[(ref["name"], ref["key"])]
    return env


def _expand(value: str, env: dict[str, str]) -> str:
    for name, defined in env.items():
        value = value.replace(f"$({name})", defined)
    return value


if __name__ == "__main__":
    sys.stdout.write(render_text(Path(sys.argv[1])))
