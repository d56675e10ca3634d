"""Where and how the router sends its spans: its flags, else the OpenTelemetry SDK's
environment variables, read as the SDK reads them.

The variables and their precedence are the OpenTelemetry specification's:
- OTLP exporter configuration (endpoints, headers, timeout; a signal's own variable
  over the generic one): https://opentelemetry.io/docs/specs/otel/protocol/exporter/
- general SDK variables (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER
  and its argument): https://opentelemetry.io/docs/specs/otel/configuration/sdk-environment-variables/
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

SERVICE = "pdcluster-router"
DEFAULT_TIMEOUT_S = 10.0  # the specification's default for OTEL_EXPORTER_OTLP_TIMEOUT
# The samplers whose argument is a ratio. The router always follows a client's sampled
# flag (it is parent-based), so the plain and parent-based names mean the same here.
RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")
FIXED_SAMPLERS = {"always_on": 1.0, "parentbased_always_on": 1.0, "always_off": 0.0, "parentbased_always_off": 0.0}


@dataclass(frozen=True)
class ExportConfig:
    endpoint: str  # the full traces URL, .../v1/traces
    sample_ratio: float = 1.0
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = DEFAULT_TIMEOUT_S  # one export, retries included
    resource: dict[str, str] = field(default_factory=lambda: {"service.name": SERVICE})


def key_values(text: str, variable: str) -> dict[str, str]:
    """`k=v,k2=v2` with percent-encoded values (the W3C Baggage form the specification
    gives OTEL_EXPORTER_OTLP_HEADERS and OTEL_RESOURCE_ATTRIBUTES); a malformed member is
    skipped with a warning, as the SDKs do, rather than failing the router."""
    pairs = {}
    for member in text.split(","):
        if not member.strip():
            continue
        key, sep, value = member.partition("=")
        key = key.strip()
        if not sep or not key:
            log.warning("%s: ignoring %r, not key=value", variable, member.strip())
            continue
        pairs[key] = urllib.parse.unquote(value.strip())
    return pairs


def _first(environ: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of `names` set to something other than blanks, with its value."""
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return name, value
    return None


def _endpoint(environ: Mapping[str, str]) -> str | None:
    if traces := environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip():
        return traces  # a signal's own endpoint is used as is
    if base := environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        return base.rstrip("/") + "/v1/traces"  # the generic one gets the signal's path
    return None


def _timeout_s(environ: Mapping[str, str]) -> float:
    found = _first(environ, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
    if found is None:
        return DEFAULT_TIMEOUT_S
    name, value = found
    try:
        milliseconds = float(value)
    except ValueError:
        milliseconds = 0.0
    if not milliseconds > 0:
        log.warning("%s=%r is not a positive number of milliseconds; using %gs", name, value, DEFAULT_TIMEOUT_S)
        return DEFAULT_TIMEOUT_S
    return milliseconds / 1000


def _sample_ratio(environ: Mapping[str, str]) -> float:
    sampler = environ.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if sampler in FIXED_SAMPLERS:
        return FIXED_SAMPLERS[sampler]
    if sampler and sampler not in RATIO_SAMPLERS:
        log.warning("OTEL_TRACES_SAMPLER=%s is not one the router knows; sampling every trace", sampler)
        return 1.0
    argument = environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if not sampler or not argument:
        return 1.0  # the SDK's default sampler, and the ratio samplers' default argument
    try:
        ratio = float(argument)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        log.warning("OTEL_TRACES_SAMPLER_ARG=%r is not a ratio between 0 and 1; sampling every trace", argument)
        return 1.0
    return ratio


def _resource(environ: Mapping[str, str]) -> dict[str, str]:
    resource = {"service.name": SERVICE}
    resource |= key_values(environ.get("OTEL_RESOURCE_ATTRIBUTES", ""), "OTEL_RESOURCE_ATTRIBUTES")
    if service := environ.get("OTEL_SERVICE_NAME", "").strip():
        resource["service.name"] = service  # over a service.name among the attributes
    return resource


def export_config(
    endpoint: str | None, sample_ratio: float | None, environ: Mapping[str, str]
) -> ExportConfig | None:
    """The export the flags (`endpoint`, `sample_ratio`: None when not given) and the
    environment ask for; the flags win. None: no endpoint anywhere, tracing is off."""
    endpoint = endpoint or _endpoint(environ)
    if endpoint is None:
        return None
    headers = _first(environ, "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS")
    return ExportConfig(
        endpoint=endpoint,
        sample_ratio=_sample_ratio(environ) if sample_ratio is None else sample_ratio,
        # A signal's own headers replace the generic ones rather than adding to them.
        headers=key_values(headers[1], headers[0]) if headers else {},
        timeout_s=_timeout_s(environ),
        resource=_resource(environ),
    )
