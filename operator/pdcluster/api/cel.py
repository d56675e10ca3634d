"""The CRD's own validation rules (x-kubernetes-validations, CEL), evaluated offline so
that `pdctl validate` gives the apiserver's verdict without a cluster.

As the apiserver does it: the structural schema's defaults are applied first, then each
rule is evaluated with `self` bound to the value at its node, wherever the object has
that node (cel-python, a CEL evaluator, plus the Kubernetes `quantity()` library
functions the rules use). A rule that cannot be evaluated fails, as on the apiserver.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from decimal import Decimal
from functools import cache
from typing import Any

import celpy
from celpy import celtypes

from pdcluster.api.base import quantity as parse_quantity


class Quantity:
    """A value of Kubernetes' CEL quantity library (k8s.io/apiserver/pkg/cel/library)."""

    def __init__(self, value: Decimal):
        self.value = value


def _quantity(text: Any) -> Quantity:
    value = parse_quantity(str(text))
    if value is None:
        raise ValueError(f"{text!r} is not a quantity")
    return Quantity(Decimal(value))


def _compare(a: Quantity, b: Quantity) -> int:
    return (a.value > b.value) - (a.value < b.value)


FUNCTIONS = {
    "quantity": _quantity,
    "isQuantity": lambda text: celtypes.BoolType(parse_quantity(str(text)) is not None),
    "isGreaterThan": lambda a, b: celtypes.BoolType(_compare(a, b) > 0),
    "isLessThan": lambda a, b: celtypes.BoolType(_compare(a, b) < 0),
    "compareTo": lambda a, b: celtypes.IntType(_compare(a, b)),
}


@cache
def _program(rule: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(rule), functions=FUNCTIONS)


def with_defaults(schema: dict[str, Any], value: Any) -> Any:
    """`value` with the schema's defaults filled in where the object has the parent."""
    if isinstance(value, dict):
        out = dict(value)
        for name, sub in (schema.get("properties") or {}).items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = with_defaults(sub, out[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in set(out) - set(schema.get("properties") or {}):
                out[name] = with_defaults(extra, out[name])
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [with_defaults(schema["items"], v) for v in value]
    return value


def _nodes(schema: dict[str, Any], value: Any, path: str) -> Iterator[tuple[dict[str, Any], Any, str]]:
    """Every (schema, value, path) where the object has a value."""
    yield schema, value, path
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for name, v in value.items():
            sub = properties.get(name) or (extra if isinstance(extra, dict) else None)
            if sub is not None:
                yield from _nodes(sub, v, f"{path}.{name}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            yield from _nodes(schema["items"], v, f"{path}[{i}]")


def violations(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """'<field path>: <rule's message>' for every rule the object breaks."""
    out = []
    for node, value, path in _nodes(schema, with_defaults(schema, obj), ""):
        for rule in node.get("x-kubernetes-validations") or ():
            where = (path + rule.get("fieldPath", "")).lstrip(".") or "<object>"
            message = rule.get("message") or "failed rule: " + rule["rule"]
            try:
                result = _program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})
            except (celpy.CELEvalError, TypeError, ValueError, KeyError, AttributeError) as e:
                result = e
            if isinstance(result, Exception):
                # As the apiserver: a rule that cannot be evaluated (a key it reads is
                # absent, a value of the wrong type) fails.
                out.append(f"{where}: {message} (the rule could not be evaluated: {result})")
            elif not bool(result):
                out.append(f"{where}: {message}")
    return out


def undeclared(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """Fields the schema does not declare: the apiserver refuses them on a server-side
    apply (strict field validation, also kubectl's default) instead of pruning them."""
    out = []
    for node, value, path in _nodes(schema, obj, ""):
        declared = node.get("properties")
        if not isinstance(value, dict) or not declared or node.get("additionalProperties") is not None:
            continue
        if node.get("x-kubernetes-preserve-unknown-fields"):
            continue
        out += [f"{path}.{name}: field not declared in schema".lstrip(".") for name in value if name not in declared]
    return out
