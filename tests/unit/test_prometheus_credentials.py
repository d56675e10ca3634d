"""Prometheus credentials (io/prometheus.py, io/prometheus_auth.py): the headers they make,
where the autoscaler takes them from, and what it says when they cannot be read.
tests/integration/test_prometheus_auth.py sends them to a real Prometheus."""

from __future__ import annotations

import argparse
import base64
import copy
from typing import Any

import pytest
from fakekube import FakeKube
from test_autoscaler_step import FakePrometheus
from test_control_law import T0, metrics, spec
from test_pdctl_validate import BASE

from pdcluster.api.v1alpha1 import PDClusterSpec, PDClusterStatus
from pdcluster.api.v1alpha1.autoscaling import PrometheusAuthSpec
from pdcluster.api.validate import problems
from pdcluster.autoscaler import PrometheusAutoscaler
from pdcluster.io.prometheus import NO_CREDENTIALS, Credentials, credentials
from pdcluster.io.prometheus_auth import (
    CredentialsUnavailable,
    OperatorCredentials,
    from_spec,
    parse_header,
)
from pdcluster.render import Owner

OWNER = Owner("c", "ns", "uid")


def secret(name: str, **data: str) -> dict[str, Any]:
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": "ns"},
        "data": encoded,
    }


def test_bearer_token_and_tenant_header() -> None:
    creds = credentials(bearer_token="abc\n", headers={"X-Scope-OrgID": "t1"})
    assert creds.headers == {"Authorization": "Bearer abc", "X-Scope-OrgID": "t1"}
    assert creds.tls is None


def test_basic_auth_is_rfc7617() -> None:
    creds = credentials(basic_auth=("Aladdin", "open sesame"))
    assert creds.headers == {"Authorization": "Basic QWxhZGRpbjpvcGVuIHNlc2FtZQ=="}


def test_token_and_basic_auth_exclude_each_other() -> None:
    with pytest.raises(ValueError, match="exclude each other"):
        credentials(bearer_token="a", basic_auth=("u", "p"))


def test_a_ca_bundle_that_is_not_pem_is_named() -> None:
    with pytest.raises(ValueError, match="CA bundle"):
        credentials(ca_pem="not a certificate")


def test_header_flag() -> None:
    assert parse_header("X-Scope-OrgID=team=a") == ("X-Scope-OrgID", "team=a")
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=VALUE"):
        parse_header("X-Scope-OrgID")


def test_basic_auth_flags_come_in_pairs(tmp_path) -> None:
    (tmp_path / "user").write_text("u")
    with pytest.raises(CredentialsUnavailable, match="both"):
        OperatorCredentials(username_file=tmp_path / "user").load()


async def test_the_spec_secrets_are_read_from_the_clusters_namespace() -> None:
    kube = FakeKube()
    kube.put(secret("prom", user="reader\n", pass_="pw"))
    auth = PrometheusAuthSpec.model_validate(
        {"basicAuthSecret": {"name": "prom", "usernameKey": "user", "passwordKey": "pass_"},
         "headers": {"X-Scope-OrgID": "team-a"}}
    )  # fmt: skip
    creds = await from_spec(kube, "ns", auth)
    assert creds.headers == {
        "X-Scope-OrgID": "team-a",
        "Authorization": "Basic " + base64.b64encode(b"reader:pw").decode(),
    }
    with pytest.raises(CredentialsUnavailable, match="Secret other/prom not found"):
        await from_spec(kube, "other", auth)
    token = PrometheusAuthSpec.model_validate({"bearerTokenSecret": {"name": "prom", "key": "token"}})
    with pytest.raises(CredentialsUnavailable, match="Secret ns/prom has no key 'token'"):
        await from_spec(kube, "ns", token)


class Recording(PrometheusAutoscaler):
    """The autoscaler with the Prometheus it would build recorded instead of asked."""

    def __init__(self, kube: FakeKube, **kw: Any) -> None:
        super().__init__(kube, "http://operators-prometheus:9090", **kw)  # type: ignore[arg-type]
        self.asked: list[tuple[str, Credentials]] = []

    def _prometheus(self, url: str, creds: Credentials) -> Any:
        self.asked.append((url, creds))
        return FakePrometheus(metrics())


def with_autoscaling(s: PDClusterSpec, **fields: Any) -> PDClusterSpec:
    return s.model_copy(update={"autoscaling": s.autoscaling.model_copy(update=fields)})


async def test_the_operators_credentials_go_to_the_operators_url_only(tmp_path) -> None:
    (tmp_path / "token").write_text("operator-token")
    a = Recording(FakeKube(), default_credentials=OperatorCredentials(bearer_token_file=tmp_path / "token"))
    await a.step(spec(), OWNER, PDClusterStatus(), T0)
    own = with_autoscaling(spec(), prometheus_url="http://elsewhere:9090")
    await a.step(own, Owner("d", "ns", "uid2"), PDClusterStatus(), T0)
    (url1, creds1), (url2, creds2) = a.asked
    assert url1 == "http://operators-prometheus:9090"
    assert creds1.headers == {"Authorization": "Bearer operator-token"}
    assert url2 == "http://elsewhere:9090" and creds2 is NO_CREDENTIALS


async def test_credentials_that_cannot_be_read_hold_replicas_and_say_why() -> None:
    auth = PrometheusAuthSpec.model_validate({"bearerTokenSecret": {"name": "missing"}})
    a = Recording(FakeKube())
    result = await a.step(with_autoscaling(spec(), prometheus_auth=auth), OWNER, PDClusterStatus(), T0)
    assert a.asked == []
    assert result.condition == (
        False,
        "PrometheusCredentials",
        "Secret ns/missing not found; holding replicas",
    )


def test_the_crd_refuses_a_token_and_basic_auth_together() -> None:
    doc = copy.deepcopy(BASE)
    doc["spec"].setdefault("autoscaling", {})["prometheusAuth"] = {
        "bearerTokenSecret": {"name": "a"},
        "basicAuthSecret": {"name": "b"},
    }
    assert any("not both" in p for p in problems(doc))
    del doc["spec"]["autoscaling"]["prometheusAuth"]["basicAuthSecret"]
    assert problems(doc) == []
