"""The Kubernetes driver against a real cluster, when one is given: ``TENSORA_TEST_KUBECONFIG`` names
its kubeconfig (and ``TENSORA_TEST_KUBE_NAMESPACE`` an existing namespace to use, default
``tensora-test``). Skipped otherwise, with the reason printed: no cluster can run on the machines
this project is built on. Only a small CPU notebook is made, and it is deleted at the end."""

from __future__ import annotations

import os
import time

import pytest

from tensora.config.catalog import default_catalog
from tensora.drivers.base import ReplicaSpec
from tensora.placement.kinds import ReplicaState, WorkloadKind

KUBECONFIG = os.environ.get("TENSORA_TEST_KUBECONFIG")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not KUBECONFIG, reason="TENSORA_TEST_KUBECONFIG is not set: no real cluster to run the live suite against")]


def test_a_cpu_notebook_runs_on_a_real_cluster_and_goes_away() -> None:
    from tensora.drivers.kubernetes.driver import connect

    assert KUBECONFIG is not None
    namespace = os.environ.get("TENSORA_TEST_KUBE_NAMESPACE", "tensora-test")
    catalog = default_catalog()
    first = connect(KUBECONFIG, catalog, os.environ.get("TENSORA_TEST_KUBE_REGION", "local"), namespace)
    try:
        nodes = [n for n in first.nodes() if n.schedulable]
        assert nodes, "the cluster offers no schedulable node in this region"
        target = max(nodes, key=lambda n: n.cpu)
        spec = ReplicaSpec(f"rp_live{int(time.time())}", "wl_live", WorkloadKind.NOTEBOOK, "cpu-1c-4g", target.name,
                           owner="tensora-live-test")
        first.start(spec)
        deadline = time.monotonic() + 300
        while True:
            seen = {s.id: s for s in first.observe()}.get(spec.id)
            assert seen is not None and seen.state is not ReplicaState.FAILED, seen
            if seen.state is ReplicaState.RUNNING:
                break
            assert time.monotonic() < deadline, f"not running within 300 s: {seen}"
            time.sleep(3)
        first.stop(spec.id)
        deadline = time.monotonic() + 120
        while spec.id in {s.id for s in first.observe()}:
            assert time.monotonic() < deadline, "still there 120 s after stop"
            time.sleep(3)
        first.release(spec.workload_id)  # the home claim, which outlives the replica
    finally:
        first.close()
