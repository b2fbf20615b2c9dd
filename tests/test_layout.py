"""The package's contracts live in one place: import direction and the paged signature's names (issue 16)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import trtopt
from trtopt import signature

PACKAGE = Path(trtopt.__file__).parent
LOWER = ("builder", "fusion_passes", "plugins")  # may import each other and the top-level modules
UPPER = ("runtime", "serving", "cli", "check")


def _modules() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(PACKAGE)), ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))]


def _imported(tree: ast.Module) -> set[str]:
    """Every trtopt module a file imports, at the top or inside a function (lazy imports count too)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return {n for n in names if n.startswith("trtopt.")}


def test_build_fusion_passes_and_plugins_never_import_runtime_or_serving():
    arrows = [
        (path, name)
        for path, tree in _modules()
        if path.split("/")[0] in LOWER
        for name in _imported(tree)
        if name.split(".")[1] in UPPER
    ]
    assert not arrows, f"upward imports (builder/fusion_passes/plugins → runtime/serving/cli): {arrows}"


def _signature_literals() -> set[str]:
    names = {spec.name for spec in (*signature.STEP_INPUTS, signature.LOGITS)}
    return names | {signature.kv_input(0)[:-1], signature.kv_output(0)[:-1]}  # "kv_cache." and "kv_cache_out."


def test_signature_names_are_spelled_in_one_module():
    """Outside trtopt/signature.py, no module writes a §3 name as a string (f-string parts included).

    plugins/paged_attention/ is exempt: the op's own inputs share the names. export/ is exempt for the optimum-style
    names it exports (input_ids, position_ids, logits: the export's I/O, which the paged rewrite starts from).
    """
    literals = _signature_literals()
    export_names = {signature.INPUT_IDS.name, signature.POSITION_IDS.name, signature.LOGITS.name}
    found = []
    for path, tree in _modules():
        if path == "signature.py" or path.startswith("plugins/paged_attention/"):
            continue
        allowed = export_names if path.startswith("export/") else set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
                hit = text in literals or any(p.endswith(".") and re.fullmatch(re.escape(p) + r"\d*", text)
                                              for p in literals)
                if hit and text not in allowed:
                    found.append((path, node.lineno, text))
    assert not found, f"§3 names spelled outside trtopt/signature.py: {found}"


def test_the_scan_sees_what_it_looks_for():
    """The two scans above would pass vacuously if they read nothing: check they find the known spellings."""
    modules = dict(_modules())
    assert any(isinstance(n, ast.Constant) and n.value == "slot_mapping" for n in ast.walk(modules["signature.py"]))
    assert "trtopt.builder.plan" in _imported(modules["runtime/executors/trt_executor.py"])
