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

import numpy as np

from trtopt.errors import QuantizeError
from trtopt.quantize import data
from trtopt.quantize.graph import MatMulTarget, find_targets, load_model, opset_of, resolve_model_path, \
    save_model_dir, upgrade_opset, weight_array
from trtopt.quantize.methods import (QuantizedWeight, awq_search, fp8_clip_search, group_hessians,
                                     int4_clip_search, output_mse, quantize_fp8, quantize_int4)

WEIGHT_FORMATS = ("fp8", "int4")
ACTIVATION_FORMATS = ("fp8",)
ACTIVATION_SCALES = ("static", "dynamic")
METHODS = ("rtn", "awq")


@dataclass(frozen=True)
class QuantizeConfig:
    """What to quantize and how; validated by ``check()``."""

    weights: str = "fp8"  # fp8 (per output channel) | int4 (blocked over K)
    activations: str | None = None  # None: weight-only; fp8: W8A8 (needs weights fp8)
    activation_scales: str = "static"  # static: one calibrated scale per tensor; dynamic: per token at run time
    method: str = "rtn"  # rtn | awq (int4 only)
    group_size: int = 128  # INT4 block size over K; must divide every quantized MatMul's K
    asymmetric: bool = False  # INT4: uint4 + zero point instead of symmetric int4
    clip_search: bool | None = None  # search a per-channel/group clip ratio; None: on for awq, off for rtn
    exclude: tuple[str, ...] = ()  # fnmatch patterns over MatMul node names and weight names, kept high precision
    calibration_sequences: int = data.DEFAULT_CALIBRATION_SEQUENCES
    calibration_length: int = data.DEFAULT_CALIBRATION_LENGTH
    threads: int = 2  # onnxruntime intra-op threads for calibration

    def check(self) -> None:
        def choose(what: str, value, allowed) -> None:
            if value not in allowed:
                raise QuantizeError(f"unknown {what} {value!r}; choose one of: {', '.join(map(str, allowed))}.")

        choose("--weights", self.weights, WEIGHT_FORMATS)
        if self.activations is not None:
            choose("--activations", self.activations, ACTIVATION_FORMATS)
        choose("--activation-scales", self.activation_scales, ACTIVATION_SCALES)
        choose("--method", self.method, METHODS)
        if self.activations == "fp8" and self.weights != "fp8":
            raise QuantizeError(f"--activations fp8 needs --weights fp8 (W8A8); {self.weights} weights are "
                                "weight-only (drop --activations).")
        if self.method == "awq" and self.weights != "int4":
            raise QuantizeError("--method awq is for --weights int4; FP8 weights use rtn.")
        if self.weights == "int4" and self.group_size <= 0:
            raise QuantizeError(f"--group-size must be positive, got {self.group_size}; try 32, 64 or 128.")
        if self.asymmetric and self.weights != "int4":
            raise QuantizeError("--asymmetric applies to --weights int4 only.")

    @property
    def needed_opset(self) -> int:
        return 21 if self.weights == "int4" or (self.activations and self.activation_scales == "dynamic") else 19

    @property
    def searches_clip(self) -> bool:
        return self.method == "awq" if self.clip_search is None else self.clip_search

    def describe(self) -> str:
        if self.weights == "int4":
            kind = f"INT4 {'asym uint4' if self.asymmetric else 'sym int4'} g{self.group_size} {self.method.upper()}"
        else:
            kind = "FP8 weight-only" if self.activations is None else f"FP8 W8A8 ({self.activation_scales})"
        return kind + (" + clip search" if self.searches_clip else "")


@dataclass(frozen=True)
class AwqGroup:
    """The AWQ outcome for the MatMuls that share one input."""

    matmuls: tuple[str, ...]
    alpha: float
    placement: str  # "folded" into the producing norm, or a "mul" inserted
    rtn_mse: float  # output MSE on the calibration tokens with plain RTN
    awq_mse: float  # ... with the searched scale
    final_mse: float  # ... with the searched scale and clip ratios (what is written)


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


def _check_group_size(targets: tuple[MatMulTarget, ...], group: int) -> None:
    bad = [t for t in targets if t.k % group]
    if bad:
        fits = math.gcd(*[t.k for t in targets])
        hint = next((g for g in (128, 64, 32, 16) if g < group and fits % g == 0), None)
        raise QuantizeError(f"--group-size {group} does not divide K={bad[0].k} of {bad[0].node} (weight "
                            f"{bad[0].weight}); " + (f"use --group-size {hint}, which divides every K." if hint else
                            f"every K divides by {fits} only; --exclude the odd MatMuls or pick a divisor of {fits}."))


def _needs_calibration(config: QuantizeConfig) -> bool:
    return (config.activations == "fp8" and config.activation_scales == "static") or config.method == "awq"


def _calibration_sequences(src: Path, config: QuantizeConfig) -> np.ndarray:
    try:
        tokenizer = data.load_tokenizer(src.parent)
    except Exception as e:  # transformers raises OSError/ValueError/... for a missing or broken tokenizer
        raise QuantizeError(f"calibration needs the model's tokenizer files next to {src.name} ({type(e).__name__}); "
                            "quantize the directory `trtopt export` wrote.") from e
    tokens = data.corpus_tokens(tokenizer)
    try:
        return data.split_windows(tokens, calibration=(config.calibration_sequences,
                                                       config.calibration_length)).calibration
    except Exception as e:
        raise QuantizeError(str(e)) from e


def _quantize_weight(w: np.ndarray, config: QuantizeConfig, dtype, hessian: np.ndarray | None) -> QuantizedWeight:
    """One [K, N] weight (already multiplied by AWQ's scale); ``hessian`` of its input weights the clip search."""
    if config.weights == "fp8":
        ratio = fp8_clip_search(w, dtype=dtype) if config.searches_clip else None
        return quantize_fp8(w, clip_ratio=ratio, dtype=dtype)
    sym, g = not config.asymmetric, config.group_size
    ratio = None
    if config.searches_clip:
        blocks = group_hessians(hessian, g) if hessian is not None else None
        ratio = int4_clip_search(w, g, symmetric=sym, blocks=blocks, dtype=dtype)
    return quantize_int4(w, g, symmetric=sym, clip_ratio=ratio, dtype=dtype)


def quantize_model(src: str | Path, out_dir: str | Path, config: QuantizeConfig, *, force: bool = False,
                   progress: bool = False) -> QuantizeResult:
    """Quantize the export at ``src`` (a .onnx file or a directory holding model.onnx) into ``out_dir``."""
    from trtopt.quantize.calibrate import _progress, calibrate
    from trtopt.quantize.qdq import GraphEdit, write_dynamic_fp8, write_input_scale, write_static_fp8, write_weight

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
    model = upgrade_opset(model, config.needed_opset)
    groups: dict[str, list[MatMulTarget]] = defaultdict(list)  # activation tensor -> the MatMuls reading it
    for t in targets.quantize:
        groups[t.activation].append(t)

    stats, tokens = {}, 0
    if _needs_calibration(config):
        sequences = _calibration_sequences(src, config)
        stats = calibrate(model, list(groups), sequences, hessian=config.method == "awq", threads=config.threads,
                          progress=progress)
        tokens = int(sequences.size)

    edit = GraphEdit(model)
    act_scales, awq = {}, []
    with _progress(progress) as bar:
        task = bar.add_task(f"quantizing ({config.describe()})", total=len(targets.quantize)) if bar else None
        for tensor, members in groups.items():
            names = [t.node for t in members]
            weights = [weight_array(model, t.weight).astype(np.float32) for t in members]
            _, dtype = edit.float_type(members[0].weight)
            scale = None
            hessian = stats[tensor].hessian if tensor in stats else None
            if config.method == "awq":
                plain = dataclasses.replace(config, clip_search=False)
                found = awq_search(weights, stats[tensor].mean_abs, hessian,
                                   lambda w: _quantize_weight(w, plain, dtype, None).dequantize())
                scale = found.scale
                hessian = hessian / scale[:, None] / scale[None, :]  # H of x / s
            written = []
            for t, w in zip(members, weights):
                q = _quantize_weight(w if scale is None else w * scale[:, None], config, dtype, hessian)
                write_weight(edit, t.node, q, dtype)
                written.append(q)
                if bar:
                    bar.advance(task)
            if scale is not None:
                placement = write_input_scale(edit, tensor, names, scale, dtype)
                final = sum(output_mse(w - q.dequantize() / scale[:, None], stats[tensor].hessian)
                            for w, q in zip(weights, written))
                awq.append(AwqGroup(tuple(names), found.alpha, placement, found.rtn_mse, found.awq_mse, final))
            if config.activations == "fp8":
                k = members[0].k
                if config.activation_scales == "static":
                    act_scales[tensor] = write_static_fp8(edit, tensor, names, stats[tensor].absmax, dtype)
                else:
                    write_dynamic_fp8(edit, tensor, names, k, dtype)
    edit.commit()
    path = save_model_dir(model, src, out_dir)
    return QuantizeResult(out_dir, path, config, opset_of(model), tuple(t.node for t in targets.quantize),
                          targets.skipped, act_scales, tuple(awq), tokens, time.perf_counter() - start)
