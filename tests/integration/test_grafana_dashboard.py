"""deploy/grafana/tensora.json and the scrape configuration: the dashboard's queries name only metrics the
code exports (every family of the gateway's, the control API's and the controller's collectors), are valid PromQL
(``promtool check rules``, where Debian's prometheus package gives it), and show what an operator
watches (fallbacks, placement times, queues, failovers, breakers, TTFT, the usage spool); the kustomize base
exposes a metrics port on every Tensora Service and pod, and the optional ServiceMonitor builds."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tensora.api.metrics import REGISTRY
from tensora.control.metrics import ControllerCollector, ControllerMetrics
from tensora.gateway.limits import MemoryLimiter
from tensora.gateway.metering import Meter
from tensora.gateway.metrics import GatewayCollector, GatewayMetrics
from tensora.gateway.proxy import Gateway, Options
from tensora.gateway.routes import RouteTable

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "tensora.json"
NAME = re.compile(r"\btensora_[a-z0-9_]+\b")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


async def _nothing(records: list[bytes]) -> bool:
    return True


def exported(tmp_path: Path) -> set[str]:
    """Every series name the three processes' collectors can expose."""
    gw = Gateway(Options(), RouteTable, MemoryLimiter(), Meter(tmp_path / "spool", _nothing), probe_interval_s=2.0)
    families = [*GatewayCollector(gw, GatewayMetrics(), gw.clock).collect(),
                *ControllerCollector(ControllerMetrics()).collect(), *REGISTRY.collect()]
    return {f.name + s for f in families for s in SUFFIXES[f.type]}


def queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def test_the_dashboard_queries_only_exported_metrics(tmp_path: Path) -> None:
    names = exported(tmp_path)
    assert "tensora_gateway_failovers_total" in names and "tensora_controller_queue_depth" in names
    used = {(title, n) for title, expr in queries() for n in NAME.findall(expr)}
    assert used
    unknown = sorted((t, n) for t, n in used if n not in names)
    assert unknown == [], f"queries name metrics no process exports: {unknown}"


def test_the_dashboard_shows_what_operators_asked_for() -> None:
    exprs = " ".join(e for _, e in queries())
    for needed in ("tensora_controller_fallback_placements_total",
                   "tensora_controller_time_to_placement_seconds_bucket", "tensora_controller_queue_depth",
                   "tensora_gateway_failovers_total", "tensora_gateway_breakers",
                   "tensora_gateway_ttft_seconds_bucket", "tensora_gateway_spool_batches"):
        assert needed in exprs, needed
    assert "histogram_quantile(0.5" in exprs and "histogram_quantile(0.99" in exprs


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool absent (Debian: apt-get install prometheus)")
def test_the_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query{i}", "expr": expr.replace("$__rate_interval", "5m")}
        for i, (_, expr) in enumerate(queries())]}]}
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def _build(path: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the overlays are built with its built-in kustomize")
    out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_every_tensora_pod_is_scraped_on_its_metrics_port_and_only_from_monitoring() -> None:
    docs = _build(ROOT / "deploy" / "kubernetes" / "overlays" / "us-east")
    ports = {"tensora-api": 8710, "tensora-controller": 8710, "tensora-gateway": 8711}
    for d in (d for d in docs if d["kind"] == "Deployment"):
        name, tpl = d["metadata"]["name"], d["spec"]["template"]
        port = ports[name]
        assert tpl["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                                                  "prometheus.io/path": "/metrics"}, name
        c = tpl["spec"]["containers"][0]
        assert {"name": "metrics", "containerPort": port} in c["ports"], name
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert f"0.0.0.0:{port}" in (env.get("TENSORA_METRICS_LISTEN"), env.get("TENSORA_GATEWAY_METRICS_LISTEN")), name
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for svc in ("tensora-api", "tensora-gateway", "tensora-controller-metrics"):
        assert "metrics" in [p["name"] for p in services[svc]["spec"]["ports"]], svc
        assert services[svc]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tensora"
    policy = next(d for d in docs
                  if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "metrics-from-monitoring")
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert sorted(p["port"] for p in rule["ports"]) == [8710, 8711]


def test_the_optional_service_monitor_selects_the_metrics_ports() -> None:
    (sm,) = _build(ROOT / "deploy" / "kubernetes" / "monitoring")
    assert sm["kind"] == "ServiceMonitor"
    assert sm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/part-of": "tensora"}
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]
