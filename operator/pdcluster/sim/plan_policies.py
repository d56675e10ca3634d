"""The policies `pdctl plan` compares, as typed values.

A static fleet carries its prefill:decode split as numbers; every display name is
derived from the value, so nothing is ever parsed back out of a name.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class PolicyKind(Enum):
    STATIC = "static"  # a fixed split, given
    STATIC_BEST = "static-best"  # the best fixed split, in hindsight
    DYNAMO = "dynamo"
    DYNAMO_CONSTANT = "dynamo-constant"
    DYNAMO_LOAD = "dynamo-load"
    LLMD = "llmd"
    ORACLE = "oracle"
    PDCLUSTER = "pdcluster"
    PDCLUSTER_PRIOR = "pdcluster-prior"
    # The law on flexible engines (spec.mode flexible): the size as the law decides it,
    # the split every interval by the engines needed per role, moved by flips.
    PDCLUSTER_FLEX = "pdcluster-flex"


# Kinds whose fleet never changes size; every other kind is an autoscaler.
FIXED_KINDS = (PolicyKind.STATIC, PolicyKind.STATIC_BEST)


@dataclass(frozen=True)
class PolicyChoice:
    kind: PolicyKind
    # Prefill:decode engines: required for STATIC; for STATIC_BEST, the split it found.
    split: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.kind is PolicyKind.STATIC and self.split is None:
            raise ValueError("a static policy needs its prefill:decode split")
        if self.split is not None and self.kind not in FIXED_KINDS:
            raise ValueError(f"{self.kind.value} takes no fixed split")

    @classmethod
    def static(cls, prefill: int, decode: int) -> PolicyChoice:
        return cls(PolicyKind.STATIC, (prefill, decode))

    @property
    def dynamic(self) -> bool:
        return self.kind not in FIXED_KINDS

    @property
    def name(self) -> str:
        if self.split is None:
            return self.kind.value
        prefill, decode = self.split
        if self.kind is PolicyKind.STATIC:
            return f"static:{prefill}:{decode}"
        return f"static-best ({prefill}:{decode})"


def parse_policy(text: str) -> PolicyChoice:
    """A `--policy` value: static:P:D or one of the kinds' names."""
    kind, _, split = text.partition(":")
    if kind == PolicyKind.STATIC.value and split:
        prefill, decode = split.split(":")
        return PolicyChoice.static(int(prefill), int(decode))
    try:
        return PolicyChoice(PolicyKind(text))
    except ValueError:  # not a kind's name, or "static" without its split
        raise ValueError(f"unknown policy {text!r}") from None


DEFAULT_POLICIES = (
    PolicyChoice(PolicyKind.STATIC_BEST),
    PolicyChoice(PolicyKind.DYNAMO),
    PolicyChoice(PolicyKind.PDCLUSTER),
)
