"""Pydantic JSON Schema -> Kubernetes structural OpenAPI v3 schema.

The apiserver accepts only a subset of JSON Schema: no `$ref`/`$defs`, no `type: null`,
no `const`, no `title` noise, and defaults are materialised into stored objects. Each
rewrite below is one small pass over the tree.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

Schema = dict[str, Any]

_DROP_KEYS = {"title", "$defs", "discriminator"}


def structural_schema(model: type[BaseModel], *, keep_defaults: bool) -> Schema:
    raw = model.model_json_schema(by_alias=True, mode="validation", ref_template="#/$defs/{model}")
    defs = raw.get("$defs", {})
    out = _rewrite(raw, defs, keep_defaults=keep_defaults)
    _assert_structural(out)
    return out


def _resolve(node: Schema, defs: dict[str, Schema]) -> Schema:
    ref = node.get("$ref")
    if ref is None:
        return node
    target = copy.deepcopy(defs[ref.rsplit("/", 1)[-1]])
    # Keys next to a $ref (description, default) refine the referenced schema.
    target.update({k: v for k, v in node.items() if k != "$ref"})
    return _resolve(target, defs)


def _rewrite(node: Any, defs: dict[str, Schema], *, keep_defaults: bool) -> Any:
    if isinstance(node, list):
        return [_rewrite(n, defs, keep_defaults=keep_defaults) for n in node]
    if not isinstance(node, dict):
        return node
    node = _resolve(node, defs)
    if "allOf" in node and len(node["allOf"]) == 1:
        inner = _resolve(node.pop("allOf")[0], defs)
        node = {**inner, **node}
    node = _collapse_optional(node, defs)
    if "const" in node:
        node["enum"] = [node.pop("const")]
    out: Schema = {}
    for key, value in node.items():
        if key in _DROP_KEYS:
            continue
        if key == "default":
            default = _default(value, node, keep_defaults)
            if default is not None:
                out["default"] = default
            continue
        if key in ("properties", "patternProperties"):
            out[key] = {k: _rewrite(v, defs, keep_defaults=keep_defaults) for k, v in value.items()}
        elif key in ("items", "additionalProperties", "anyOf", "oneOf", "allOf", "not"):
            out[key] = _rewrite(value, defs, keep_defaults=keep_defaults)
        else:
            out[key] = value
    if out.get("additionalProperties") is False:
        # Unknown fields are pruned by the apiserver; `false` is not allowed there.
        del out["additionalProperties"]
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
    return out


def _collapse_optional(node: Schema, defs: dict[str, Schema]) -> Schema:
    """`anyOf: [X, {type: null}]` -> X.

    Optional fields are simply not required. We do not mark them `nullable`: the
    apiserver then drops explicit nulls, so CEL's `has()` keeps meaning "set".
    """
    any_of = node.get("anyOf")
    if not any_of or not any(branch == {"type": "null"} for branch in any_of):
        return node
    rest = [b for b in any_of if b != {"type": "null"}]
    if len(rest) != 1:
        return {**{k: v for k, v in node.items() if k != "anyOf"}, "anyOf": rest}
    inner = _resolve(rest[0], defs)
    return {**inner, **{k: v for k, v in node.items() if k != "anyOf"}}


def _default(value: Any, node: Schema, keep_defaults: bool) -> Any:
    if not keep_defaults or value is None:
        return None
    if isinstance(value, dict):
        return _without_empty_lists(value)
    if isinstance(value, list) and not value:
        return None
    return value


def _without_empty_lists(value: Any) -> Any:
    """Empty lists are left out of defaults, as they are for fields (they read the same)."""
    if isinstance(value, dict):
        return {k: _without_empty_lists(v) for k, v in value.items() if v != []}
    return value


def _assert_structural(node: Any, path: str = "") -> None:
    if isinstance(node, list):
        for i, n in enumerate(node):
            _assert_structural(n, f"{path}[{i}]")
        return
    if not isinstance(node, dict):
        return
    for bad in ("$ref", "$defs", "const"):
        if bad in node:
            raise ValueError(f"non-structural key {bad!r} at {path or '/'}")
    if node.get("type") == "null":
        raise ValueError(f"type: null at {path or '/'}")
    if node.get("type") == "number":
        raise ValueError(
            f"floating-point field at {path or '/'}: use integers (percent, millis) or quantities"
        )
    if node.get("uniqueItems"):
        raise ValueError(f"uniqueItems at {path or '/'}: use x-kubernetes-list-type: set")
    for key, value in node.items():
        if key == "properties":
            for name, sub in value.items():
                _assert_structural(sub, f"{path}.{name}")
        elif isinstance(value, dict | list):
            _assert_structural(value, f"{path}/{key}")
