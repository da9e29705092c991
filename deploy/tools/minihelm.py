"""Render the kvstore Helm chart without helm: a small subset of Go templates and Helm functions.

tests/test_deploy.py uses it where no ``helm`` binary can be installed (helm is neither in
Debian 12 nor on PyPI). It implements what deploy/helm/kvstore/templates use and refuses
everything else, so a template that leaves the subset fails loudly instead of rendering wrong:

- actions ``{{ }}`` with ``{{-`` / ``-}}`` trimming, ``{{/* comments */}}``;
- ``if`` / ``else if`` / ``else``, ``with`` / ``else``, ``define``, ``end`` (no ``range``,
  no variables);
- pipelines with ``|`` and parentheses; operands ``.``, ``$``, ``.a.b``, ``$.a.b``, strings,
  numbers, ``true`` / ``false``;
- functions: include, toYaml, indent, nindent, quote, default, printf (``%s`` of strings and
  ``%v``), print, trunc, trimSuffix, eq, ne, not, and, or, sha256sum, required, fail, and the method
  ``.Files.Get``.

Helm's semantics are kept where they bite: numbers from values are float64, so ``{{ 1000000 }}``
prints ``1e+06``; a missing map key prints nothing, a field of a missing map is an error;
``toYaml`` drops the final newline. When helm is on PATH the tests render with both and compare.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml


class TemplateError(Exception):
    pass


def go_str(v: Any) -> str:
    """``fmt.Sprint(v)`` for the value kinds Helm values hold (float64 for every number)."""
    if v is None:
        return ""  # Helm replaces "<no value>" with ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return go_float(float(v))
    if isinstance(v, str):
        return v
    raise TemplateError(f"refusing to print a {type(v).__name__} (Go would print map[...]/[...]): use toYaml")


def go_float(x: float) -> str:
    """strconv.FormatFloat(x, 'g', -1, 64): shortest digits; exponent form from 1e+06 on."""
    if x == 0:
        return "0"
    sign, digits, exp = Decimal(repr(abs(x))).normalize().as_tuple()
    ds = "".join(map(str, digits))
    nd, dp = len(ds), len(ds) + exp  # value = 0.ds * 10**dp
    e = dp - 1
    neg = "-" if x < 0 else ""
    if e < -4 or e >= 6:
        mant = ds[0] + ("." + ds[1:] if nd > 1 else "")
        return f"{neg}{mant}e{'-' if e < 0 else '+'}{abs(e):02d}"
    if dp <= 0:
        return f"{neg}0.{'0' * -dp}{ds}"
    if dp >= nd:
        return neg + ds + "0" * (dp - nd)
    return f"{neg}{ds[:dp]}.{ds[dp:]}"


def truth(v: Any) -> bool:
    """Go template truth: false, 0, nil, and empty strings, maps and lists are false."""
    if v is None or v is False:
        return False
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v != 0
    if isinstance(v, (str, list, dict)):
        return len(v) > 0
    return True


def to_yaml(v: Any) -> str:
    if v is None:
        return "null"
    text = yaml.safe_dump(v, default_flow_style=False, sort_keys=True, width=1 << 16)
    if text.endswith("\n...\n"):
        text = text[:-4]
    return text[:-1] if text.endswith("\n") else text


# --- lexing and parsing ----------------------------------------------------------------------

_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)
_TOKEN = re.compile(r"""\s*(?:
    (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<num>-?\d+(?:\.\d+)?)
  | (?P<field>\$?(?:\.[A-Za-z_]\w*)+|\$(?![\w])|\.(?![\w]))
  | (?P<id>[A-Za-z_]\w*)
  | (?P<punct>[()|])
)""", re.X | re.S)


def _lex(text: str) -> list[tuple[str, str]]:
    """[("text", s) | ("action", body)] with the trim markers applied to the neighbouring text."""
    out: list[list[str]] = []
    pos, rtrim = 0, False
    for m in _ACTION.finditer(text):
        chunk = text[pos:m.start()]
        if rtrim:
            chunk = chunk.lstrip(" \t\r\n")
        if m.group(1):
            chunk = chunk.rstrip(" \t\r\n")
        out.append(["text", chunk])
        body = m.group(2).strip()
        if not (body.startswith("/*") and body.endswith("*/")):
            out.append(["action", body])
        rtrim, pos = bool(m.group(3)), m.end()
    tail = text[pos:]
    out.append(["text", tail.lstrip(" \t\r\n") if rtrim else tail])
    return [(k, v) for k, v in out if not (k == "text" and v == "")]


def _tokens(body: str) -> list[tuple[str, str]]:
    toks, pos = [], 0
    while pos < len(body):
        if body[pos:].strip() == "":
            break
        m = _TOKEN.match(body, pos)
        if not m or m.end() == pos:
            raise TemplateError(f"unsupported syntax at {body[pos:]!r} in {{{{ {body} }}}}")
        kind = m.lastgroup
        toks.append((kind, m.group(kind)))
        pos = m.end()
    return toks


def _parse_pipeline(toks: list[tuple[str, str]], i: int = 0, closing: str | None = None):
    """Returns (pipeline, next index): a pipeline is a list of commands, a command a list of operands."""
    cmds, cmd = [], []
    while i < len(toks):
        kind, val = toks[i]
        if kind == "punct" and val == "|":
            if not cmd:
                raise TemplateError("empty command in pipeline")
            cmds.append(cmd)
            cmd = []
        elif kind == "punct" and val == "(":
            sub, i = _parse_pipeline(toks, i + 1, closing=")")
            cmd.append(("pipe", sub))
        elif kind == "punct" and val == ")":
            if closing != ")":
                raise TemplateError("unbalanced ')'")
            break
        else:
            cmd.append((kind, val))
        i += 1
    else:
        if closing:
            raise TemplateError("missing ')'")
    if not cmd:
        raise TemplateError("empty pipeline")
    cmds.append(cmd)
    return cmds, i


def _parse(items, i=0, stops=()):
    """Nodes until one of ``stops`` (an action keyword); returns (nodes, index, stopping action)."""
    nodes = []
    while i < len(items):
        kind, val = items[i]
        if kind == "text":
            nodes.append(("text", val))
            i += 1
            continue
        word = val.split(None, 1)[0] if val else ""
        rest = val[len(word):].strip()
        if word in stops:
            return nodes, i, val
        if word in ("if", "with"):
            branches, els = [], None
            cond = rest
            while True:
                body, i, stop = _parse(items, i + 1, stops=("else", "end"))
                if stop is None:
                    raise TemplateError(f"{word} without end")
                branches.append((_parse_pipeline(_tokens(cond))[0], body))
                if stop == "end":
                    break
                after = stop[len("else"):].strip()
                if after.startswith("if ") and word == "if":
                    cond = after[3:]
                    continue
                if after:
                    raise TemplateError(f"unsupported {{{{ {stop} }}}}")
                els, i, stop = _parse(items, i + 1, stops=("end",))
                if stop is None:
                    raise TemplateError(f"{word} without end")
                break
            nodes.append((word, branches, els or []))
            i += 1
        elif word == "define":
            name = json.loads(rest)
            body, i, stop = _parse(items, i + 1, stops=("end",))
            if stop is None:
                raise TemplateError(f"define {name} without end")
            nodes.append(("define", name, body))
            i += 1
        elif word in ("range", "template", "block", "else", "end", "break", "continue") or ":=" in val or "=" in val.split('"')[0]:
            raise TemplateError(f"unsupported action {{{{ {val} }}}} (not in minihelm's subset)")
        else:
            nodes.append(("expr", _parse_pipeline(_tokens(val))[0]))
            i += 1
    return nodes, i, None


# --- evaluation --------------------------------------------------------------------------------

class _Files:
    def __init__(self, root: Path) -> None:
        self.root = root

    def Get(self, path: str) -> str:  # noqa: N802 - Helm's name
        p = self.root / path
        return p.read_text() if p.is_file() else ""


def _default(d, v=None):
    return v if truth(v) else d


def _printf(fmt: str, *args):
    it = iter(args)

    def sub(m):
        if m.group(0) == "%%":
            return "%"
        try:
            a = next(it)
        except StopIteration:
            raise TemplateError(f"printf {fmt!r}: missing argument") from None
        if m.group(0) == "%s" and not isinstance(a, str):
            raise TemplateError(f"printf %s of a {type(a).__name__}: Go prints %!s(...); use %v")
        return go_str(a)

    out = re.sub(r"%[%sv]", sub, fmt)
    if re.search(r"%[^%sv]", fmt.replace("%%", "")):
        raise TemplateError(f"printf {fmt!r}: only %s and %v are supported")
    return out


def _print(*args):
    out = ""
    for i, a in enumerate(args):
        if i and not isinstance(a, str) and not isinstance(args[i - 1], str):
            out += " "
        out += go_str(a)
    return out


def _quote(*args):
    return " ".join(json.dumps(go_str(a), ensure_ascii=False) for a in args if a is not None)


def _required(msg, v=None):
    if v is None or v == "":
        raise TemplateError(f"required: {msg}")
    return v


def _fail(msg):
    raise TemplateError(f"execution error: {msg}")  # helm template's "Error: execution error at (...): msg"


def _trunc(n, s):
    n = int(n)
    return s[:n] if n >= 0 else s[n:]


def _indent(n, s):
    pad = " " * int(n)
    return pad + s.replace("\n", "\n" + pad)


_FUNCS = {
    "toYaml": to_yaml,
    "indent": _indent,
    "nindent": lambda n, s: "\n" + _indent(n, s),
    "quote": _quote,
    "default": _default,
    "printf": _printf,
    "print": _print,
    "trunc": _trunc,
    "trimSuffix": lambda suffix, s: s[: -len(suffix)] if suffix and s.endswith(suffix) else s,
    "eq": lambda a, *bs: any(a == b for b in bs),
    "ne": lambda a, b: a != b,
    "not": lambda v: not truth(v),
    "and": lambda *vs: next((v for v in vs if not truth(v)), vs[-1]),
    "or": lambda *vs: next((v for v in vs if truth(v)), vs[-1]),
    "sha256sum": lambda s: hashlib.sha256(s.encode()).hexdigest(),
    "required": _required,
    "fail": _fail,
}


class Chart:
    """A chart directory: ``render(overrides)`` returns ``{template path: rendered text}``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.meta = yaml.safe_load((self.path / "Chart.yaml").read_text())
        self.default_values = yaml.safe_load((self.path / "values.yaml").read_text()) or {}
        self.templates: dict[str, list] = {}
        self.defines: dict[str, list] = {}
        for f in sorted((self.path / "templates").iterdir()):
            if f.suffix not in (".yaml", ".yml", ".tpl", ".txt"):
                continue
            nodes, _, _ = _parse(_lex(f.read_text()))
            for n in nodes:
                if n[0] == "define":
                    self.defines[n[1]] = n[2]
            name = f"{self.meta['name']}/templates/{f.name}"
            self.templates[name] = self.defines[name] = nodes  # a file is a named template too

    def values(self, overrides: dict | None = None) -> dict:
        return merge(copy.deepcopy(self.default_values), overrides or {})

    def render(self, overrides: dict | None = None, release: str = "kvstore",
               namespace: str = "kvstore") -> dict[str, str]:
        root = {
            "Values": self.values(overrides),
            "Release": {"Name": release, "Namespace": namespace, "Service": "Helm",
                        "IsInstall": True, "IsUpgrade": False, "Revision": 1},
            "Chart": {"Name": self.meta["name"], "Version": self.meta["version"],
                      "AppVersion": self.meta.get("appVersion", ""), "Description": self.meta.get("description", "")},
            "Files": _Files(self.path),
            "Template": {"BasePath": f"{self.meta['name']}/templates"},
        }
        out = {}
        for name, nodes in self.templates.items():
            base = name.rsplit("/", 1)[-1]
            if base.startswith("_"):
                continue
            out[name] = self._exec(nodes, {**root, "Template": {**root["Template"], "Name": name}}, root)
        return out

    # -- interpreter -------------------------------------------------------------------------
    def _exec(self, nodes, dot, root) -> str:
        out = []
        for n in nodes:
            if n[0] == "text":
                out.append(n[1])
            elif n[0] == "expr":
                out.append(go_str(self._pipe(n[1], dot, root)))
            elif n[0] == "if":
                for cond, body in n[1]:
                    if truth(self._pipe(cond, dot, root)):
                        out.append(self._exec(body, dot, root))
                        break
                else:
                    out.append(self._exec(n[2], dot, root))
            elif n[0] == "with":
                (cond, body), = n[1]
                v = self._pipe(cond, dot, root)
                out.append(self._exec(body, v, root) if truth(v) else self._exec(n[2], dot, root))
            # "define" renders nothing where it stands
        return "".join(out)

    def _pipe(self, cmds, dot, root):
        piped, have = None, False
        for cmd in cmds:
            piped = self._cmd(cmd, dot, root, piped, have)
            have = True
        return piped

    def _cmd(self, cmd, dot, root, piped, have):
        kind, val = cmd[0]
        if kind == "id" and val not in ("true", "false", "nil"):
            args = [self._operand(o, dot, root) for o in cmd[1:]] + ([piped] if have else [])
            if val == "include":
                name, data = args
                if name not in self.defines:
                    raise TemplateError(f"include: no template named {name!r}")
                return self._exec(self.defines[name], data, data)
            if val not in _FUNCS:
                raise TemplateError(f"function {val!r} is not in minihelm's subset")
            return _FUNCS[val](*args)
        if kind == "field" and (len(cmd) > 1 or have):
            *obj_path, method = val.split(".")
            obj = self._field(".".join(obj_path) or ".", dot, root)
            if not isinstance(obj, _Files) or method != "Get":
                raise TemplateError(f"method call {val} is not in minihelm's subset")
            args = [self._operand(o, dot, root) for o in cmd[1:]] + ([piped] if have else [])
            return obj.Get(*args)
        if len(cmd) > 1 or have:
            raise TemplateError(f"can't give arguments to non-function {val}")
        return self._operand(cmd[0], dot, root)

    def _operand(self, op, dot, root):
        kind, val = op
        if kind == "pipe":
            return self._pipe(val, dot, root)
        if kind == "str":
            return json.loads(val)
        if kind == "raw":
            return val[1:-1]
        if kind == "num":
            return float(val) if "." in val else int(val)
        if kind == "field":
            return self._field(val, dot, root)
        if kind == "id":
            return {"true": True, "false": False, "nil": None}.get(val) if val in ("true", "false", "nil") else \
                self._cmd([op], dot, root, None, False)
        raise TemplateError(f"unexpected {val!r}")

    @staticmethod
    def _field(path: str, dot, root):
        if path == ".":
            return dot
        base, names = (root, path[2:].split(".")) if path.startswith("$.") else \
                      (root, []) if path == "$" else (dot, path[1:].split("."))
        v = base
        for i, name in enumerate(names):
            if v is None:
                raise TemplateError(f"nil pointer evaluating {'.'.join(names[:i]) or '.'}.{name}")
            if isinstance(v, dict):
                v = v.get(name)
            elif isinstance(v, _Files):
                raise TemplateError(f".Files.{name} is not in minihelm's subset")
            else:
                raise TemplateError(f"can't evaluate field {name} in {type(v).__name__}")
        return v


def merge(base: dict, over: dict) -> dict:
    """Helm's values merge: maps merge recursively, anything else replaces, None deletes."""
    for k, v in over.items():
        if v is None:
            base.pop(k, None)
        elif isinstance(v, dict) and isinstance(base.get(k), dict):
            merge(base[k], v)
        else:
            base[k] = copy.deepcopy(v)
    return base


def manifests(rendered: dict[str, str]) -> list[dict]:
    """Every non-empty YAML document of the rendered .yaml templates, each tagged with its source."""
    docs = []
    for name, text in rendered.items():
        if not name.endswith((".yaml", ".yml")):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc.setdefault("metadata", {})
                docs.append({"__source__": name, **doc})
    return docs
