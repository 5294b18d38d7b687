"""Does a Grafana board's PromQL resolve against one /metrics scrape? Without Prometheus.

Each query is read for what decides whether it returns a series: its selectors (a metric
name and its label matchers), the labels its `by (...)` groups on, and for a variable's
`label_values(selector, label)` the label asked for. A selector resolves when some sample
of the scrape has that name and satisfies every matcher; each grouping label must be on
some sample selected. Board variables are substituted first; matchers on target labels
(`instance`, `job`), which Prometheus adds when it scrapes, are not checked. A regex reader,
not a PromQL parser: it knows the forms of expression the boards use (functions, aggregations
with `by`, binary operators, range selectors), and fails on a query it finds no selector in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TARGET_LABELS = frozenset({"instance", "job"})
_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or"}
    | {"unless", "offset", "inf", "nan"}
)
_GROUPING = re.compile(r"\b(by|without|on|ignoring)\s*\(([^)]*)\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?")
_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$", re.S)


@dataclass(frozen=True, slots=True)
class Selector:
    name: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, op, value)

    def matches(self, sample) -> bool:
        if sample.name != self.name:
            return False
        for label, op, value in self.matchers:
            if label in TARGET_LABELS:
                continue
            actual = sample.labels.get(label, "")
            ok = {
                "=": actual == value,
                "!=": actual != value,
                "=~": re.fullmatch(value, actual) is not None,
                "!~": re.fullmatch(value, actual) is None,
            }[op]
            if not ok:
                return False
        return True


def board_queries(board: dict) -> list[str]:
    """Every panel target's expression and every query variable's query."""
    queries = [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]
    queries += [
        variable["query"]["query"]
        for variable in board["templating"]["list"]
        if variable["type"] == "query"
    ]
    return queries


def selectors(expr: str) -> list[Selector]:
    """The selectors of an expression (grouping clauses and ranges are not selectors)."""
    stripped = _RANGE.sub("", _GROUPING.sub("", expr))
    found = []
    for match in _SELECTOR.finditer(stripped):
        name, braces = match.group(1), match.group(2)
        following = stripped[match.end() :].lstrip()[:1]
        if name.lower() in _KEYWORDS or (following == "(" and not braces):
            continue  # a function or an aggregation, or an operator
        matchers = tuple(_MATCHER.findall(braces or ""))
        found.append(Selector(name, matchers))
    return found


def unresolved(query: str, samples: list, variables: dict[str, str]) -> list[str]:
    """What in `query` returns no series from `samples` (empty: it resolves)."""
    for variable, value in variables.items():
        query = query.replace(f"${variable}", value)
    wanted_label = None
    label_values = _LABEL_VALUES.match(query)
    if label_values:
        query, wanted_label = label_values.group(1), label_values.group(2)
    grouping = [
        label.strip()
        for _, labels in _GROUPING.findall(query)
        for label in labels.split(",")
        if label.strip()
    ]
    found = selectors(query)
    if not found:
        return [f"no selector read in {query!r}"]
    problems = []
    selected = []
    for selector in found:
        matching = [s for s in samples if selector.matches(s)]
        if not matching:
            problems.append(f"{selector.name}{dict((m[0], m[2]) for m in selector.matchers)}")
        selected += matching
    for label in [*grouping, *([wanted_label] if wanted_label else [])]:
        if (
            not problems
            and label not in TARGET_LABELS
            and not any(label in s.labels for s in selected)
        ):
            problems.append(f"no series of {query!r} has the label {label!r}")
    return problems
