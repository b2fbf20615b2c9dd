"""`trtopt check`: run the same packed steps on every backend of a plan (and on the original export) and compare.

The workload is a few sequences whose prompts prefill in chunks packed with other sequences' decode rows, then
several all-decode steps (driver.packed_schedule), every step going through the paged signature into each
executor. Logits are compared on every scheduled row against one reference: the original export on onnxruntime
when one is given (the proof that the fusion kept the meaning), otherwise one backend of the plan (onnxruntime on
CPU by default: it runs the ops' ONNX function bodies, the executable specification). Every side is fed the
reference's greedy tokens, so the steps stay comparable even where a backend would pick another token; each
side's own greedy choice is reported next to the reference's.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

from trtopt.builder.plan import MODEL_FILE, PlanConfig, read_plan
from trtopt.builder.source import check_plan_model, resolve_model_path
from trtopt.check.backends import BACKENDS, BY_NAME, Backend, unavailable_reason
from trtopt.check.compare import ErrorStats, QuantStats, QuantTolerance, Tolerance, new_stats, tolerance_for
from trtopt.check.driver import BlockSource, Seq, blocks_needed, make_step, packed_schedule
from trtopt.check.marking import LayerProbe, check_source_names, layer_probes, marked_copy
from trtopt.check.original import OriginalModel, check_original
from trtopt.errors import BuildError, ConfigError, TrtOptError
from trtopt.runtime.executors.base import Executor

if TYPE_CHECKING:
    from trtopt.quantize.sensitivity import SensitivityReport

ORIGINAL = "original (onnxruntime-cpu)"
REPORT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Workload:
    """The inputs every side runs: prompts as token ids, the prefill chunk of sequence 0, decode steps after."""

    prompts: tuple[tuple[int, ...], ...]
    chunk: int
    decode_steps: int
    seed: int | None = None  # of the random prompts; None for given ones

    def to_dict(self) -> dict:
        return {"prompt_lens": [len(p) for p in self.prompts], "chunk": self.chunk,
                "decode_steps": self.decode_steps, "seed": self.seed}


def random_workload(plan: PlanConfig, *, num_seqs: int = 3, seed: int = 0, decode_steps: int = 4) -> Workload:
    """``num_seqs`` random prompts: the first spans two blocks and a bit (prefilled in chunks across steps), the
    others are short, so one run covers chunked prefill, whole prefill and decode rows packed in the same steps."""
    if num_seqs < 1:
        raise ConfigError(f"--seqs must be >= 1; got {num_seqs}.")
    bs = plan.limits.block_size
    lens = [2 * bs + 5, 6, 1, bs + 3, 11, 2, 3 * bs - 1, 4][:num_seqs] + [5] * max(0, num_seqs - 8)
    rng = np.random.default_rng(seed)
    prompts = tuple(tuple(int(t) for t in rng.integers(0, plan.model.vocab_size, n)) for n in lens)
    return Workload(prompts, chunk=max(bs // 2, 1), decode_steps=decode_steps, seed=seed)


@dataclasses.dataclass
class BackendResult:
    """One side of the comparison."""

    name: str
    status: str  # "reference" | "passed" | "failed" | "skipped" (unavailable here, not an error) | "error"
    reason: str = ""  # why skipped or errored
    seconds: float = 0.0  # load + every step
    logits: ErrorStats | QuantStats | None = None  # QuantStats: a quantized plan against its float original
    layers: list[ErrorStats] = dataclasses.field(default_factory=list)  # per layer (with --layerwise)
    greedy_tokens: list[list[int]] = dataclasses.field(default_factory=list)  # its own argmax per sequence

    @property
    def first_bad_layer(self) -> int | None:
        return next((i for i, stats in enumerate(self.layers) if not stats.passed), None)

    def to_dict(self) -> dict:
        return {
            "name": self.name, "status": self.status, "reason": self.reason or None, "seconds": round(self.seconds, 3),
            "logits_error": self.logits.to_dict() if self.logits else None,
            "layers": [{"layer": i, **s.to_dict()} for i, s in enumerate(self.layers)],
            "first_bad_layer": self.first_bad_layer,
            "greedy_tokens": self.greedy_tokens or None,
        }


@dataclasses.dataclass
class CheckReport:
    """What `trtopt check` found; ``passed`` decides its exit status."""

    plan: str
    original: str | None
    reference: str
    dtype: str
    tolerance: Tolerance | QuantTolerance  # QuantTolerance: a quantized plan against its float original
    workload: Workload
    layerwise: bool
    results: list[BackendResult]
    sensitivity: SensitivityReport | None = None  # --layerwise on a quantization check: every layer's own error

    @property
    def quantized(self) -> bool:
        return isinstance(self.tolerance, QuantTolerance)

    @property
    def passed(self) -> bool:
        compared = [r for r in self.results if r.status not in ("reference", "skipped")]
        return bool(compared) and all(r.status == "passed" for r in compared)

    def tokens_agree(self, result: BackendResult) -> tuple[int, int]:
        """(greedy choices equal to the reference's, all greedy choices) of one side."""
        ref = self.by_name(self.reference).greedy_tokens
        pairs = [(a, b) for mine, theirs in zip(result.greedy_tokens, ref) for a, b in zip(mine, theirs)]
        return sum(a == b for a, b in pairs), len(pairs)

    def by_name(self, name: str) -> BackendResult:
        return next(r for r in self.results if r.name == name)

    def to_dict(self) -> dict:
        out = {
            "version": REPORT_VERSION, "passed": self.passed, "plan": self.plan, "original": self.original,
            "reference": self.reference, "dtype": self.dtype, "layerwise": self.layerwise,
            "tolerance": self.tolerance.to_dict() if self.quantized else
            {"atol": self.tolerance.atol, "rtol": self.tolerance.rtol, "check": "elemwise"},
            "workload": self.workload.to_dict(),
            "backends": [{**r.to_dict(), "tokens_agree": list(self.tokens_agree(r)) if r.greedy_tokens else None}
                         for r in self.results],
        }
        if self.sensitivity is not None:  # only a quantization check with --layerwise has it
            out["sensitivity"] = self.sensitivity.to_dict()
        return out


@dataclasses.dataclass
class _Side:
    """A running side: an executor of the plan, or the original."""

    result: BackendResult
    # (step, active seqs, counts) -> (logits rows per sequence, per layer: its attention output per sequence; empty
    # where the side has no marked outputs)
    run: Callable


def load_checked_plan(plan_dir: Path) -> PlanConfig:
    """The plan of ``plan_dir`` if `trtopt check` can run it; BuildError/ConfigError saying why not."""
    if not plan_dir.exists():
        raise BuildError(f"{plan_dir} does not exist; pass a plan directory built by `trtopt build`.")
    plan = read_plan(plan_dir)
    check_plan_model(plan_dir / MODEL_FILE)
    if plan.kind != "paged":
        raise ConfigError(f"{plan_dir} is a {plan.kind!r} plan (no KV cache); `trtopt check` compares paged LLM plans.")
    if plan.parallel is not None and plan.parallel.size > 1:
        raise ConfigError(f"{plan_dir} is sharded for {plan.parallel.size} ranks; check the unsharded plan it was "
                          "built with (`trtopt build` without --tensor-parallel).")
    return plan


def run_check(plan_dir: str | Path, *, original: str | Path | None = None, backends: Sequence[str] = (),
              reference: str | None = None, workload: Workload | None = None, atol: float | None = None,
              rtol: float | None = None, layerwise: bool = False, quant_tolerance: QuantTolerance | None = None,
              on_progress: Callable[[str, int, int], None] | None = None) -> CheckReport:
    """Compare the plan's backends (all available ones unless ``backends`` names some) against the reference.

    original: the export the plan was built from (.onnx or its directory); it becomes the reference.
    reference: a backend name to compare the others with (plan-only checks; default onnxruntime-cpu when it can run
    the plan, else torch-cpu). layerwise: also compare every layer's attention output. A quantized plan against a
    float original is a quantization check (check/quantized.py): its logits are held to ``quant_tolerance``
    (default QuantTolerance()), its default workload is text, and layerwise ranks its layers by the error each adds
    alone. on_progress(what, done, total) is called as the work advances. Raises BuildError/ConfigError for unusable
    input.
    """
    plan_dir = Path(plan_dir)
    plan = load_checked_plan(plan_dir)
    original_path = _original_path(Path(original)) if original is not None else None
    quantization = _is_quantization_check(plan_dir, original_path, quant_tolerance, atol, rtol)
    if quantization:
        tolerance = quant_tolerance or QuantTolerance()
        tolerance.check()
    else:
        tolerance = tolerance_for(plan.model.dtype, atol=atol, rtol=rtol)
    workload = workload or default_workload(plan_dir, plan, quantization=quantization)
    _check_workload(workload, plan)
    chosen = _choose(backends, plan)
    runnable = [b for b, why in chosen if why is None]
    ref_name = ORIGINAL if original_path else _reference(reference, runnable)
    if original_path and reference:
        raise ConfigError("--reference names a plan backend, but with ORIGINAL.onnx the original is the reference.")
    if original_path is None and len(runnable) < 2:
        raise ConfigError(f"only {[b.name for b in runnable]} can run this {plan.model.dtype} plan here, so there is "
                          "nothing to compare it with: pass the export it was built from (`trtopt check ORIGINAL.onnx "
                          "PLAN`) or name another backend that can run it.")
    results = {b.name: BackendResult(b.name, "skipped", reason=why) for b, why in chosen if why is not None}
    num_blocks = blocks_needed([len(p) for p in workload.prompts], workload.decode_steps + 1, plan.limits.block_size)
    with tempfile.TemporaryDirectory(prefix="trtopt-check-") as scratch:
        probes = _probes(plan_dir, original_path) if layerwise and not quantization else []
        run_dir = plan_dir
        if probes:  # every backend runs a copy of the plan whose graph also outputs each layer's attention
            run_dir = marked_copy(plan_dir / MODEL_FILE, [p.plan_name for p in probes], Path(scratch) / "plan").parent
        executors = _open_executors(run_dir, plan, runnable, num_blocks, results)
        model = None
        if original_path is not None:
            started = time.perf_counter()
            names = [p.source_name for p in probes]
            marked = marked_copy(original_path, names, Path(scratch) / "original") if probes else original_path
            model = OriginalModel(marked, plan.model, extra_outputs=names)
            results[ORIGINAL] = BackendResult(ORIGINAL, "reference", seconds=time.perf_counter() - started)
        elif ref_name not in executors:
            raise ConfigError(f"the reference {ref_name} could not load this plan: {results[ref_name].reason}")
        compare_executors(plan, executors, workload, tolerance, original=model, reference=ref_name, probes=probes,
                          results=results, on_progress=on_progress)
        for name, executor in executors.items():
            if probes and not executor.extra_outputs:
                results[name].reason = "its layer-wise outputs are not marked (TensorRT)"
    sensitivity = None
    if quantization and layerwise:
        from trtopt.check.quantized import heldout_tokens, plan_sensitivity, sensitivity_sequences

        sequences = sensitivity_sequences(plan, heldout_tokens(plan_dir), workload)
        sensitivity = plan_sensitivity(plan_dir, original_path, sequences, on_progress=on_progress)
    ordered = [results[ref_name]] + [results[b.name] for b, _ in chosen if b.name != ref_name]
    return CheckReport(str(plan_dir), str(original_path) if original_path else None, ref_name, plan.model.dtype,
                       tolerance, workload, layerwise, ordered, sensitivity)


def default_workload(plan_dir: Path, plan: PlanConfig, *, quantization: bool, num_seqs: int = 3, seed: int = 0,
                     decode_steps: int = 4) -> Workload:
    """Random token ids; for a quantization check, text (held-out windows) when the plan has a tokenizer."""
    if quantization:
        from trtopt.check.quantized import heldout_tokens, text_workload

        tokens = heldout_tokens(plan_dir)
        if tokens is not None:
            return text_workload(plan, tokens, num_seqs=num_seqs, decode_steps=decode_steps)
    return random_workload(plan, num_seqs=num_seqs, seed=seed, decode_steps=decode_steps)


def is_quantization_check(plan_dir: Path, original: Path | None) -> bool:
    """A quantized plan against a float original (not against the quantized export it was built from)."""
    from trtopt.check.quantized import is_quantized

    return original is not None and is_quantized(plan_dir / MODEL_FILE) and not is_quantized(original)


def _is_quantization_check(plan_dir: Path, original: Path | None, quant_tolerance: QuantTolerance | None,
                           atol: float | None, rtol: float | None) -> bool:
    """is_quantization_check, with ConfigError for bars that do not apply to the check."""
    from trtopt.check.quantized import is_quantized

    quantization = is_quantization_check(plan_dir, original)
    if quant_tolerance is not None and not quantization:
        why = ("the plan is not quantized" if not is_quantized(plan_dir / MODEL_FILE) else
               "no float original was given" if original is None else "the original is quantized too")
        raise ConfigError(f"--min-top1/--max-kl/--max-dlogprob bound a quantized plan against the float export it was "
                          f"quantized from, but {why}; use --atol/--rtol, or run `trtopt check FLOAT_EXPORT "
                          "QUANTIZED_PLAN`.")
    if quantization and (atol is not None or rtol is not None):
        raise ConfigError("--atol/--rtol are the elementwise bar of float plans; a quantized plan against its float "
                          "export is held to --min-top1, --max-kl and --max-dlogprob.")
    return quantization


def _original_path(path: Path) -> Path:
    try:
        path = resolve_model_path(path)
    except BuildError as e:
        raise ConfigError(f"the original: {e}") from e
    check_original(path)
    return path


def _check_workload(workload: Workload, plan: PlanConfig) -> None:
    vocab, longest = plan.model.vocab_size, plan.limits.max_model_len
    for i, prompt in enumerate(workload.prompts):
        if not prompt:
            raise ConfigError(f"prompt {i} is empty; give every prompt at least one token.")
        if any(not 0 <= t < vocab for t in prompt):
            raise ConfigError(f"prompt {i} has token ids outside the plan's vocabulary [0, {vocab}).")
        if len(prompt) + workload.decode_steps + 1 > longest:
            raise ConfigError(f"prompt {i} ({len(prompt)} tokens) + {workload.decode_steps + 1} generated tokens "
                              f"exceed the plan's max_model_len {longest}; shorten it.")
    if len(workload.prompts) > plan.limits.max_num_seqs:
        raise ConfigError(f"{len(workload.prompts)} sequences exceed the plan's max_num_seqs "
                          f"{plan.limits.max_num_seqs}.")
    if workload.chunk < 1 or workload.decode_steps < 0:
        raise ConfigError("the prefill chunk must be >= 1 and the decode steps >= 0.")


def _choose(names: Sequence[str], plan: PlanConfig) -> list[tuple[Backend, str | None]]:
    """(backend, why it cannot run or None) for each named backend, or for every known one."""
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ConfigError(f"unknown backend(s) {unknown}; choose among {', '.join(BY_NAME)}.")
    picked = [BY_NAME[n] for n in dict.fromkeys(names)] if names else list(BACKENDS)
    return [(b, unavailable_reason(b, plan)) for b in picked]


def _reference(name: str | None, runnable: list[Backend]) -> str:
    names = [b.name for b in runnable]
    if not names:
        raise ConfigError("no chosen backend can run this plan here; see `trtopt check --help` for the backends.")
    if name is None:
        return "onnxruntime-cpu" if "onnxruntime-cpu" in names else names[0]
    if name not in names:
        raise ConfigError(f"the reference {name!r} is not among the backends that can run here: {names}.")
    return name


def _probes(plan_dir: Path, original: Path | None) -> list[LayerProbe]:
    probes = layer_probes(plan_dir / MODEL_FILE)
    if original is not None:
        check_source_names(probes, original)
    return probes


def _open_executors(plan_dir: Path, plan: PlanConfig, runnable: list[Backend], num_blocks: int,
                    results: dict[str, BackendResult]) -> dict[str, Executor]:
    """Load every backend (one that fails to load becomes an "error" result); returns the executors by name."""
    from trtopt.runtime.executors import create_executor

    executors = {}
    for backend in runnable:
        result = results[backend.name] = BackendResult(backend.name, "running")
        started = time.perf_counter()
        try:
            executors[backend.name] = create_executor(backend.executor, plan_dir, plan, device=backend.device,
                                                      num_blocks=num_blocks)
        except TrtOptError as e:
            result.status, result.reason = "error", f"{type(e).__name__}: {e}"
        except Exception as e:  # a backend's own loader (ORT, TensorRT) failing on this plan is a finding to report
            result.status, result.reason = "error", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        result.seconds = time.perf_counter() - started
    return executors


def compare_executors(plan: PlanConfig, executors: Mapping[str, Executor], workload: Workload,
                      tolerance: Tolerance | QuantTolerance,
                      *, original: OriginalModel | None = None, reference: str | None = None,
                      probes: Sequence[LayerProbe] = (), results: dict[str, BackendResult] | None = None,
                      on_progress: Callable[[str, int, int], None] | None = None) -> dict[str, BackendResult]:
    """Drive ``workload`` through every executor and the original, and compare each with the reference.

    executors: by name, their pools allocated with at least ``driver.blocks_needed`` blocks. The reference is the
    original when given, else ``executors[reference]``. probes: the layers to compare, read from each executor's
    ``extra_outputs`` (a plan marked by marking.marked_copy; an executor without them is compared on logits only)
    and from the original's marked outputs. Returns a result per side (``results`` updated when given), the
    reference's with status "reference" and the others' "passed" or "failed".
    """
    results = {} if results is None else results
    sides: dict[str, _Side] = {}
    if original is not None:
        results.setdefault(ORIGINAL, BackendResult(ORIGINAL, "reference"))
        sides[ORIGINAL] = _Side(results[ORIGINAL], _original_runner(original, list(probes)))
    for name, executor in executors.items():
        sides[name] = _Side(results.setdefault(name, BackendResult(name, "running")),
                            _plan_runner(executor, list(probes)))
    ref_name = ORIGINAL if original is not None else reference
    assert ref_name in sides, f"the reference {ref_name!r} is not among the sides {list(sides)}"
    _drive(workload, plan, sides, ref_name, tolerance, on_progress)
    for name, side in sides.items():
        r = side.result
        if name == ref_name:
            r.status = "reference"
        else:
            r.status = "failed" if not r.logits.passed or r.first_bad_layer is not None else "passed"
    return results


def _plan_runner(executor: Executor, probes: list[LayerProbe]) -> Callable:
    def run(step, active: list[Seq], counts: list[int]):
        logits = executor.execute(step).float().cpu().numpy()
        qsl = step.query_start_loc.tolist()
        rows = [logits[qsl[i]:qsl[i + 1]] for i in range(len(active))]  # every row was asked for (every_row)
        layers = []
        marked = executor.extra_outputs
        for probe in probes if all(p.plan_name in marked for p in probes) else ():
            out = marked[probe.plan_name].float().cpu().numpy()  # [1, Hq, T, D]
            packed = out.reshape(-1, out.shape[-2], out.shape[-1])
            layers.append([packed[:, qsl[i]:qsl[i + 1]] for i in range(len(active))])
        return rows, layers
    return run


def _original_runner(model: OriginalModel, probes: list[LayerProbe]) -> Callable:
    pasts: dict[int, dict] = {}  # id(Seq) -> its past KV

    def run(step, active: list[Seq], counts: list[int]):
        rows, per_seq = [], []
        for seq, n in zip(active, counts):
            start = seq.cached - n
            past = pasts.get(id(seq)) or model.new_state()
            logits, pasts[id(seq)], extras = model.step(past, seq.tokens[start:seq.cached], start)
            rows.append(logits)
            per_seq.append([extras[p.source_name] for p in probes])
        layers = []
        for layer, probe in enumerate(probes):
            layers.append([])
            for extras in per_seq:
                out = extras[layer].astype(np.float32)  # [B, Hq, n, D] or [B·Hq, n, D]
                layers[-1].append(out.reshape(-1, out.shape[-2], out.shape[-1]))
        return rows, layers
    return run


def _drive(workload: Workload, plan: PlanConfig, sides: dict[str, _Side], ref_name: str,
           tolerance: Tolerance | QuantTolerance,
           on_progress: Callable[[str, int, int], None] | None) -> None:
    seqs = [Seq(list(p)) for p in workload.prompts]
    blocks = BlockSource(blocks_needed([len(p) for p in workload.prompts], workload.decode_steps + 1,
                                       plan.limits.block_size))
    for side in sides.values():
        side.result.greedy_tokens = [[] for _ in seqs]
        if side.result.name != ref_name:
            side.result.logits = new_stats(tolerance)
            side.result.layers = []  # created at the first step that returns layers
    schedule = packed_schedule([len(p) for p in workload.prompts], chunk=workload.chunk,
                               decode_steps=workload.decode_steps)
    total = len(schedule) * len(sides)
    for index, counts in enumerate(schedule):
        active = [i for i, n in enumerate(counts) if n]
        step = make_step([seqs[i] for i in active], [counts[i] for i in active], plan.limits.block_size, blocks,
                         every_row=True)
        outputs = {}
        for done, (name, side) in enumerate(sides.items()):
            if on_progress:
                on_progress(f"step {index + 1}/{len(schedule)} on {name}", index * len(sides) + done, total)
            started = time.perf_counter()
            outputs[name] = side.run(step, [seqs[i] for i in active], [counts[i] for i in active])
            side.result.seconds += time.perf_counter() - started
        _compare(outputs, sides, ref_name, tolerance)
        ref_rows = outputs[ref_name][0]
        for row, i in enumerate(active):
            if seqs[i].cached < len(seqs[i].tokens):
                continue  # mid-prompt: no token is sampled
            for name, (rows, _) in outputs.items():
                sides[name].result.greedy_tokens[i].append(int(np.argmax(rows[row][-1])))
            seqs[i].tokens.append(int(np.argmax(ref_rows[row][-1])))  # every side continues with the reference's
    if on_progress:
        on_progress("done", total, total)


def _compare(outputs: dict, sides: dict[str, _Side], ref_name: str, tolerance: Tolerance) -> None:
    ref_rows, ref_layers = outputs[ref_name]
    for name, (rows, layers) in outputs.items():
        if name == ref_name:
            continue
        result = sides[name].result
        for got, ref in zip(rows, ref_rows):
            n = min(len(got), len(ref))  # an original that returns only the last row's logits: compare that one
            result.logits.add(got[-n:], ref[-n:])
        if layers and ref_layers and not result.layers:
            result.layers = [ErrorStats(tolerance) for _ in layers]
        for stats, got_layer, ref_layer in zip(result.layers, layers, ref_layers):
            for got, ref in zip(got_layer, ref_layer):
                stats.add(got, ref)
