"""The metric names a PromQL expression reads, for checking dashboards and adapter rules against what Folio
exports. Enough PromQL for that: strings, label matchers, ranges, grouping clauses, function calls and keywords
are not metric names; every other identifier is."""

from __future__ import annotations

import re

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENTIFIER = re.compile(r"(?<![\w:$.])[A-Za-z_:][\w:]*")
_CALL = re.compile(r"\s*\(")
_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                       "offset", "inf", "nan", "Inf", "NaN"})


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects, e.g. {'folio_queue_depth'} for 'sum by (pod) (folio_queue_depth)'."""
    for pattern in (_STRING, _MATCHERS, _RANGE, _GROUPING):
        expr = pattern.sub(" ", expr)
    names = set()
    for match in _IDENTIFIER.finditer(expr):
        if match.group() not in _KEYWORDS and not _CALL.match(expr, match.end()):  # not a function or aggregation
            names.add(match.group())
    return names
