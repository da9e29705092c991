"""Rules about the product code that a test can check, by reading it (``ast``), not running it:

1. One owner for where a block lives: only :mod:`kvstore.daemon.residency` and its state,
   :mod:`kvstore.daemon.placement` (and the block record itself, :mod:`kvstore.daemon.index`) assigns a block's placement (``busy``,
   ``on_nvme``, ``hbm_slot``, ``tier``, ``offset``), DRAM back-pressure, or frees DRAM and HBM
   slots; the core may place a block's ``offset`` when it reserves it, nothing more.
2. The tier movers (demotion, promotion, write-out, HBM copies) never take the daemon's lock:
   each public call of the residency is one hold of it.
3. No import cycle between packages (each folder of the product is one), so the vocabulary
   sits below the tiers, the tiers below the daemon and the clients, and the front-ends
   (:mod:`kvstore.app`) above everything.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"kvstore": "kvstore", "kvstore.tiers": "tiers", "kvstore.transport": "transport",
            "kvstore.clients": "clients"}  # pyproject.toml's package-dir
RESIDENCY = {"busy", "on_nvme", "hbm_slot", "tier", "offset"}
OWNERS = {"kvstore.daemon.residency": RESIDENCY | {"pressure"}, "kvstore.daemon.placement": RESIDENCY | {"pressure"},
          "kvstore.daemon.index": RESIDENCY,
          "kvstore.daemon.core": {"offset"}}
MOVERS = ("kvstore.daemon.demoter", "kvstore.daemon.promotion", "kvstore.daemon.write_out",
          "kvstore.daemon.nvme_io", "kvstore.daemon.hbm_cache", "kvstore.daemon.tiering")


def product_modules() -> dict[str, Path]:
    mods = {}
    for pkg, folder in PACKAGES.items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = list(f.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([pkg, *parts])] = f
    return mods


MODULES = product_modules()
TREES = {name: ast.parse(f.read_text(), str(f)) for name, f in MODULES.items()}


def assigned_attrs(tree: ast.AST):
    """(attribute, line) of every attribute assignment target, augmented and unpacked ones too."""
    def targets(t):
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                yield from targets(e)
        elif isinstance(t, ast.Starred):
            yield from targets(t.value)
        else:
            yield t

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            tgts = [x for t in node.targets for x in targets(t)]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            tgts = list(targets(node.target))
        else:
            continue
        for t in tgts:
            while isinstance(t, ast.Attribute):
                yield t.attr, node.lineno
                t = t.value  # x.pressure.moving = ... writes pressure as well


def slot_frees(tree: ast.AST):
    """Lines that call ``<...>.dram.free(...)`` or ``<...>.hbm.free(...)``."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "free"
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr in ("dram", "hbm")):
            yield node.lineno


def test_the_rules_see_what_they_check():
    """The readers find a write and a free where there is one (else the rules below would pass
    on anything)."""
    tree = ast.parse("b.busy = True\nx.pressure.moving += 1\nb.tier, b.offset = t, o\nself.core.dram.free(n, o)\n")
    assert sorted(a for a, _ in assigned_attrs(tree)) == ["busy", "moving", "offset", "pressure", "tier"]
    assert list(slot_frees(tree)) == [4]
    assert "kvstore.daemon.residency" in MODULES and "kvstore.app.cli" in MODULES


def test_only_the_residency_writes_where_a_block_lives():
    found = []
    for name, tree in TREES.items():
        allowed = OWNERS.get(name, set())
        for attr, line in assigned_attrs(tree):
            if attr in (RESIDENCY | {"pressure"}) - allowed and name.startswith("kvstore.daemon"):
                found.append(f"{name}:{line} assigns .{attr}")
            elif attr in {"busy", "on_nvme", "hbm_slot", "pressure"} - allowed:
                found.append(f"{name}:{line} assigns .{attr}")
        if name not in ("kvstore.daemon.residency", "kvstore.daemon.placement"):
            found += [f"{name}:{line} frees a DRAM/HBM slot" for line in slot_frees(tree)]
    assert found == []


def test_tier_movers_never_hold_the_lock_themselves():
    found = []
    for name in MOVERS:
        for node in ast.walk(TREES[name]):
            if isinstance(node, ast.Attribute) and node.attr in ("lock", "changed"):
                found.append(f"{name}:{node.lineno} uses .{node.attr}")
            if isinstance(node, ast.Name) and node.id == "Core":
                found.append(f"{name}:{node.lineno} names Core (movers get the residency)")
    assert found == []


def package_of(name: str) -> str:
    if name == "kvstore.__main__":  # ``python -m kvstore``: a front-end
        return "kvstore.app"
    return name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]


def import_edges() -> dict[tuple[str, str], list[str]]:
    """(package, package it imports) -> importing modules; imports under TYPE_CHECKING are left
    out (annotations only: nothing runs them)."""
    edges = defaultdict(list)
    for name, tree in TREES.items():
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        src = package_of(name)
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                wanted = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                wanted = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for t in wanted:
                while t not in MODULES and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in MODULES and package_of(t) != src:
                    edges[(src, package_of(t))].append(name)
    return edges


def cycles(edges) -> list[list[str]]:
    """Strongly connected groups of more than one package (Tarjan)."""
    graph = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({("a", "b"): [], ("b", "c"): [], ("c", "a"): [], ("c", "d"): []}) == [["a", "b", "c"]]


def test_no_import_cycle_between_packages():
    edges = import_edges()
    found = cycles(edges)
    detail = {g: {f"{a} -> {b}": sorted(set(m))[:4] for (a, b), m in edges.items() if a in g and b in g}
              for g in map(tuple, found)}
    assert found == [], detail


@pytest.mark.parametrize("low", ["kvstore.daemon", "kvstore.clients", "kvstore.tiers", "kvstore.transport",
                                 "kvstore.cluster", "kvstore"])
def test_front_ends_sit_above_everything(low):
    assert not [m for (a, b), m in import_edges().items() if a == low and b.startswith("kvstore.app")]
