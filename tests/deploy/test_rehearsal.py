"""The cpu overlay rehearsed as local processes (deploy/kubernetes/rehearse.py): exactly its commands and
environments over TCP, a worker pod deleted while it runs requests and a scheduler replica killed -9 mid-load,
and nothing lost."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.deploy.manifests import KUBE  # noqa: F401  (puts deploy/kubernetes on sys.path)

import rehearse  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_cpu_overlay_survives_a_deleted_worker_and_a_killed_scheduler(tmp_path: Path) -> None:
    report = rehearse.rehearse("cpu", tmp_path, num_requests=24, concurrency=6, max_tokens=48)
    print(json.dumps(report, indent=1))  # shown when an assertion fails, with the pods' logs left in tmp_path
    faults = report["faults"]
    assert faults["its_running_requests"] >= 1  # the worker was deleted with requests on it
    assert faults["worker_exit"] == {"worker": 0}  # it drained them and stopped cleanly
    assert faults["killed_scheduler"] == "radixserve-scheduler-1"
    assert report["load"] == {"num_requests": 24, "num_complete": 24, "statuses": [200] * 24, "failures": []}
    after = report["after"]
    originals = {"radixserve-worker-rehearsal-00000", "radixserve-worker-rehearsal-00001"}
    assert faults["deleted_worker"] in originals
    [survivor] = originals - {faults["deleted_worker"]}
    assert faults["replacement_worker"] == "radixserve-worker-rehearsal-00002"
    assert after["workers"] == [survivor, faults["replacement_worker"]]
    assert after["load"] == {"num_requests": 8, "num_complete": 8, "statuses": [200] * 8, "failures": []}
    assert after["schedulers"] == {name: "scheduler ok: 2 workers, 0 queued, 0 in flight"
                                   for name in ("radixserve-scheduler-0", "radixserve-scheduler-1")}
    assert report["exit_codes"] == {
        "radixserve-frontend-rehearsal-00000": {"gateway": 0, "tokenizer": 0},
        "radixserve-frontend-rehearsal-00001": {"gateway": 0, "tokenizer": 0},
        survivor: {"worker": 0},
        "radixserve-worker-rehearsal-00002": {"worker": 0},
        "radixserve-cache-index-rehearsal-00000": {"cache-index": 0},
        "radixserve-scheduler-0": {"scheduler": 0},
        "radixserve-scheduler-1": {"scheduler": 0},
        "radixserve-redis-0": {"redis": 0},
    }
    drained = (tmp_path / faults["deleted_worker"] / "worker.log").read_text()
    assert '"event": "draining"' in drained and "drain timeout" not in drained
    assert rehearse.is_green(report)
