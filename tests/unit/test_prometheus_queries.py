"""The PromQL of the autoscaler, without a Prometheus (the real one is in test_prometheus_adapter)."""

from __future__ import annotations

from pdcluster import observability as obs
from pdcluster.io.prometheus import queries


def test_every_query_selects_the_cluster_and_its_namespace() -> None:
    qs = queries("team-a", "demo", 120, 0.9)
    for name, promql in qs.items():
        assert f'{obs.PROM_LABEL_CLUSTER}="demo"' in promql, name
        assert 'namespace="team-a"' in promql, name


def test_engine_series_are_per_role_and_match_both_spellings_of_vllm_names() -> None:
    qs = queries("ns", "c", 60, 0.99)
    assert 'role="prefill"' in qs["prefill_ttft_ms"] and 'role="decode"' in qs["decode_itl_ms"]
    assert (
        '__name__=~"vllm:time_to_first_token_seconds_bucket|vllm_time_to_first_token_seconds_bucket"'
        in (qs["prefill_ttft_ms"])
    )
    assert qs["ttft_ms"] == (
        "histogram_quantile(0.99, sum by (le) (rate("
        f'{obs.ROUTER_TTFT}_bucket{{{obs.PROM_LABEL_CLUSTER}="c",namespace="ns"}}[60s])))'
    )
    assert "[60s:7s]" in qs["prefill_ready"]  # a subquery with its own step
    assert 'outcome="ok"' in qs["finished_rate"]
    assert qs["prompt_tokens_rate_before"].endswith("[60s] offset 60s))")  # the window before this one


def test_label_values_are_escaped() -> None:
    qs = queries('we"ird', "a\\b", 120, 0.5)
    assert 'namespace="we\\"ird"' in qs["ttft_ms"]
    assert f'{obs.PROM_LABEL_CLUSTER}="a\\\\b"' in qs["ttft_ms"]


def test_every_field_of_the_contract_has_a_query() -> None:
    from pdcluster.series import SERIES

    qs = queries("ns", "c", 60, 0.9)
    assert {s.field for s in SERIES} <= set(qs)
    assert qs["prompt_tokens"].startswith("sum by (le) (rate(")  # the prompt-length histogram
    assert 'role="decode"' in qs["decode_running"]
