"""Building blocks for API models that turn into a structural CRD schema.

Every model here is camelCase on the wire, rejects unknown fields (a typo in a spec
is an error, not a silent no-op), and carries its documentation in `description`s
that end up in the CRD and in docs/api.md.
"""

from __future__ import annotations

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
