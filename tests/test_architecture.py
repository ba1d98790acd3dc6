"""The package's layering: no upward imports, no cycles, one row-block iterator, one block rule.

Layers, lowest first (a module may import from its own layer or below, never above):

    foundation   errors, settings, _validation, _warn, _optim, linalg, heuristics
    backend      backend/ (row blocks, kernel engine, blockwise gradients), options
    kernels      kernels/ (Fastfood; re-exports the engine names)
    solvers      solvers/ (CG, preconditioned CG, the Preconditioner / Solver protocols)
    operators    operators/, centers
    models       models/
    objectives   objectives/
    integrations integrations/, botorch, tuning, auto, plot

The package's ``__init__`` (the public namespace) is exempt.
"""
from __future__ import annotations

import ast
import itertools
import pathlib
import re

import pytest

import gpfalkon

ROOT = pathlib.Path(gpfalkon.__file__).parent

LAYERS = [
    {"errors", "settings", "_validation", "_warn", "_optim", "linalg", "heuristics"},
    {"backend", "options"},
    {"kernels"},
    {"solvers"},
    {"operators", "centers"},
    {"models"},
    {"objectives"},
    {"integrations", "botorch", "tuning", "auto", "plot"},
]


def _layer(unit: str) -> int:
    for i, names in enumerate(LAYERS):
        if unit in names:
            return i
    raise AssertionError(f"gpfalkon.{unit} is in no layer: add it to LAYERS in {__file__}")


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel == pathlib.Path("__init__.py"):
            continue
        yield rel, path


def _unit(rel: pathlib.Path) -> str:
    return rel.parts[0].removesuffix(".py")


def _imported_units(rel: pathlib.Path, source: str) -> set[str]:
    """gpfalkon top-level units (subpackage or module) imported by the module at ``rel``."""
    pkg = list(rel.parent.parts)
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)]
                parts = base + (node.module.split(".") if node.module else [])
                if parts:
                    out.add(parts[0])
                else:  # "from .. import settings" at the package root
                    out.update(a.name for a in node.names)
            elif node.module and node.module.split(".")[0] == "gpfalkon":
                parts = node.module.split(".")[1:]
                if parts:
                    out.add(parts[0])
                else:
                    out.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "gpfalkon" and len(parts) > 1:
                    out.add(parts[1])
    return out


def test_no_module_imports_from_a_higher_layer():
    upward = []
    for rel, path in _modules():
        own = _unit(rel)
        for dep in _imported_units(rel, path.read_text()):
            if dep != own and _layer(dep) > _layer(own):
                upward.append(f"{rel} ({own}, layer {_layer(own)}) imports {dep} (layer {_layer(dep)})")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_import_cycle_between_units():
    graph: dict[str, set[str]] = {}
    for rel, path in _modules():
        own = _unit(rel)
        graph.setdefault(own, set()).update(d for d in _imported_units(rel, path.read_text()) if d != own)
    state: dict[str, int] = {}

    def visit(u: str, stack: list[str]) -> None:
        state[u] = 1
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack, u, v]))
            if v not in state:
                visit(v, [*stack, u])
        state[u] = 2

    for u in sorted(graph):
        if u not in state:
            visit(u, [])


def test_layering_check_catches_an_upward_import():
    """The checker itself: a solver importing the operators is flagged (the old cycle)."""
    rel = pathlib.Path("solvers/falkon.py")
    deps = _imported_units(rel, "from ..operators.preconditioner import FalkonPreconditioner\n")
    assert deps == {"operators"} and _layer("operators") > _layer("solvers")


#: gpfalkon.auto's modules, lowest first: each imports only modules before it (the package docstring's list)
AUTO_ORDER = ["report", "kernels", "standardise", "sampling", "scoring", "costs", "loo", "race", "learn", "selection",
              "final", "growth", "leverage", "sizes", "calibration", "final_check", "loo_stage", "fit"]


def _sibling_imports(source: str) -> set[str]:
    """The sibling modules ``from .x import ...`` names (level-1 relative imports)."""
    return {node.module.split(".")[0] for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module}


def test_auto_modules_import_only_the_ones_before_them():
    package = ROOT / "auto"
    assert sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__") == sorted(AUTO_ORDER)
    for i, name in enumerate(AUTO_ORDER):
        later = _sibling_imports((package / f"{name}.py").read_text()) - set(AUTO_ORDER[:i])
        assert not later, f"gpfalkon.auto.{name} imports {sorted(later)}, not before it in {AUTO_ORDER}"
    assert _sibling_imports("from .fit import auto_fit\nfrom ..models import FalkonGP\n") == {"fit"}


_RANGE_STEP = re.compile(r"\brange\([^()]*,[^()]*,[^()]*\)")


def test_one_module_iterates_row_blocks_and_one_sizes_them():
    """Only backend/blocks.py steps through rows (``range(start, n, rows)``) and defines
    the block-size rule; every other module calls :func:`~gpfalkon.backend.row_blocks`.
    linalg/gram.py steps through the blocks of an M x M triangular factor (no data rows; the
    foundation layer cannot import the backend's iterator); backend/_triton_kernels.py steps through
    tiles inside GPU kernels (device code, where no Python iterator runs)."""
    stepping = [str(rel) for rel, path in _modules() if _RANGE_STEP.search(path.read_text())]
    assert stepping == ["backend/_triton_kernels.py", "backend/blocks.py", "linalg/gram.py"], stepping
    # the settings that size blocks are read in blocks.py only
    readers = sorted(
        str(rel)
        for rel, path in _modules()
        if re.search(r"settings\.(block_rows|memory_budget)\.value\(\)", path.read_text())
    )
    assert readers == ["backend/blocks.py"], readers


@pytest.mark.parametrize("n,m,rows", [(10, 5, None), (100_000, 1000, None), (100_000, 1000, 77), (3, 1000, 5000)])
def test_block_rule(n, m, rows):
    from gpfalkon.backend import GRADIENT, PRODUCT, block_rows_for, row_blocks

    r = block_rows_for(n, m, 8, PRODUCT, block_rows=rows)
    if rows is None:
        target = 16 * 2**20 // (m * 8)
        assert r == min(n, max(32, target - target % 8))
        assert r % 8 == 0 or r == n
    else:
        assert r == min(rows, n)
    # the memory budget caps the blocks: live_blocks x rows x M x itemsize <= budget
    tight = block_rows_for(n, m, 8, GRADIENT, memory_budget=8 * m * 8 * 3)
    assert tight == min(3, n)
    blocks = list(row_blocks(n, r))
    assert blocks[0][0] == 0 and blocks[-1][1] == n
    assert all(b[0] == a[1] for a, b in itertools.pairwise(blocks))
    assert all(0 < e - s <= r for s, e in blocks)
    with pytest.raises(ValueError, match="block_rows"):
        block_rows_for(n, m, 8, PRODUCT, block_rows=0)
    # on a CUDA device thin products take ~1 GiB blocks (launches amortised), within the budget
    if rows is None:
        gpu = block_rows_for(n, m, 8, PRODUCT, memory_budget=2**40, device="cuda")
        target = 2**30 // (m * 8)
        assert gpu == min(n, max(32, target - target % 8))
        assert block_rows_for(n, m, 8, PRODUCT, memory_budget=2 * 64 * m * 8, device="cuda") == min(n, 64)



def test_differentiable_passes_keep_their_graph_only_within_its_share_of_the_budget():
    """keeps_graph: n M graph_bytes <= budget / GRAPH_SHARE for AGGREGATE; never for a profile without
    graph_bytes; the budget is the argument, else the setting."""
    from gpfalkon.backend import AGGREGATE, GRADIENT, keeps_graph
    from gpfalkon.backend.blocks import GRAPH_SHARE

    n, m = 5000, 300
    fits = n * m * AGGREGATE.graph_bytes * GRAPH_SHARE
    assert keeps_graph(n, m, AGGREGATE, memory_budget=fits)
    assert not keeps_graph(n, m, AGGREGATE, memory_budget=fits - GRAPH_SHARE)
    assert not keeps_graph(n, m, GRADIENT, memory_budget=2**40)
    with gpfalkon.settings.memory_budget(fits):
        assert keeps_graph(n, m, AGGREGATE) and not keeps_graph(n + 1, m, AGGREGATE)
