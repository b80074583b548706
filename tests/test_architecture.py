"""The module table of STYLE.md, kept true: data and imports flow one way.

public API (buffer) -> validation -> tensor boundary -> kernel launch -> transport. Each row names
modules of the package a module must not import at module level (lazy imports inside functions
are how frameworks are reached, and are allowed).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import mooncake_ep

PACKAGE = Path(mooncake_ep.__file__).parent
TRANSPORT = Path(mooncake_ep.transport.__file__).parent
FRAMEWORKS = {"torch", "jax", "jaxlib", "cupy"}

# module file -> package modules it must never import (at any level), and whether it may import
# GPU/framework libraries at module level.
NEVER = {
    "reference.py": {"buffer", "tensor", "kernels", "transport", "frameworks", "group", "layout", "_cuda_backend"},
    "group.py": {"buffer", "tensor", "kernels", "transport", "frameworks", "reference", "layout"},
    "tensor.py": {"buffer", "kernels", "transport", "frameworks", "group", "reference"},
    "_dlpack.py": {"buffer", "kernels", "transport", "frameworks", "group", "reference", "tensor"},
    "kernels.py": {"buffer", "tensor", "transport", "frameworks", "group", "reference"},
    "layout.py": {"buffer", "tensor", "kernels", "transport", "frameworks", "group", "reference"},
    "_handshake.py": {"buffer", "tensor", "kernels", "transport", "frameworks", "group", "reference", "layout",
                      "_cuda_backend"},
}
TRANSPORT_NEVER = {"buffer", "kernels", "tensor", "frameworks", "reference"}


def package_imports(path: Path, top_level_only: bool) -> set[str]:
    """mooncake_ep submodules (first component) and third-party roots imported by a file."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                names.add(parts[1] if parts[0] == "mooncake_ep" and len(parts) > 1 else parts[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] == "mooncake_ep":
                names.update([parts[1]] if len(parts) > 1 else [alias.name for alias in node.names])
            else:
                names.add(parts[0])
    return names


@pytest.mark.parametrize("name", sorted(NEVER))
def test_lower_layers_do_not_reach_up(name):
    imported = package_imports(PACKAGE / name, top_level_only=False)
    assert not imported & NEVER[name], f"{name} imports {sorted(imported & NEVER[name])}"


@pytest.mark.parametrize("path", sorted(TRANSPORT.glob("*.py")), ids=lambda p: p.name)
def test_transport_does_not_reach_up(path):
    imported = package_imports(path, top_level_only=False)
    assert not imported & TRANSPORT_NEVER, f"transport/{path.name} imports {sorted(imported & TRANSPORT_NEVER)}"


@pytest.mark.parametrize("path", sorted([*PACKAGE.glob("*.py"), *TRANSPORT.glob("*.py")]), ids=lambda p: p.name)
def test_no_framework_at_module_level(path):
    imported = package_imports(path, top_level_only=True)
    assert not imported & FRAMEWORKS, f"{path.name} imports {sorted(imported & FRAMEWORKS)} at module level"


def test_import_needs_no_gpu_library_or_framework():
    code = ("import sys, mooncake_ep; "
            "print(sorted(m for m in ('torch', 'jax', 'cupy', 'cuda.bindings.nvrtc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"import mooncake_ep imported {out.strip()}"
