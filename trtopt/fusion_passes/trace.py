"""Why didn't it fuse? Match failures as values with reasons (STYLE.md §7).

Every rule that inspects an attention-like region records either a success or the first check that failed,
naming the node where the check looked. ``trtopt build --explain`` prints these records.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MatchFailure:
    """One region that a rule looked at and left alone."""

    rule: str  # the pass that looked, e.g. "paged_attention"
    anchor: str  # name of the node the region is anchored at (the Softmax for attention)
    reason: str  # the check that failed, in words
    node: str = ""  # name of the node where the failing check looked, when it is not the anchor

    def describe(self) -> str:
        where = f" (at {self.node})" if self.node and self.node != self.anchor else ""
        return f"{self.rule} | {self.anchor}: {self.reason}{where}"


class NoMatch(Exception):
    """Raised inside a matcher to stop at the first failed check; converted to a MatchFailure by the rule."""

    def __init__(self, reason: str, node_name: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.node_name = node_name


@dataclasses.dataclass
class Trace:
    """Collects the match failures of one pipeline run (owned by the pipeline, passed to each rule)."""

    failures: list[MatchFailure] = dataclasses.field(default_factory=list)

    def fail(self, rule: str, anchor: str, err: NoMatch) -> None:
        self.failures.append(MatchFailure(rule, anchor, err.reason, err.node_name))

    def lines(self) -> list[str]:
        return [f.describe() for f in self.failures]

    def summary(self, limit: int = 6) -> list[str]:
        """One line per distinct (rule, reason), with how many regions failed that way and the first of them."""
        groups: dict[tuple[str, str], list[MatchFailure]] = {}
        for failure in self.failures:
            groups.setdefault((failure.rule, failure.reason), []).append(failure)
        lines = [
            f"{rule} | {len(fs)} region(s), e.g. {fs[0].anchor}: {reason}" for (rule, reason), fs in groups.items()
        ]
        return lines[:limit] + ([f"... and {len(lines) - limit} more kinds"] if len(lines) > limit else [])
