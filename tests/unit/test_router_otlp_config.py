"""The router's trace export read from its flags and the OpenTelemetry SDK's variables."""

from __future__ import annotations

import pytest

from pdcluster.router.otlp_config import ExportConfig, export_config, key_values


def test_no_endpoint_anywhere_leaves_tracing_off() -> None:
    assert export_config(None, None, {"OTEL_SERVICE_NAME": "x", "OTEL_EXPORTER_OTLP_HEADERS": "a=b"}) is None


def test_the_defaults_are_the_specifications() -> None:
    assert export_config("http://c:4318/v1/traces", None, {}) == ExportConfig(
        endpoint="http://c:4318/v1/traces",
        sample_ratio=1.0,
        headers={},
        timeout_s=10.0,
        resource={"service.name": "pdcluster-router"},
    )


@pytest.mark.parametrize(
    ("environ", "endpoint"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, "http://c:4318/v1/traces"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://c/otlp/"}, "https://c/otlp/v1/traces"),
        # The signal's own endpoint is used as is, and wins over the generic one.
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4318/custom"}, "http://t:4318/custom"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/v1/traces"},
            "http://t/v1/traces",
        ),
    ],
)
def test_the_endpoint_from_the_environment(environ: dict[str, str], endpoint: str) -> None:
    config = export_config(None, None, environ)
    assert config is not None and config.endpoint == endpoint


def test_flags_win_over_the_environment() -> None:
    environ = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://env:4318/v1/traces",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.5",
    }
    config = export_config("http://flag:4318/v1/traces", 0.1, environ)
    assert config is not None
    assert (config.endpoint, config.sample_ratio) == ("http://flag:4318/v1/traces", 0.1)


def test_headers_are_percent_decoded_and_the_signals_own_replace_the_generic() -> None:
    generic = {"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20abc%3D%3D , x-tenant=a"}
    config = export_config("http://c/v1/traces", None, generic)
    assert config is not None and config.headers == {"authorization": "Bearer abc==", "x-tenant": "a"}
    both = generic | {"OTEL_EXPORTER_OTLP_TRACES_HEADERS": "api-key=k1"}
    config = export_config("http://c/v1/traces", None, both)
    assert config is not None and config.headers == {"api-key": "k1"}


def test_a_malformed_member_is_skipped_not_fatal() -> None:
    assert key_values("a=1,,novalue, =x,b= 2=3 ", "OTEL_EXPORTER_OTLP_HEADERS") == {"a": "1", "b": "2=3"}


def test_service_name_and_resource_attributes() -> None:
    environ = {"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs,k8s.pod.name=r-0,team=ml%2Cinfra"}
    config = export_config("http://c/v1/traces", None, environ)
    assert config is not None
    assert config.resource == {"service.name": "from-attrs", "k8s.pod.name": "r-0", "team": "ml,infra"}
    config = export_config("http://c/v1/traces", None, environ | {"OTEL_SERVICE_NAME": "router-a"})
    assert config is not None and config.resource["service.name"] == "router-a"  # OTEL_SERVICE_NAME wins


@pytest.mark.parametrize(
    ("sampler", "argument", "ratio"),
    [
        ("traceidratio", "0.25", 0.25),
        ("parentbased_traceidratio", "0", 0.0),
        ("parentbased_traceidratio", None, 1.0),  # the ratio samplers' default argument
        (None, "0.25", 1.0),  # the argument of the default sampler (always on) means nothing
        ("always_off", None, 0.0),
        ("parentbased_always_on", "0.25", 1.0),
        ("traceidratio", "1.5", 1.0),  # not a ratio: ignored with a warning
        ("traceidratio", "half", 1.0),
        ("jaeger_remote", "0.25", 1.0),  # a sampler the router does not have
    ],
)
def test_the_sample_ratio_from_the_sampler_variables(sampler: str | None, argument: str | None, ratio: float) -> None:
    environ = {"OTEL_TRACES_SAMPLER": sampler, "OTEL_TRACES_SAMPLER_ARG": argument}
    config = export_config("http://c/v1/traces", None, {k: v for k, v in environ.items() if v is not None})
    assert config is not None and config.sample_ratio == ratio


@pytest.mark.parametrize(
    ("environ", "timeout_s"),
    [
        ({"OTEL_EXPORTER_OTLP_TIMEOUT": "2500"}, 2.5),  # milliseconds
        ({"OTEL_EXPORTER_OTLP_TIMEOUT": "2500", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "500"}, 0.5),
        ({"OTEL_EXPORTER_OTLP_TIMEOUT": "soon"}, 10.0),
        ({"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "0"}, 10.0),
    ],
)
def test_the_export_timeout(environ: dict[str, str], timeout_s: float) -> None:
    config = export_config("http://c/v1/traces", None, environ)
    assert config is not None and config.timeout_s == timeout_s
