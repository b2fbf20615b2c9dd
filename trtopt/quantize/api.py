"""`quantize_model(src, out, QuantizeConfig)`: an exported float model -> the same model directory with standard
Q/DQ nodes (FP8 W8A8 with static or dynamic per-token activation scales, FP8 weight-only, INT4 W4A16 by RTN or AWQ).

The steps: load and check the graph (trtopt/quantize/graph.py), lift the opset (19 for FP8, 21 for blocked INT4
and per-token FP8), calibrate on the fixed text rule when the method needs activations (data.py, calibrate.py),
quantize each weight (methods.py) and write the Q/DQ nodes (qdq.py).
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from trtopt.errors import QuantizeError
from trtopt.quantize import data
from trtopt.quantize.graph import MatMulTarget, find_targets, load_model, opset_of, resolve_model_path, \
    save_model_dir, upgrade_opset, weight_array
from trtopt.quantize.methods import (FP8_MAX, GptqFactor, QuantizedWeight, awq_search, fp8_clip_search, gptq_factor,
                                     gptq_fp8, gptq_int4, group_hessians, int4_clip_search, output_mse, quantize_fp8,
                                     quantize_int4)
from trtopt.quantize.sensitivity import DEFAULT_WINDOWS, MatMulQuant, SensitivityReport, apply_quant, \
    group_by_layer, layer_sensitivity, module_paths

WEIGHT_FORMATS = ("fp8", "int4")
ACTIVATION_FORMATS = ("fp8",)
ACTIVATION_SCALES = ("static", "dynamic")
METHODS = ("rtn", "awq", "gptq")
KV_CACHE_FORMATS = ("fp8",)  # --kv-cache: calibrate the FP8 KV cache's per-layer K and V scales


def default_method(weights: str) -> str:
    """`trtopt quantize`'s --method when none is given: gptq for FP8 (SmolLM2-135M W8A8 dynamic: +3.2% ppl by rtn,
    under 2% by gptq; docs/benchmarks/quant_accuracy.json), rtn for INT4 (awq is the accurate choice there, and it
    calibrates). ``QuantizeConfig`` itself keeps rtn: library callers say what they want."""
    return "gptq" if weights == "fp8" else "rtn"


@dataclass(frozen=True)
class QuantizeConfig:
    """What to quantize and how; validated by ``check()``."""

    weights: str = "fp8"  # fp8 (per output channel) | int4 (blocked over K)
    activations: str | None = None  # None: weight-only; fp8: W8A8 (needs weights fp8)
    activation_scales: str = "static"  # static: one calibrated scale per tensor; dynamic: per token at run time
    method: str = "rtn"  # rtn | awq (int4 only) | gptq (error-compensating rounding on calibration text)
    group_size: int = 128  # INT4 block size over K; must divide every quantized MatMul's K
    asymmetric: bool = False  # INT4: uint4 + zero point instead of symmetric int4
    clip_search: bool | None = None  # search a per-channel/group clip ratio; None: on for awq and gptq, off for rtn
    exclude: tuple[str, ...] = ()  # fnmatch patterns over MatMul node names and weight names, kept high precision
    auto_exclude: int = 0  # `--exclude auto:N`: also keep the N layers that quantization hurts most high precision
    calibration_sequences: int = data.DEFAULT_CALIBRATION_SEQUENCES
    calibration_length: int = data.DEFAULT_CALIBRATION_LENGTH
    threads: int = 2  # onnxruntime intra-op threads for calibration
    # fp8: also calibrate each layer's FP8 KV-cache K and V scale (the amax of the K/V the model caches, / 448) and
    # record them in the model's metadata, where `trtopt build --kv-cache-dtype fp8` reads them (`kv_cache_scales`)
    kv_cache: str | None = None

    def check(self) -> None:
        def choose(what: str, value, allowed) -> None:
            if value not in allowed:
                raise QuantizeError(f"unknown {what} {value!r}; choose one of: {', '.join(map(str, allowed))}.")

        choose("--weights", self.weights, WEIGHT_FORMATS)
        if self.activations is not None:
            choose("--activations", self.activations, ACTIVATION_FORMATS)
        choose("--activation-scales", self.activation_scales, ACTIVATION_SCALES)
        choose("--method", self.method, METHODS)
        if self.kv_cache is not None:
            choose("--kv-cache", self.kv_cache, KV_CACHE_FORMATS)
        if self.activations == "fp8" and self.weights != "fp8":
            raise QuantizeError(f"--activations fp8 needs --weights fp8 (W8A8); {self.weights} weights are "
                                "weight-only (drop --activations).")
        if self.method == "awq" and self.weights != "int4":
            raise QuantizeError("--method awq is for --weights int4; FP8 weights use rtn.")
        if self.weights == "int4" and self.group_size <= 0:
            raise QuantizeError(f"--group-size must be positive, got {self.group_size}; try 32, 64 or 128.")
        if self.asymmetric and self.weights != "int4":
            raise QuantizeError("--asymmetric applies to --weights int4 only.")
        if self.auto_exclude < 0:
            raise QuantizeError(f"--exclude auto:N needs N >= 1, got {self.auto_exclude}.")

    @property
    def needed_opset(self) -> int:
        return 21 if self.weights == "int4" or (self.activations and self.activation_scales == "dynamic") else 19

    @property
    def searches_clip(self) -> bool:
        return self.method in ("awq", "gptq") if self.clip_search is None else self.clip_search

    def describe(self) -> str:
        if self.weights == "int4":
            kind = f"INT4 {'asym uint4' if self.asymmetric else 'sym int4'} g{self.group_size} {self.method.upper()}"
        else:
            kind = "FP8 weight-only" if self.activations is None else f"FP8 W8A8 ({self.activation_scales})"
            kind += " GPTQ" if self.method == "gptq" else ""
        return (kind + (" + clip search" if self.searches_clip else "")
                + (" + FP8 KV scales" if self.kv_cache == "fp8" else ""))


AUTO = "auto"
DEFAULT_AUTO_EXCLUDE = 2  # `--exclude auto` alone
METADATA_KEY = "trtopt.quantization"  # the quantized model's metadata_props entry: config, exclusions, sensitivity


def parse_exclude(values: Sequence[str]) -> tuple[tuple[str, ...], int]:
    """``--exclude`` values -> (fnmatch patterns, N of ``auto[:N]``; 0 without it). QuantizeError for a bad N."""
    patterns, auto = [], 0
    for value in values:
        if value != AUTO and not value.startswith(AUTO + ":"):
            patterns.append(value)
            continue
        text = value.partition(":")[2]
        try:
            auto = int(text) if text else DEFAULT_AUTO_EXCLUDE
        except ValueError:
            raise QuantizeError(f"--exclude {value}: N must be a positive integer (e.g. auto:2).") from None
        if auto <= 0:
            raise QuantizeError(f"--exclude {value}: N must be a positive integer (e.g. auto:2).")
    return tuple(patterns), auto


@dataclass(frozen=True)
class AwqGroup:
    """The AWQ outcome for the MatMuls that share one input."""

    matmuls: tuple[str, ...]
    alpha: float
    placement: str  # "folded" into the producing norm, or a "mul" inserted
    rtn_mse: float  # output MSE on the calibration tokens with plain RTN
    awq_mse: float  # ... with the searched scale
    final_mse: float  # ... with the searched scale and clip ratios (what is written)
    tensor: str = ""  # the shared input


@dataclass(frozen=True)
class QuantizeResult:
    out_dir: Path
    model_path: Path
    config: QuantizeConfig
    opset: int
    quantized: tuple[str, ...]  # MatMul node names
    skipped: dict[str, str]  # MatMul node name -> why it stays high precision
    activation_scales: dict[str, float] = field(default_factory=dict)  # static FP8: tensor -> scale
    awq: tuple[AwqGroup, ...] = ()
    calibration_tokens: int = 0
    seconds: float = 0.0
    sensitivity: SensitivityReport | None = None  # with --exclude auto:N: every layer's own error, worst first
    kv_cache: dict | None = None  # with --kv-cache fp8: the recorded K/V amax and scales per layer


def _check_group_size(targets: tuple[MatMulTarget, ...], group: int) -> None:
    bad = [t for t in targets if t.k % group]
    if bad:
        fits = math.gcd(*[t.k for t in targets])
        hint = next((g for g in (128, 64, 32, 16) if g < group and fits % g == 0), None)
        raise QuantizeError(f"--group-size {group} does not divide K={bad[0].k} of {bad[0].node} (weight "
                            f"{bad[0].weight}); " + (f"use --group-size {hint}, which divides every K." if hint else
                            f"every K divides by {fits} only; --exclude the odd MatMuls or pick a divisor of {fits}."))


def _needs_calibration(config: QuantizeConfig) -> bool:
    return (config.activations == "fp8" and config.activation_scales == "static") or config.method in ("awq", "gptq")


def _calibrate_kv_scales(model, sequences: np.ndarray, config: QuantizeConfig, progress: bool) -> dict:
    """The FP8 KV cache's scales of the float ``model``: each layer's amax over the calibration sequences of the K
    and V it caches (its present outputs: after RoPE, as a paged pool stores them), / 448 (E4M3's largest), as
    `kv_cache_scales(metadata)` gives them back. Recorded under "kv_cache" in the model's metadata."""
    import re

    from trtopt.quantize.calibrate import calibrate
    from trtopt.quantize.runner import OrtCausalLM

    presents = OrtCausalLM(model, threads=config.threads).present_of.values()
    by_layer: dict[int, dict[str, str]] = defaultdict(dict)
    for name in presents:
        match = re.search(r"(\d+)\D*?(key|value)\D*$", name)
        if match is None:
            raise QuantizeError(f"--kv-cache fp8: cannot tell the layer and K/V of the present output {name!r}; "
                                "quantize an export from `trtopt export`.")
        by_layer[int(match.group(1))][match.group(2)] = name
    layers = sorted(by_layer)
    if layers != list(range(len(layers))) or any(set(v) != {"key", "value"} for v in by_layer.values()):
        raise QuantizeError(f"--kv-cache fp8: the present outputs {sorted(presents)} are not a key and a value for "
                            "layers 0..N-1; quantize an export from `trtopt export`.")
    stats = calibrate(model, list(presents), sequences, hessian=False, threads=config.threads, progress=progress)
    amax = {kv: [stats[by_layer[i][kv]].absmax for i in layers] for kv in ("key", "value")}
    return {"dtype": "fp8", "k_amax": amax["key"], "v_amax": amax["value"],
            "k_scales": [a / FP8_MAX if a > 0 else 1.0 for a in amax["key"]],
            "v_scales": [a / FP8_MAX if a > 0 else 1.0 for a in amax["value"]],
            "calibration_tokens": int(sequences.size)}


def kv_cache_scales(metadata: dict[str, str]) -> tuple[list[float], list[float]] | None:
    """The FP8 KV cache's per-layer (K scales, V scales) a `trtopt quantize --kv-cache fp8` recorded in a model's
    metadata_props (as a dict), or None when it has none. The one reader of that record (trtopt build's)."""
    import json

    try:
        record = json.loads(metadata.get(METADATA_KEY, "{}")).get("kv_cache")
    except (ValueError, AttributeError):
        return None
    if not isinstance(record, dict) or record.get("dtype") != "fp8":
        return None
    return [float(v) for v in record["k_scales"]], [float(v) for v in record["v_scales"]]


def _calibration_sequences(src: Path, config: QuantizeConfig) -> np.ndarray:
    try:
        tokenizer = data.load_tokenizer(src.parent)
    except Exception as e:  # transformers raises OSError/ValueError/... for a missing or broken tokenizer
        raise QuantizeError(f"calibration needs the model's tokenizer files next to {src.name} ({type(e).__name__}); "
                            "quantize the directory `trtopt export` wrote (weight-only --method rtn needs no "
                            "calibration).") from e
    tokens = data.corpus_tokens(tokenizer)
    try:
        return data.with_bos(data.split_windows(tokens, calibration=(config.calibration_sequences,
                                                                     config.calibration_length)).calibration, tokenizer)
    except Exception as e:
        raise QuantizeError(str(e)) from e


def _quantize_weight(w: np.ndarray, config: QuantizeConfig, dtype, hessian: np.ndarray | None,
                     factor: GptqFactor | None = None) -> QuantizedWeight:
    """One [K, N] weight (already multiplied by AWQ's scale); ``hessian`` of its input weights the clip search and
    GPTQ (``factor``: GPTQ's inverse, shared by the MatMuls of one input)."""
    gptq = config.method == "gptq"
    assert hessian is not None or not gptq, "gptq needs the calibration Hessian"
    if config.weights == "fp8":
        ratio = fp8_clip_search(w, hessian=hessian, dtype=dtype) if config.searches_clip else None
        return (gptq_fp8(w, hessian, clip_ratio=ratio, factor=factor, dtype=dtype) if gptq else
                quantize_fp8(w, clip_ratio=ratio, dtype=dtype))
    sym, g = not config.asymmetric, config.group_size
    ratio = None
    if config.searches_clip:
        blocks = group_hessians(hessian, g) if hessian is not None else None
        ratio = int4_clip_search(w, g, symmetric=sym, blocks=blocks, dtype=dtype)
    if gptq:
        return gptq_int4(w, g, hessian, symmetric=sym, clip_ratio=ratio, factor=factor, dtype=dtype)
    return quantize_int4(w, g, symmetric=sym, clip_ratio=ratio, dtype=dtype)


def _quantize_groups(model, groups: dict[str, list[MatMulTarget]], config: QuantizeConfig, stats: dict,
                     progress: bool) -> tuple[list[MatMulQuant], list[AwqGroup]]:
    """Every target's codes and scales (the AWQ search included), in target order; nothing is written yet."""
    from trtopt.quantize.calibrate import _progress
    from trtopt.quantize.qdq import GraphEdit

    lookup = GraphEdit(model)  # read only: the float type of each weight
    specs, awq = [], []
    act_mode = "none" if config.activations is None else config.activation_scales
    with _progress(progress) as bar:
        task = bar.add_task(f"quantizing ({config.describe()})", total=sum(map(len, groups.values()))) if bar else None
        for tensor, members in groups.items():
            weights = [weight_array(model, t.weight).astype(np.float32) for t in members]
            _, dtype = lookup.float_type(members[0].weight)
            scale = None
            hessian = stats[tensor].hessian if tensor in stats else None
            if config.method == "awq":
                plain = dataclasses.replace(config, clip_search=False)
                found = awq_search(weights, stats[tensor].mean_abs, hessian,
                                   lambda w: _quantize_weight(w, plain, dtype, None).dequantize())
                scale = found.scale
                hessian = hessian / scale[:, None] / scale[None, :]  # H of x / s
            factor = gptq_factor(hessian) if config.method == "gptq" else None
            written = []
            for t, w in zip(members, weights):
                q = _quantize_weight(w if scale is None else w * scale[:, None], config, dtype, hessian, factor)
                absmax = stats[tensor].absmax if act_mode == "static" else None
                specs.append(MatMulQuant(t.node, q, act_mode, absmax, scale))
                written.append(q)
                if bar:
                    bar.advance(task)
            if scale is not None:
                final = sum(output_mse(w - q.dequantize() / scale[:, None], stats[tensor].hessian)
                            for w, q in zip(weights, written))
                awq.append(AwqGroup(tuple(t.node for t in members), found.alpha, "", found.rtn_mse, found.awq_mse,
                                    final, tensor))
    return specs, awq


def _sensitivity(model, specs: list[MatMulQuant], sequences: np.ndarray, paths: dict[str, str],
                 config: QuantizeConfig, progress: bool) -> SensitivityReport:
    """Each layer's own error on the first calibration windows (sensitivity.DEFAULT_WINDOWS of them, cut short)."""
    from trtopt.quantize.calibrate import _progress

    windows = sequences[:DEFAULT_WINDOWS[0], :DEFAULT_WINDOWS[1]].tolist()
    with _progress(progress) as bar:
        task = bar.add_task("layer sensitivity", total=None) if bar else None

        def on_progress(what: str, done: int, total: int) -> None:
            if bar:
                bar.update(task, description=what, completed=done, total=total)

        return layer_sensitivity(model, specs, windows, paths=paths, threads=config.threads, on_progress=on_progress)


def _exclude_sensitive(report: SensitivityReport, n: int, specs: list[MatMulQuant], awq: list[AwqGroup],
                       skipped: dict[str, str]) -> tuple[list[MatMulQuant], list[AwqGroup]]:
    """Drop the ``n`` most sensitive layers' MatMuls (``skipped`` says why)."""
    assert n < len(report.layers), f"auto:{n} leaves none of {len(report.layers)} layers quantized"
    drop = set()
    for rank, layer in enumerate(report.most_sensitive(n), start=1):
        for node in layer.nodes:
            skipped[node] = (f"--exclude auto:{n}: layer {layer.layer} ranks #{rank}, mean KL "
                             f"{layer.stats.mean_kl:.3g} quantized alone")
            drop.add(node)
    return [s for s in specs if s.node not in drop], [g for g in awq if not drop & set(g.matmuls)]


def _record(model, config: QuantizeConfig, skipped: dict[str, str], sensitivity: SensitivityReport | None,
            kv_cache: dict | None = None) -> None:
    """The recipe in the model's metadata_props (METADATA_KEY, JSON): config, what stayed float and why, ranking,
    and with --kv-cache fp8 the KV cache's calibrated scales (`kv_cache_scales` reads them)."""
    import json

    value = json.dumps({"config": dataclasses.asdict(config), "describe": config.describe(), "kept_float": skipped,
                        "sensitivity": sensitivity.to_dict() if sensitivity else None,
                        **({"kv_cache": kv_cache} if kv_cache else {})})
    kept = [p for p in model.metadata_props if p.key != METADATA_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key=METADATA_KEY, value=value)


def quantize_model(src: str | Path, out_dir: str | Path, config: QuantizeConfig, *, force: bool = False,
                   progress: bool = False) -> QuantizeResult:
    """Quantize the export at ``src`` (a .onnx file or a directory holding model.onnx) into ``out_dir``."""
    from trtopt.quantize.calibrate import calibrate

    start = time.perf_counter()
    config.check()
    src, out_dir = resolve_model_path(Path(src)), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        if not force:
            raise QuantizeError(f"output directory {out_dir} is not empty; pass --force to overwrite it.")
        if out_dir.resolve() == src.parent.resolve():
            raise QuantizeError(f"output directory {out_dir} holds the source model; write somewhere else.")
        shutil.rmtree(out_dir)
    model = load_model(src)
    targets = find_targets(model, exclude=config.exclude)
    if config.weights == "int4":
        _check_group_size(targets.quantize, config.group_size)
    paths = module_paths(model)  # which layer each MatMul is in, before the version converter drops node metadata
    layers = len(group_by_layer(paths, [t.node for t in targets.quantize]))
    if config.auto_exclude >= layers:
        raise QuantizeError(f"--exclude auto:{config.auto_exclude} would keep all {layers} quantized layers high "
                            f"precision; pass N < {layers}.")
    model = upgrade_opset(model, config.needed_opset)
    groups: dict[str, list[MatMulTarget]] = defaultdict(list)  # activation tensor -> the MatMuls reading it
    for t in targets.quantize:
        groups[t.activation].append(t)

    stats, tokens, sequences, kv_cache = {}, 0, None, None
    if _needs_calibration(config) or config.auto_exclude or config.kv_cache:  # (sensitivity: the first windows)
        sequences = _calibration_sequences(src, config)
    if config.kv_cache:  # on the float model, before any weight is quantized: the K/V the float model caches
        kv_cache = _calibrate_kv_scales(model, sequences, config, progress)
        tokens = int(sequences.size)
    if _needs_calibration(config):
        stats = calibrate(model, list(groups), sequences, hessian=config.method != "rtn" or config.searches_clip,
                          threads=config.threads, progress=progress)
        tokens = int(sequences.size)

    specs, awq = _quantize_groups(model, groups, config, stats, progress)
    skipped, sensitivity = dict(targets.skipped), None
    if config.auto_exclude:
        sensitivity = _sensitivity(model, specs, sequences, paths, config, progress)
        specs, awq = _exclude_sensitive(sensitivity, config.auto_exclude, specs, awq, skipped)
    written = apply_quant(model, specs)
    awq = [dataclasses.replace(g, placement=written.placements[g.tensor]) for g in awq]
    _record(model, config, skipped, sensitivity, kv_cache)
    path = save_model_dir(model, src, out_dir)
    return QuantizeResult(out_dir, path, config, opset_of(model), tuple(s.node for s in specs), skipped,
                          written.act_scales, tuple(awq), tokens, time.perf_counter() - start, sensitivity,
                          kv_cache)
