"""Dependencies' private internals are reached only from raytrain_cpu/compat/, whose modules
fail at import, naming what to do, on a version they were not written for."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from raytrain_cpu.compat import CompatError, written_for

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "raytrain_cpu"
COMPAT = PACKAGE / "compat"

DEPENDENCIES = ("ray", "deepspeed", "transformers", "torch", "numpy", "accelerate", "peft", "datasets")
INTERNAL_NAMES = (
    "checkpoint_manager_snapshot",
    "_get_ckpt_name",
    "_get_zero_ckpt_name",
    "_prepare_fp32_grad_for_sub_group",
    "reduce_scatter_coalesced",
    "cdb",
    "initialize_weights_zero3",
    "_can_set_attn_implementation",
    "_distributed_c10d",
    "_rebuild_tensor_v2",
    "_reconstruct",
    "_global_node",
    "_raylet",
    "_private",
    "_internal",
)
NAMED = re.compile(r"(?<![A-Za-z0-9])(" + "|".join(map(re.escape, INTERNAL_NAMES)) + r")(?![A-Za-z0-9_])")


def _private_module(module: str) -> bool:
    """`ray._private.x`, `torch._dynamo`: a `_`-prefixed submodule of a dependency."""
    parts = module.split(".")
    return parts[0] in DEPENDENCIES and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def _private_attribute(node: ast.Attribute) -> bool:
    """`torch._softmax_backward_data`, `np._core`: a dependency module's `_`-prefixed attribute."""
    base = node.value.id if isinstance(node.value, ast.Name) else ""
    return (base in DEPENDENCIES or base == "np") and node.attr.startswith("_") and not node.attr.startswith("__")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are docstrings (prose may name an internal)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _findings(path: Path, root: Path = ROOT) -> list[str]:
    """'file:line: imports X' / 'file:line: names X' for each use of an internal in `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docs = _docstrings(tree)
    where = path.relative_to(root)
    found = []
    for node in ast.walk(tree):
        texts: list[str] = []
        if isinstance(node, ast.Import):
            texts = [a.name for a in node.names]
            found += [f"{where}:{node.lineno}: imports {m}" for m in texts if _private_module(m)]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            texts = [node.module, *(a.name for a in node.names)]
            mods = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            found += [f"{where}:{node.lineno}: imports {m}" for m in mods if _private_module(m)][:1]
        elif isinstance(node, ast.Name):
            texts = [node.id]
        elif isinstance(node, ast.Attribute):
            texts = [node.attr]
            if _private_attribute(node):
                found.append(f"{where}:{node.lineno}: uses {node.value.id}.{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            texts = [node.value]
        found += [f"{where}:{node.lineno}: names {m.group(1)}" for t in texts if (m := NAMED.search(t))]
    return found


def test_internals_are_reached_only_from_compat():
    """An AST scan of the package outside compat/: no import of a dependency's `_`-prefixed
    submodule, no `_`-prefixed attribute of a dependency's module (torch._x), and none of the
    internals' names in code or in strings other than docstrings."""
    found = sorted({f for p in sorted(PACKAGE.rglob("*.py")) if COMPAT not in p.parents for f in _findings(p)})
    assert not found, "dependency internals outside raytrain_cpu/compat/:\n" + "\n".join(found)


def test_the_scan_finds_each_kind_of_use_with_its_line(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""Docstrings may name ray._private."""\n'
        "import torch._dynamo\n"
        "from ray._private import services\n"
        "x = engine._get_ckpt_name('d', 't')\n"
        'logger = "ray.train.v2._internal.cleaner"\n'
        "import ray.util\n"
        "y = torch._foreach_add(a, b) + torch.__version__\n"
    )
    assert set(_findings(sample, tmp_path)) == {
        "sample.py:2: imports torch._dynamo",
        "sample.py:3: imports ray._private",
        "sample.py:3: names _private",
        "sample.py:4: names _get_ckpt_name",
        "sample.py:5: names _internal",
        "sample.py:7: uses torch._foreach_add",
    }


def test_written_for_names_the_module_the_versions_and_the_fix():
    """A compat module written for another version of an installed package fails at import with
    its name, the versions and what to do; a matching prefix returns the installed version."""
    installed = written_for("raytrain_cpu.compat.sample", "pytest", pytest.__version__.split(".")[0])
    assert installed == pytest.__version__
    with pytest.raises(CompatError) as e:
        written_for("raytrain_cpu.compat.sample", "pytest", "0.1")
    message = str(e.value)
    assert "raytrain_cpu.compat.sample" in message and "pytest 0.1.*" in message
    assert f"{pytest.__version__} is installed" in message and "pip install -e ." in message
    with pytest.raises(CompatError, match="not installed"):
        written_for("raytrain_cpu.compat.sample", "no-such-package-raytrain", "1")


def test_written_for_matches_version_prefixes_by_part():
    """ "2.60" matches 2.60.0 and 2.60.1+cpu, not 2.61.0 or 2.6.0."""
    from raytrain_cpu.compat import _matches

    assert _matches("2.60.0", "2.60") and _matches("2.60.1+cpu", "2.60")
    assert not _matches("2.61.0", "2.60") and not _matches("2.6.0", "2.60")


def test_compat_modules_declare_their_versions():
    """Every compat module calls written_for at import, at module level."""
    for path in sorted(COMPAT.glob("*.py")):
        if path.name == "__init__.py":
            continue
        calls = [
            n
            for n in ast.parse(path.read_text()).body
            if isinstance(n, ast.Expr)
            and isinstance(n.value, ast.Call)
            and getattr(n.value.func, "id", "") == "written_for"
        ]
        assert calls, f"{path.relative_to(ROOT)} does not call written_for(__name__, ...) at import"
