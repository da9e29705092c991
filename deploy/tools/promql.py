"""Which metrics and labels the dashboard and the alert rules use, read out of their PromQL.

A small tokenizer, not a PromQL parser: it finds metric names (identifiers that are not
functions, keywords or label names), the label names of selectors, and the label lists of
``by`` / ``without`` / ``on`` / ``ignoring`` / ``group_left`` / ``group_right``. The tests check
these against kvstore/daemon/metrics.py and against a real daemon's /metrics; where the
``promql-parser`` package is installed they also parse every expression with it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parent.parent
RULES = DEPLOY / "prometheus" / "kvstore-rules.yaml"
DASHBOARD = DEPLOY / "grafana" / "kvstore-dashboard.json"

# Grafana's built-in interval variables, replaced by a duration before parsing.
GRAFANA_INTERVALS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}

_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
             "group_left", "group_right", "atan2", "inf", "nan"}
# Aggregations may put their `by (...)` before the parenthesis: `sum by (tier) (x)`.
_AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                 "bottomk", "topk", "quantile", "limitk", "limit_ratio"}
_LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<num>(?:\d+(?:\.\d+)?(?:e[+-]?\d+)?)(?:ms|[smhdwy])?(?:\d+(?:ms|[smhdwy]))*)
  | (?P<id>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=(){},@])
""", re.X)


@dataclass
class Usage:
    """What one expression uses: metric -> label names in its selectors; grouping labels."""
    expr: str
    metrics: dict[str, set[str]] = field(default_factory=dict)
    grouping: list[list[str]] = field(default_factory=list)

    @property
    def grouping_labels(self) -> set[str]:
        return {label for group in self.grouping for label in group}


def substitute_grafana(expr: str) -> str:
    for var, dur in GRAFANA_INTERVALS.items():
        expr = expr.replace(var, dur)
    return expr


def tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m:
            raise ValueError(f"cannot tokenize PromQL at {expr[pos:pos + 30]!r} in {expr!r}")
        if m.lastgroup != "ws":
            out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


def usage(expr: str) -> Usage:
    """Metric names, selector labels and grouping labels of one PromQL expression."""
    toks = tokens(substitute_grafana(expr))
    u = Usage(expr)
    i = 0
    while i < len(toks):
        kind, val = toks[i]
        nxt = toks[i + 1][1] if i + 1 < len(toks) else None
        if kind == "id" and val in _LABEL_LISTS:
            if nxt == "(":
                j = i + 2
                labels = []
                while toks[j][1] != ")":
                    if toks[j][0] == "id":
                        labels.append(toks[j][1])
                    j += 1
                u.grouping.append(labels)
                i = j + 1
                continue
            if val in ("group_left", "group_right"):
                i += 1
                continue
            raise ValueError(f"{val} without a label list in {expr!r}")
        is_call = nxt == "(" or (val in _AGGREGATIONS and nxt in ("by", "without"))
        if kind == "id" and val not in _KEYWORDS and not is_call:
            labels = u.metrics.setdefault(val, set())
            if nxt == "{":
                j = i + 2
                while toks[j][1] != "}":
                    if toks[j][0] == "id" and toks[j + 1][1] in ("=", "!=", "=~", "!~"):
                        labels.add(toks[j][1])
                    j += 1
                i = j + 1
                continue
        i += 1
    return u


def dashboard_queries(path: Path = DASHBOARD) -> list[dict]:
    """Every Prometheus target of every panel (rows' nested panels included), with its panel title."""
    dash = json.loads(path.read_text())
    out = []

    def walk(panels):
        for p in panels:
            walk(p.get("panels", []))
            for t in p.get("targets", []):
                if "expr" in t:
                    out.append({"panel": p.get("title", ""), **t})

    walk(dash.get("panels", []))
    return out


def dashboard_variable_queries(path: Path = DASHBOARD) -> list[str]:
    """PromQL inside the dashboard's query variables (``label_values(metric, label)``)."""
    dash = json.loads(path.read_text())
    out = []
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v.get("query")
            out.append(q.get("query") if isinstance(q, dict) else q)
    return out


def rules(path: Path = RULES) -> list[dict]:
    return [r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]]


def all_expressions() -> list[tuple[str, str]]:
    """(where, expr) for the dashboard panels and the alert rules."""
    out = [(f"dashboard panel {q['panel']!r} {q.get('refId', '')}", q["expr"]) for q in dashboard_queries()]
    out += [(f"rule {r.get('alert') or r.get('record')}", r["expr"]) for r in rules()]
    return out


def used_metric_names() -> set[str]:
    names = {m for _, e in all_expressions() for m in usage(e).metrics}
    for q in dashboard_variable_queries():
        m = re.match(r"\s*label_values\(\s*([A-Za-z_:][\w:]*)\s*,", q or "")
        if m:
            names.add(m.group(1))
    return names
