"""A PDCluster document checked as the apiserver checks it, without a cluster: its
apiVersion and kind, its name, the structural schema (the API models the CRD is
generated from) and the CRD's CEL rules (api/cel.py). `pdctl validate` prints what this
returns; tests/integration/test_validate_parity.py holds it equal to a server-side
dry-run on generated specs."""

from __future__ import annotations

import re
from functools import cache
from typing import Any

from pydantic import ValidationError

from pdcluster import constants as C

# metadata.name of a custom resource: a DNS-1123 subdomain (apimachinery's
# NameIsDNSSubdomain), and the CRD's own rule keeps it short enough for child names.
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_SUBDOMAIN_MAX = 253


@cache
def _schema() -> dict[str, Any]:
    from pdcluster.api.crd import build_crd

    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@cache
def _validator():
    import jsonschema

    # Kubernetes decodes a JSON number with a fraction or exponent, or past int64, as a
    # float, and a float is no integer even when whole (2.0): JSON Schema's rule takes both.
    checker = jsonschema.Draft7Validator.TYPE_CHECKER.redefine(
        "integer", lambda _, value: isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63
    )
    return jsonschema.validators.extend(jsonschema.Draft7Validator, type_checker=checker)(_schema())


def _structural(doc: dict[str, Any]) -> list[str]:
    """The CRD's structural schema (types, enums, ranges, patterns) as JSON Schema; the
    Kubernetes extensions (x-kubernetes-*) mean nothing to it and change no verdict here."""
    return [
        f"{'.'.join(str(p) for p in e.absolute_path) or '<object>'}: {e.message}"
        for e in _validator().iter_errors({k: v for k, v in doc.items() if k != "metadata"})
    ]


def problems(doc: dict[str, Any]) -> list[str]:
    """What the apiserver would refuse in `doc`, one line a problem; empty when valid."""
    from pdcluster.api import cel
    from pdcluster.api.v1alpha1 import PDClusterSpec

    out = []
    if doc.get("apiVersion") != C.API_VERSION:
        out.append(f"apiVersion: must be {C.API_VERSION}, not {doc.get('apiVersion')!r}")
    if doc.get("kind") != C.KIND:
        out.append(f"kind: must be {C.KIND}, not {doc.get('kind')!r}")
    name = (doc.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not name:
        out.append("metadata.name: required")
    elif len(name) > _DNS_SUBDOMAIN_MAX or not _DNS_SUBDOMAIN.match(name):
        out.append("metadata.name: must be a lowercase DNS-1123 subdomain (a-z, 0-9, '-' and '.')")
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        return [*out, "spec: required, an object"]
    try:
        PDClusterSpec.model_validate(spec)
    except ValidationError as e:
        out += [f"spec.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()]
    out += _structural(doc)
    out += cel.undeclared(_schema(), doc)
    out += cel.violations(_schema(), doc)
    return out
