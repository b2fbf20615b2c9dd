"""HF causal LM → ONNX with optimum-style I/O, verified against PyTorch on ONNX Runtime.

Graph I/O (every dim dynamic; the mask length has its own dim because dynamo rejects ``past + seq``):
  inputs   input_ids [batch, seq] · attention_mask [batch, total] · position_ids [batch, seq]
           past_key_values.{i}.key / .value [batch, kv_heads, past, head_dim]
  outputs  logits [batch, seq, vocab] · present.{i}.key / .value [batch, kv_heads, total, head_dim]
"""

from __future__ import annotations

import dataclasses
import shutil
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from trtopt.builder.model_facts import head_dims_from_config
from trtopt.errors import ExportError
from trtopt.export.models import resolve_model

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
EXPORTERS = ("dynamo", "legacy")
# Tolerance on max |ORT − PyTorch| / max(1, max |PyTorch|) per output. Scaling by the output's magnitude keeps the
# check meaningful for deep models: SmolLM2's logits reach ~35 and differ by ~1e-3 absolute in fp32 (summation
# order across 30 layers and a 49152-wide head), i.e. ~3e-5 relative, while its presents differ by ~1e-6.
TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 5e-2}
DEFAULT_OPSET = {"dynamo": 18, "legacy": 17}
EXTERNAL_DATA_THRESHOLD = 256 << 20  # bytes; protobuf cannot hold 2 GiB, so large models keep weights beside the graph
AUX_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
             "added_tokens.json")


@dataclasses.dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    onnx_path: Path
    exporter: str
    opset: int
    seconds: float  # wall time of the export itself (not the verification)
    max_abs_error: dict[str, float]  # verification case → max |ORT − PyTorch| over logits and presents
    max_rel_error: dict[str, float]  # the same, each output scaled by max(1, its largest |value|): what is checked
    unverified_because: str | None = None  # why the default verification was skipped (bf16), else None


class _OptimumStyle(torch.nn.Module):
    """Flat tensors in, flat tensors out: the optimum-style signature around an HF causal LM."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
        # No config: every layer is a full DynamicLayer, so a sliding-window layer's present keeps every position
        # (the paged cache holds them all; the window is the mask's job, proven by the build's mask probe). With
        # the config, HF would crop those layers to the window, and the crop traced on one side of the window does
        # not hold on the other.
        cache = DynamicCache(ddp_cache_data=pairs)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        presents = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        return (out.logits, *presents)


def _io_names(num_layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


def _example_inputs(config, batch: int, seq: int, past: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dims = head_dims_from_config(config.to_dict())  # one reader of the families' spellings (Falcon's multi_query)
    kv_heads, head_dim = dims.num_kv_heads, dims.head_dim
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    attention_mask = torch.ones(batch, past + seq, dtype=torch.int64)
    position_ids = torch.arange(past, past + seq).unsqueeze(0).expand(batch, seq).contiguous()
    pasts = [torch.randn(batch, kv_heads, past, head_dim, generator=g).to(dtype)
             for _ in range(2 * config.num_hidden_layers)]
    return (input_ids, attention_mask, position_ids, *pasts)


def _load_model(model_dir: Path, dtype: torch.dtype, attention: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention)
        except ValueError as e:
            if "scaled_dot_product_attention" not in str(e):
                raise
            # Architectures without an SDPA path (BLOOM) export their eager attention; the fusion passes match both.
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    except (OSError, ValueError) as e:
        raise ExportError(f"could not load {model_dir} as an HF causal LM: {e}") from e
    return model.eval()


def _export(wrapper: _OptimumStyle, args, onnx_path: Path, exporter: str, opset: int, num_layers: int) -> None:
    input_names, output_names = _io_names(num_layers)
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"},
            "position_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
    axes |= {n: {0: "batch", 2: "past"} for n in input_names[3:]}
    axes |= {n: {0: "batch", 2: "total"} for n in output_names[1:]}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            # dynamo needs dynamic_shapes shaped like forward's signature: (ids, mask, pos, *past as one tuple)
            dim = torch.export.Dim
            batch, seq, past, total = dim("batch"), dim("seq"), dim("past"), dim("total")
            shapes = ({0: batch, 1: seq}, {0: batch, 1: total}, {0: batch, 1: seq},
                      tuple({0: batch, 2: past} for _ in input_names[3:]))
            program = torch.onnx.export(wrapper, args, dynamo=True, opset_version=opset, input_names=input_names,
                                        output_names=output_names, dynamic_shapes=shapes, verbose=False,
                                        optimize=True)
            program.save(str(onnx_path), external_data=_needs_external_data(wrapper))
        else:
            # TorchScript's constant folding breaks on bf16 models (torch 2.13: "ScalarType ComplexDouble is an
            # unexpected tensor scalar type" when the folded graph is serialised, an ONNX dtype number read as an
            # ATen one); unfolded, the graph is correct, and `trtopt build` folds constants itself (cleanup.py).
            bf16 = any(p.dtype == torch.bfloat16 for p in wrapper.parameters())
            torch.onnx.export(wrapper, args, str(onnx_path), dynamo=False, opset_version=opset,
                              input_names=input_names, output_names=output_names, dynamic_axes=axes,
                              do_constant_folding=not bf16)
            if _needs_external_data(wrapper):
                import onnx

                m = onnx.load(str(onnx_path))
                onnx.save(m, str(onnx_path), save_as_external_data=True, location=onnx_path.name + ".data")


def _root_cause(error: BaseException, limit: int = 500) -> str:
    """The innermost cause in one line: torch.onnx wraps torch.export's error in a message of generic next steps."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:limit]}"


def _needs_external_data(module: torch.nn.Module) -> bool:
    return sum(p.numel() * p.element_size() for p in module.parameters()) > EXTERNAL_DATA_THRESHOLD


def verify(onnx_path: Path, wrapper: _OptimumStyle, config, dtype: str) -> tuple[dict[str, float], dict[str, float]]:
    """Compare ORT with PyTorch on a prompt with no past and on a decode step with past."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 4  # fatal only: a failure is raised as an ExportError, not logged twice
    try:
        sess = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT raises its own pybind classes (NotImplemented, Fail, ...)
        hint = " ONNX Runtime's CPU kernels do not cover bf16;" if dtype == "bf16" else ""
        raise ExportError(f"ONNX Runtime cannot load the exported graph to verify it ({str(e)[:300]}).{hint} "
                          "Export with --no-verify to keep the graph unverified, or use --dtype fp32/fp16.") from e
    kept = {i.name for i in sess.get_inputs()}
    errors, scaled = {}, {}
    for case, (batch, seq, past) in {"prompt (no past)": (2, 7, 0), "decode (past 9)": (2, 1, 9)}.items():
        args = _example_inputs(config, batch, seq, past, DTYPES[dtype], seed=1)
        with torch.no_grad():
            expected = wrapper(*args)
        # The legacy trace drops inputs the model ignores (BLOOM's position_ids): feed by name what the graph kept.
        declared = _io_names((len(args) - 3) // 2)[0]
        feeds = {n: a.numpy() if a.dtype != torch.bfloat16 else a.float().numpy()
                 for n, a in zip(declared, args, strict=True) if n in kept}
        try:
            got = sess.run(None, feeds)
        except Exception as e:  # ORT's pybind errors (InvalidArgument, RuntimeException, ...) share no base class
            raise ExportError(
                f"ONNX Runtime cannot run the exported graph on the verification case {case} "
                f"(batch {batch}, {seq} new tokens, past {past}): {type(e).__name__}: {str(e)[:300]}. The export "
                "traced batch 2, 4 new tokens, past 3, so a shape it specialised on (e.g. a sliding window seen on "
                "one side only) may not hold here; try the other exporter (`--exporter legacy|dynamo`), or "
                "--no-verify to keep the graph unverified."
            ) from e
        diffs = [(float((torch.from_numpy(g).float() - e.float()).abs().max()), max(1.0, float(e.float().abs().max())))
                 for g, e in zip(got, expected)]
        errors[case] = max(d for d, _ in diffs)
        scaled[case] = max(d / m for d, m in diffs)
    if max(scaled.values()) > TOLERANCE[dtype]:
        detail = ", ".join(f"{k}: {v:.2e}" for k, v in scaled.items())
        raise ExportError(f"ONNX Runtime output differs from PyTorch beyond {TOLERANCE[dtype]:g} ({detail}); "
                          "try the other exporter (`--exporter legacy|dynamo`) or a different --opset.")
    return errors, scaled


def export_model(model: str | Path, out_dir: str | Path, *, exporter: str = "dynamo", dtype: str = "fp32",
                 opset: int | None = None, verify_outputs: bool | None = None, force: bool = False,
                 log: Callable[[str], None] = lambda _: None) -> ExportResult:
    """Export an HF causal LM (directory or built-in alias) to ``out_dir`` in the optimum layout.

    ``verify_outputs``: True compares ONNX Runtime (CPU) with PyTorch after the export, False skips it, None (the
    default) verifies every dtype ORT's CPU kernels run, i.e. all but bf16, which is then recorded as unverified
    (check a bf16 plan on a GPU with `trtopt check` instead)."""
    if exporter not in EXPORTERS:
        raise ExportError(f"unknown exporter {exporter!r}; choose one of: {', '.join(EXPORTERS)}.")
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}.")
    opset = opset or DEFAULT_OPSET[exporter]
    if not 14 <= opset <= 23:
        raise ExportError(f"opset {opset} is not supported; use 14..23 (default {DEFAULT_OPSET[exporter]}).")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        if not force:
            raise ExportError(f"output directory {out_dir} is not empty; pass --force to overwrite it.")
        shutil.rmtree(out_dir)
    model_dir = resolve_model(model)
    log(f"loading {model} from {model_dir}")
    # TorchScript's SDPA symbolic types a 16-bit attention output float32 in some families (GPT-NeoX, OPT,
    # StableLM), whose fp16 LayerNorm weights then meet a float32 input and ORT refuses the graph; HF's eager
    # attention traces with consistent types (the fusion passes match both forms).
    attention = "eager" if exporter == "legacy" and dtype != "fp32" else "sdpa"
    hf = _load_model(model_dir, DTYPES[dtype], attention)
    config = hf.config
    wrapper = _OptimumStyle(hf).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    onnx_path = out_dir / "model.onnx"
    log(f"exporting with the {exporter} exporter at opset {opset}")
    start = time.perf_counter()
    try:
        _export(wrapper, _example_inputs(config, 2, 4, 3, DTYPES[dtype]), onnx_path, exporter, opset,
                config.num_hidden_layers)
    except Exception as e:  # the exporters raise many types; the user needs the gist and a next step
        raise ExportError(f"torch.onnx.export ({exporter}) failed: {_root_cause(e)}; "
                          "try the other exporter with --exporter.") from e
    seconds = time.perf_counter() - start
    for name in AUX_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out_dir / name)
    if not (out_dir / "generation_config.json").is_file() and hf.generation_config is not None:
        hf.generation_config.save_pretrained(out_dir)
    errors, scaled, unverified = {}, {}, None
    if verify_outputs is None and dtype == "bf16":
        unverified = ("ONNX Runtime's CPU kernels do not cover bf16, so the export was not compared with PyTorch; "
                      "check the built plan on a GPU with `trtopt check`")
    elif verify_outputs is not False:
        log("verifying ONNX Runtime against PyTorch")
        errors, scaled = verify(onnx_path, wrapper, config, dtype)
    return ExportResult(out_dir, onnx_path, exporter, opset, seconds, errors, scaled, unverified)
