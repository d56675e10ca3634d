"""Where the autoscaler's Prometheus credentials come from.

Two sources, never mixed: a PDCluster's `autoscaling.prometheusAuth` (Secrets in its own
namespace), or the operator's `--prometheus-*` flags (files the chart mounts from
Secrets in the operator's namespace). The operator's credentials go only to the
operator's URL: a spec that names a Prometheus of its own gets no credentials it did not
name, so a PDCluster cannot send the operator's token elsewhere. Both are read at every
autoscaler run, so a rotated token or password applies without a restart.
"""

from __future__ import annotations

import argparse
import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pdcluster.api.v1alpha1.autoscaling import PrometheusAuthSpec
from pdcluster.io.kube import Kube
from pdcluster.io.prometheus import Credentials, credentials


class CredentialsUnavailable(Exception):
    """Credentials that are named cannot be read; the message says which and why."""


def parse_header(text: str) -> tuple[str, str]:
    """`Name=value` (the --prometheus-header flag) as a header."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE, e.g. X-Scope-OrgID=tenant-1")
    return name.strip(), value


@dataclass(frozen=True)
class OperatorCredentials:
    """The operator's flags: files (re-read each time) and fixed headers."""

    bearer_token_file: Path | None = None
    username_file: Path | None = None
    password_file: Path | None = None
    ca_file: Path | None = None
    headers: Mapping[str, str] = field(default_factory=dict)

    def load(self) -> Credentials:
        basic = None
        if self.username_file or self.password_file:
            if not (self.username_file and self.password_file):
                raise CredentialsUnavailable("basic auth needs both a username file and a password file")
            basic = (_read(self.username_file).strip(), _read(self.password_file).rstrip("\n"))
        token = _read(self.bearer_token_file) if self.bearer_token_file else None
        try:
            return credentials(
                bearer_token=token,
                basic_auth=basic,
                ca_pem=_read(self.ca_file) if self.ca_file else None,
                headers=self.headers,
            )
        except ValueError as e:
            raise CredentialsUnavailable(f"operator flags: {e}") from None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise CredentialsUnavailable(f"{path}: {e.strerror or e}") from None


async def from_spec(kube: Kube, namespace: str, auth: PrometheusAuthSpec) -> Credentials:
    """A spec's `autoscaling.prometheusAuth`, its Secrets read from `namespace`."""

    async def value(name: str, key: str) -> str:
        secret = await kube.get("v1", "Secret", name, namespace)
        if secret is None:
            raise CredentialsUnavailable(f"Secret {namespace}/{name} not found")
        encoded = (secret.get("data") or {}).get(key)
        if encoded is None:
            raise CredentialsUnavailable(f"Secret {namespace}/{name} has no key {key!r}")
        try:
            return base64.b64decode(encoded, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            raise CredentialsUnavailable(f"Secret {namespace}/{name} key {key!r} is not UTF-8 text") from None

    token = basic = ca = None
    if auth.bearer_token_secret:
        token = await value(auth.bearer_token_secret.name, auth.bearer_token_secret.key)
    if auth.basic_auth_secret:
        ref = auth.basic_auth_secret
        basic = ((await value(ref.name, ref.username_key)).strip(), await value(ref.name, ref.password_key))
    if auth.ca_secret:
        ca = await value(auth.ca_secret.name, auth.ca_secret.key)
    try:
        return credentials(bearer_token=token, basic_auth=basic, ca_pem=ca, headers=auth.headers)
    except ValueError as e:
        raise CredentialsUnavailable(f"autoscaling.prometheusAuth: {e}") from None
