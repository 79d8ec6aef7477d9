"""The package imports only downward: ops -> mixers -> backbone -> heads -> cli / eval; heads never import mixers.

Every ``import`` / ``from ... import`` of a mixlab module, at module level or inside a function,
is read from the source (no import is executed). ``mixlab/__init__.py`` is the package facade
(it gathers the registries, as ``timm/__init__.py`` does) and is not checked.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "mixlab"

# floor of each part of the package; a module may import modules on its own floor or below
FLOORS = {
    "mixlab.registry": 0, "mixlab.coords": 0, "mixlab.optim": 0, "mixlab.eval.metrics": 0, "mixlab.data": 0,
    "mixlab.distributed": 0, "mixlab.datamodules": 1,
    "mixlab.ops": 1, "mixlab.mixers": 2, "mixlab.backbone": 3, "mixlab.heads": 4,
    "mixlab.callbacks": 5, "mixlab.tb": 5, "mixlab.eval": 6, "mixlab.cli": 6, "mixlab.overrides": 6,
    "mixlab.__main__": 7,
}
LEAVES = {"mixlab.registry", "mixlab.eval.metrics"}  # import nothing of mixlab
FACADE = 2  # ``import mixlab`` imports the mixers


def _floor(module: str) -> int:
    best = max((p for p in FLOORS if module == p or module.startswith(p + ".")), key=len)
    return FLOORS[best]


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in (ROOT / "datamodules").rglob("*.py"):
        parts = ("mixlab", "datamodules") + path.relative_to(ROOT / "datamodules").with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES}
    return {m for m in found if m == "mixlab" or m.startswith("mixlab.")}


MODULES = _modules()


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "mixlab"))
def test_no_upward_import(module):
    mine = _floor(module)
    targets = {t for t in _imports(MODULES[module]) if t in MODULES or t == "mixlab"}
    if module in LEAVES:
        assert not targets, f"{module} is a leaf and imports {sorted(targets)}"
    if module == "mixlab.datamodules.genome":
        targets.discard("mixlab")  # only to find the shipped data when mixlab is a namespace package
    upward = sorted(t for t in targets if (FACADE if t == "mixlab" else _floor(t)) > mine)
    assert not upward, f"{module} (floor {mine}) imports {upward}"
    if module.startswith("mixlab.datamodules"):
        assert not any(t.startswith(("mixlab.heads", "mixlab.backbone", "mixlab.mixers")) for t in targets), targets
    if module.startswith("mixlab.heads"):  # heads talk to the backbone, never to mixer internals
        assert not any(t.startswith(("mixlab.mixers", "mixlab.ops", "mixlab.registry")) for t in targets), targets
