"""Building blocks for API models that turn into a structural CRD schema.

Every model here is camelCase on the wire, rejects unknown fields (a typo in a spec
is an error, not a silent no-op), and carries its documentation in `description`s
that end up in the CRD and in docs/api.md.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation, Overflow
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel


class Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
    )

    def wire(self) -> dict[str, Any]:
        """The object as Kubernetes stores it: camelCase, without unset optionals."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    """One `x-kubernetes-validations` entry."""
    entry = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


_QUANTITY_PATTERN = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"

# A Kubernetes resource.Quantity: an integer or a string like "16Gi" / "500m".
Quantity = Annotated[
    int | str,
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": _QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    ),
]

_SUFFIX = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}  # fmt: skip
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")


def quantity(value: Any) -> Decimal | None:
    """A Kubernetes quantity's value ("16Gi", "500m", 4, "1e3"), or None if `value` is
    not one. The project's one quantity parser."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return Decimal(str(value))
    if not isinstance(value, str):
        return None
    m = _QUANTITY.match(value)
    if not m:
        return None
    try:
        return Decimal(m.group(1)) * Decimal(_SUFFIX[m.group(2) or ""])
    except (InvalidOperation, Overflow):  # e.g. a hash like "9e99999999999999": not a size
        return None


# Kubernetes objects we pass through untouched (affinity, env valueFrom, ...): the
# apiserver validates them when the child object is applied.
FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]

StringMap = Annotated[
    dict[str, str],
    WithJsonSchema({"type": "object", "additionalProperties": {"type": "string"}}),
]

Port = Annotated[int, Field(ge=1, le=65535)]
