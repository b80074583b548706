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
FRAMEWORK_GLUE = PACKAGE / "frameworks"
FRAMEWORKS = {"torch", "jax", "jaxlib", "cupy"}
# The public per-framework modules (import mooncake_ep.jax / mooncake_ep.torch, and DeepEP's torch API
# mooncake_ep.deep_ep): a user imports them for their framework, so they import it at module level;
# nothing else in the package imports them.
FRAMEWORK_FRONTS = {"jax.py": {"jax", "jaxlib"}, "torch.py": {"torch"}, "deep_ep.py": {"torch"}}

# module file -> package modules it must never import (at any level), and whether it may import
# GPU/framework libraries at module level.
NEVER = {
    "reference.py": {"buffer", "tensor", "kernels", "transport", "frameworks", "group", "layout", "_cuda_backend"},
    "group.py": {"buffer", "tensor", "kernels", "transport", "frameworks", "reference", "layout"},
    "validation.py": {"buffer", "kernels", "transport", "group", "reference", "layout", "_cuda_backend"},
    "tensor.py": {"buffer", "validation", "kernels", "transport", "frameworks", "group", "reference"},
    "_dlpack.py": {"buffer", "kernels", "transport", "frameworks", "group", "reference", "tensor"},
    "kernels.py": {"buffer", "tensor", "transport", "frameworks", "group", "reference"},
    "layout.py": {"buffer", "tensor", "kernels", "transport", "frameworks", "group", "reference"},
    "_handshake.py": {"buffer", "tensor", "kernels", "transport", "frameworks", "group", "reference", "layout",
                      "_cuda_backend"},
    # The framework fronts reach the kernels only through Buffer (and its launch entries).
    "jax.py": {"kernels", "transport", "_cuda_backend", "tensor", "_dlpack", "reference"},
    "torch.py": {"kernels", "transport", "_cuda_backend", "tensor", "_dlpack", "reference", "frameworks"},
    "deep_ep.py": {"kernels", "transport", "_cuda_backend", "tensor", "_dlpack", "reference", "frameworks"},
}
# frameworks/<file> -> what it must never import: no other framework, and nothing below the Buffer.
GLUE_NEVER = {
    "numpy.py": {"torch", "jax", "jaxlib", "cupy"},
    "torch.py": {"jax", "jaxlib", "cupy"},
    "cupy.py": {"torch", "jax", "jaxlib"},
    "jax.py": {"torch", "cupy"},
    "jax_ops.py": {"torch", "cupy"},
    "jax_split.py": {"torch", "cupy"},
    "jax_args.py": {"torch", "cupy"},
}
GLUE_NEVER_PACKAGE = {"kernels", "transport", "_cuda_backend", "_dlpack"}
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


@pytest.mark.parametrize("name", sorted(GLUE_NEVER))
def test_framework_glue_imports_only_its_own_framework(name):
    imported = package_imports(FRAMEWORK_GLUE / name, top_level_only=False)
    banned = GLUE_NEVER[name] | GLUE_NEVER_PACKAGE
    assert not imported & banned, f"frameworks/{name} imports {sorted(imported & banned)}"


def test_every_glue_module_is_in_the_table():
    assert sorted(p.name for p in FRAMEWORK_GLUE.glob("*.py") if p.name != "__init__.py") == sorted(GLUE_NEVER)


@pytest.mark.parametrize("path", sorted([*PACKAGE.glob("*.py"), *TRANSPORT.glob("*.py"), *FRAMEWORK_GLUE.glob("*.py")]),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_framework_at_module_level(path):
    imported = package_imports(path, top_level_only=True)
    allowed = FRAMEWORK_FRONTS.get(path.name, set()) if path.parent == PACKAGE else set()
    banned = FRAMEWORKS - allowed
    assert not imported & banned, f"{path.name} imports {sorted(imported & banned)} at module level"


@pytest.mark.parametrize("path", sorted([*PACKAGE.glob("*.py"), *PACKAGE.glob("*/*.py")]),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_nothing_imports_the_framework_fronts(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            assert name not in ("mooncake_ep.jax", "mooncake_ep.torch", "mooncake_ep.deep_ep"), \
                f"{path.name} imports {name}"


def test_import_needs_no_gpu_library_or_framework():
    code = ("import sys, mooncake_ep; "
            "print(sorted(m for m in ('torch', 'jax', 'cupy', 'cuda.bindings.nvrtc', 'mooncake_ep.jax', "
            "'mooncake_ep.torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"import mooncake_ep imported {out.strip()}"
