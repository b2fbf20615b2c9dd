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


def _probes_executor(node: ast.AST) -> bool:
    """A getattr/hasattr call whose object is an executor (its source names one: `executor`, `self.executor`, ...)."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
            and bool(node.args) and "executor" in ast.unparse(node.args[0]).lower())


def test_no_module_probes_an_executor_with_getattr_or_hasattr():
    """A capability of an executor is declared on its base class with a default (STYLE.md 19), never probed."""
    probes = [(path, node.lineno, ast.unparse(node)) for path, tree in _modules() for node in ast.walk(tree)
              if _probes_executor(node)]
    assert not probes, f"executor capabilities probed instead of declared: {probes}"
    bad = ast.parse("x = getattr(self.executor, 'graphs', None)\ny = hasattr(executor, 'shutdown')")
    assert sum(_probes_executor(n) for n in ast.walk(bad)) == 2  # the scan sees what it looks for


def test_code_cites_the_architecture_doc_not_a_file_outside_the_repository():
    """docs/architecture.md is the living spec; the original design document is not in the repository."""
    roots = [PACKAGE, PACKAGE.parent / "tests", PACKAGE.parent / "benchmarks", PACKAGE.parent / "tools"]
    files = [p for root in roots if root.is_dir() for p in root.rglob("*.py")]
    assert len(files) > 100
    hits = [str(p) for p in files if "DESIGN" + ".md" in p.read_text()]
    assert not hits, f"cite docs/architecture.md §N, not the original design document: {hits}"


_ENGINE_ATTRS = ("engine", "_engine")


def _reaches_past_the_loop(tree: ast.Module) -> list[str]:
    """Where a serving module reaches into an engine it does not own (STYLE.md 20): an attribute read through
    `X.engine` / `X._engine` where X is anything but bare `self` (`loop.engine.plan`, `self.engine.engine.x`), or the
    engine of a loop taken at all (`loop.engine`, `self.loop._engine`). The EngineLoop's own `self._engine.step()` is
    fine: that is the owner. Storing an object under the name (`app.state.engine = aengine`) is fine too."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        inner = node.value
        through = (isinstance(inner, ast.Attribute) and inner.attr in _ENGINE_ATTRS
                   and not (isinstance(inner.value, ast.Name) and inner.value.id == "self"))
        owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
        of_a_loop = node.attr in _ENGINE_ATTRS and owner in ("loop", "_loop")
        if through or of_a_loop:
            found.append(ast.unparse(node))
    return found


def _private_runtime_names(tree: ast.Module) -> list[str]:
    """Private names (one leading underscore) a module takes from trtopt.runtime.*: `from trtopt.runtime.engine
    import _Group`, or `_x` read off an imported runtime module (`engine._grammar_lock`, `trtopt.runtime.engine._y`)."""
    found, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("trtopt.runtime"):
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            if node.module == "trtopt.runtime":  # `from trtopt.runtime import engine`: a module
                modules |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name.startswith("trtopt.runtime")}
    for node in ast.walk(tree):
        private = isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
        if private and ast.unparse(node.value) in modules:
            found.append(ast.unparse(node))
    return found


def test_front_ends_use_the_loops_door_not_the_engine():
    """trtopt/serving talks to the engine only through EngineLoop / AsyncLLMEngine (prepare, submit, abort and
    read-only properties): no module reaches the engine through a loop, and none takes a private runtime name."""
    serving = [(path, tree) for path, tree in _modules() if path.startswith("serving/")]
    assert len(serving) > 5
    reaches = [(path, hit) for path, tree in serving for hit in _reaches_past_the_loop(tree)]
    assert not reaches, f"serving modules reaching into the engine past the loop: {reaches}"
    private = [(path, hit) for path, tree in serving for hit in _private_runtime_names(tree)]
    assert not private, f"serving modules using private trtopt.runtime names: {private}"
    # The scans see what they look for (and let the owner and plain names be).
    for line in ("a = self.loop.engine.input_processor", "b = self.engine.engine.compile_grammar(p)",
                 "c = engine.engine.plan.model.vocab_size", "d = loop._engine", "e = aengine.loop.engine"):
        assert _reaches_past_the_loop(ast.parse(line)), line
    good = ast.parse("self._engine.step()\nx = self.engine.tokenizer\napp.state.engine = aengine\nloop.tokenizer")
    assert _reaches_past_the_loop(good) == []
    bad = ast.parse("from trtopt.runtime.engine import LLMEngine, _Group\nimport trtopt.runtime.engine as eng\n"
                    "from trtopt.runtime import engine\neng._InFlight\nengine._grammar_lock\ntrtopt.runtime.engine._x")
    assert sorted(_private_runtime_names(bad)) == ["eng._InFlight", "engine._grammar_lock",
                                                   "trtopt.runtime.engine._Group"]


# ---- state is owned by objects, not modules (STYLE.md §12) ----------------------------------------------------------
_STATEFUL = ("plugins", "runtime")
_CONTAINER_CALLS = frozenset({"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter", "bytearray"})
_MUTATORS = frozenset({"append", "extend", "insert", "pop", "popitem", "clear", "update", "setdefault", "add",
                       "discard", "remove", "appendleft", "extendleft", "popleft", "sort", "reverse"})


def _mutable_container(value: ast.AST | None) -> bool:
    """A dict/list/set display or comprehension, or a call that makes an empty or filled container."""
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        fn = value.func
        name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
        return name in _CONTAINER_CALLS
    return False


def _module_containers(tree: ast.Module) -> set[str]:
    """Names the module binds, at its top level (under if/try too, not in a function or class), to a container."""
    names: set[str] = set()
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.If, ast.Try)):
            pending += [*node.body, *node.orelse, *getattr(node, "finalbody", []),
                        *(s for h in getattr(node, "handlers", []) for s in h.body)]
        elif isinstance(node, ast.Assign) and _mutable_container(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and _mutable_container(node.value):
            names.add(node.target.id)
    return names


def _mutated_in_functions(tree: ast.Module) -> set[str]:
    """Plain names that a function or method of the module mutates in place: `name[i] = x`, `name[i] += x`,
    `del name[i]`, or `name.append(...)` and the other mutating methods of dict, list, set and deque."""
    names: set[str] = set()
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    for function in functions:
        for node in ast.walk(function):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            for target in targets:
                if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                    names.add(target.value.id)
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS
                    and isinstance(node.func.value, ast.Name)):
                names.add(node.func.value.id)
    return names


def _module_state(tree: ast.Module) -> list[str]:
    """What makes a module hold state of its own: each `global` statement (a reassigned module name), and each
    module-level container that one of its functions mutates. A container only built at import (a table of ops, a
    constant map) is not state; a memo is written `functools.cache`/`lru_cache`, which this scan lets be."""
    found = [f"global {', '.join(node.names)}" for node in ast.walk(tree) if isinstance(node, ast.Global)]
    # A local of the same name shadows the module's; the scan is conservative and counts it anyway.
    found += sorted(_module_containers(tree) & _mutated_in_functions(tree))
    return found


def test_plugins_and_runtime_keep_no_module_state():
    """No module of trtopt/plugins or trtopt/runtime reassigns a module global or mutates a module-level container
    from a function: what is kept between calls belongs to an object that its owner passes along (the torch
    executor's PagedLaunchState, a Launcher's switch)."""
    modules = [(path, tree) for path, tree in _modules() if path.split("/")[0] in _STATEFUL]
    assert len(modules) > 40
    stateful = {path: hits for path, tree in modules if (hits := _module_state(tree))}
    assert not stateful, f"module-level state (STYLE.md §12): {stateful}"
    # The scan finds what it looks for, and lets import-time tables, locals and functools memos be.
    bad = ast.parse("import collections\n_CACHE = {}\n_SEEN: set[str] = set()\n_Q = collections.deque()\n"
                    "TABLE = {'a': 1}\n_N = 0\n"
                    "def f(k):\n    _CACHE[k] = 1\n    _SEEN.add(k)\n    _Q.append(k)\n    return TABLE[k]\n"
                    "def g():\n    global _N\n    _N += 1\n")
    assert _module_state(bad) == ["global _N", "_CACHE", "_Q", "_SEEN"], _module_state(bad)
    good = ast.parse("import functools\nTABLE = {'a': 1}\nTABLE['b'] = 2\n"
                     "@functools.cache\ndef memo(k):\n    return [k]\n"
                     "def f(k):\n    seen = set()\n    seen.add(k)\n    out = {}\n    out[k] = TABLE[k]\n"
                     "    return out\n"
                     "class C:\n    def __init__(self):\n        self.plans = {}\n    def put(self, k):\n"
                     "        self.plans[k] = 1\n")
    assert _module_state(good) == []
