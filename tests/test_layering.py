"""Imports go one way: api -> engine -> runner -> models -> layers -> attention -> hal.

A lower layer may name a higher layer's types only under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "qiao"

# Higher number = higher layer. Modules not listed are shared leaves that import no layer.
LAYERS = {
    "qiao.hal": 0,
    "qiao.kernels": 0,
    "qiao.distributed": 0,
    "qiao.attention": 1,
    "qiao.layers": 2,
    "qiao.models": 3,
    "qiao.runner": 4,
    "qiao.engine": 5,
    "qiao.entrypoints": 6,
    # `qiao repository gc` takes its default cache folder from the server's settings.
    "qiao.repository.cli": 8,
    "qiao.repository": 6,
    # The batch runner and its command reuse the API layer's request handling; the job's lines
    # and state below them import no layer, so the server's Batch API can build on them.
    "qiao.batch.offline": 8,
    "qiao.batch.cli": 8,
    "qiao.batch.ray_batch": 8,
    "qiao.batch": 6,
    "qiao.api": 7,
    "qiao.export": 8,
    "qiao.cli": 8,
    "qiao.bench": 8,
}


def layer_of(module: str) -> int | None:
    for prefix, rank in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return rank
    return None


def runtime_imports(tree: ast.Module) -> list[str]:
    """Imported module names, skipping `if TYPE_CHECKING:` blocks."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
                continue
            if isinstance(child, ast.Import):
                names.extend(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                names.append(child.module)
            visit(child)

    visit(tree)
    return names


def test_imports_point_down_the_layers():
    violations = []
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        own = layer_of(module)
        for name in runtime_imports(ast.parse(path.read_text())):
            target = layer_of(name)
            if not name.startswith("qiao"):
                continue
            if own is None and target is not None and module != "qiao":
                violations.append(f"{module} (shared leaf) imports {name}")
            elif own is not None and target is not None and target > own:
                violations.append(f"{module} imports higher layer {name}")
    assert not violations, "\n".join(violations)
