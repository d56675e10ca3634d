"""The Grafana dashboard shipped with the chart: every PromQL parses (promtool, after the
template variables are substituted), names only metrics the project exports, and selects
them with the labels they really carry. tests/integration/test_chart.py runs the same
queries against a live Prometheus scraping a running PDCluster."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pdcluster import constants as C
from pdcluster import observability as O

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = json.loads((ROOT / "charts/pdcluster-operator/dashboards/pdcluster.json").read_text())
# What a query is evaluated with; Grafana fills these in from the dashboard's variables.
VARIABLES = {
    "namespace": "serving",
    "pdcluster": "demo",
    "__rate_interval": "1m",
    "slo_quantile": "0.9",
    "ttft_slo_ms": "500",
    "itl_slo_ms": "25",
}
OPERATOR_METRICS = {
    O.OPERATOR_DECISIONS,
    O.OPERATOR_DESIRED_REPLICAS,
    O.OPERATOR_RECONCILES,
    O.OPERATOR_RECONCILE_SECONDS,
}
# Served by mooncake_master itself (mooncake-transfer-engine 0.3.13.post1) on its metrics
# port; the integration test sees them in Prometheus.
MOONCAKE_MASTER_METRICS = {"master_allocated_bytes", "master_total_capacity_bytes", "master_key_count"}
SUFFIXES = ("", "_total", "_bucket", "_sum", "_count")


def known_metrics() -> set[str]:
    names = {
        value
        for key, value in vars(O).items()
        if key.startswith(("VLLM_", "ROUTER_", "OPERATOR_")) and isinstance(value, str)
    }
    names = {n + s for n in names for s in SUFFIXES}
    return names | {n.replace(":", "_") for n in names} | MOONCAKE_MASTER_METRICS


def substitute(expr: str) -> str:
    """Grafana's variable syntax ($name, ${name}); "$1" in label_replace is not a variable."""

    def value(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return VARIABLES[name] if name in VARIABLES else m.group(0)

    out = re.sub(r"\$\{(\w+)\}|\$([A-Za-z_]\w*)", value, expr)
    assert not re.search(r"\$[A-Za-z_{]", out), f"unknown template variable in {expr}"
    return out


def queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target, annotation and query variable."""
    out = []
    for panel in DASHBOARD["panels"]:
        for target in panel.get("targets", []):
            out.append((f"panel {panel['id']} {target['refId']}", target["expr"]))
    for note in DASHBOARD["annotations"]["list"]:
        out.append((f"annotation {note['name']}", note["expr"]))
    for var in DASHBOARD["templating"]["list"]:
        if var["type"] == "query":
            # label_values(<selector>, <label>) is Grafana's; the selector is PromQL.
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", var["query"])
            assert m, var["query"]
            out.append((f"variable {var['name']}", m.group(1)))
    return out


def promtool_check(exprs: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool missing: run e2e/local/install-deps.sh (Debian package prometheus)")
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [{"record": f"dashboard:q{i}", "expr": e} for i, e in enumerate(exprs)],
            }
        ]
    }
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    return subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)


def test_every_query_parses(tmp_path: Path) -> None:
    found = queries()
    assert len(found) >= 20
    result = promtool_check([substitute(e) for _, e in found], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_catches_a_bad_query(tmp_path: Path) -> None:
    result = promtool_check([substitute('sum(rate(x{pdcluster="$pdcluster"}[$__rate_interval])')], tmp_path)
    assert result.returncode != 0


def selectors(expr: str) -> list[tuple[set[str], str]]:
    """(metric names, label matchers) of every vector selector in `expr`."""
    out = []
    for m in re.finditer(r"([A-Za-z_:][\w:]*)?\{([^}]*)\}", expr):
        name, matchers = m.group(1), m.group(2)
        if name is None:
            by_name = re.search(r'__name__=~"([^"]+)"', matchers)
            assert by_name, f"selector without a metric name in {expr}"
            out.append((set(by_name.group(1).split("|")), matchers))
        else:
            out.append(({name}, matchers))
    return out


@pytest.mark.parametrize(("where", "expr"), queries(), ids=[w for w, _ in queries()])
def test_queries_name_exported_metrics_with_their_labels(where: str, expr: str) -> None:
    found = selectors(expr)
    if not found:
        if re.fullmatch(r"[A-Za-z_:][\w:]*", expr):  # label_values(<metric>, <label>)
            found = [({expr}, "")]
        else:  # a constant line, such as the SLO
            assert re.fullmatch(r"[0-9.\s/*+-]+", substitute(expr)), where
    known = known_metrics()
    for names, matchers in found:
        assert names <= known, f"{where}: unknown metric {names - known}"
        labels = dict(re.findall(r'(\w+)=~?"([^"]*)"', matchers))
        if not where.startswith("variable"):  # variables list the clusters, the rest shows one
            assert labels.get("pdcluster") == "$pdcluster", f"{where}: not selected by cluster"
        operator = {n.removesuffix(s) for n in names for s in SUFFIXES if n.endswith(s)} & OPERATOR_METRICS
        if operator:
            # The operator labels its series pdcluster_namespace: `namespace` is its own pod's.
            assert labels.get("pdcluster_namespace") == "$namespace" and "namespace" not in labels, where
        elif matchers:
            assert labels.get("namespace") == "$namespace", f"{where}: not selected by namespace"
        if "role" in labels:
            assert labels["role"] in C.ENGINE_ROLES, where
