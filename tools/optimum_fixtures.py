"""Export the third-party fixtures of tests/fixtures/optimum/: tiny random-weight causal LMs exported by
optimum-onnx (`main_export(task="text-generation-with-past")`, what `optimum-cli export onnx` runs), so that
`make test` builds graphs trtopt did not write and compares their greedy tokens with HF, without installing optimum.

    python tools/optimum_fixtures.py                      # every architecture, into tests/fixtures/optimum/
    python tools/optimum_fixtures.py --archs gemma3,bloom --venv /tmp/optvenv

optimum-onnx 0.1.0 pins transformers 4.57, while trtopt's venv has transformers 5.x, so the export runs in an
isolated venv (created on first use; PyPI only): this script re-runs itself there with --inside. Each fixture dir
holds what both sides need: model.onnx (optimum's graph, weights inline), config.json (written by 4.57 and read
by 5.x: `rope_theta` is written explicitly, since 4.57 ignores 5.x's `rope_parameters`), generation_config.json
and model.safetensors (the random weights, for the HF reference). No tokenizer: the tests feed token ids.

The configs are tiny (hidden 32, 2 layers, a 128-token vocabulary) so that all fixtures together stay well under
2 MB; the weights are scaled up (N(0, 0.3)) so greedy decoding is decisive and a wrong graph cannot hide behind
near-uniform logits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "optimum"
PINS = ["optimum-onnx==0.1.0", "transformers==4.57.*", "torch", "onnxruntime"]
VOCAB = 128
_COMMON = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 128}
_LLAMA_LIKE = {**_COMMON, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0}

# model_type → config (plain dicts: both transformers versions read them). The comment says what each one tests.
CONFIGS: dict[str, dict] = {
    # GQA 4/2, RoPE
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **_LLAMA_LIKE},
    # QKV bias, one KV head, tied embeddings
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **_LLAMA_LIKE,
              "num_key_value_heads": 1, "tie_word_embeddings": True},
    # mixed sliding (window 8) and global layers, QK norm; optimum's export has no position_ids input
    "gemma3": {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], **_LLAMA_LIKE,
               "num_hidden_layers": 3, "head_dim": 8, "sliding_window": 8, "rope_local_base_freq": 10000.0,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "pad_token_id": 0,
               "query_pre_attn_scalar": 8},
    # ALiBi, heads-folded bmm; no position_ids input
    "bloom": {"model_type": "bloom", "architectures": ["BloomForCausalLM"], **_COMMON, "hidden_size": 32,
              "n_layer": 2, "n_head": 4},
    # multi_query (one KV head broadcast over the query heads), parallel attention; √scale from a Shape of K
    "falcon": {"model_type": "falcon", "architectures": ["FalconForCausalLM"], **_COMMON, "hidden_size": 32,
               "num_hidden_layers": 2, "num_attention_heads": 4, "multi_query": True,
               "new_decoder_architecture": False, "parallel_attn": True, "bias": False, "alibi": False,
               "rope_theta": 10000.0},
    # LayerNorm, partial rotary, QKV bias; √scale from a Shape of K
    "stablelm": {"model_type": "stablelm", "architectures": ["StableLmForCausalLM"], **_LLAMA_LIKE,
                 "partial_rotary_factor": 0.25, "use_qkv_bias": True},
    # learned absolute positions, Conv1D projections
    "gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], **_COMMON, "n_embd": 32, "n_layer": 2,
             "n_head": 4, "n_positions": 128},
}
KEPT = ("model.onnx", "config.json", "generation_config.json", "model.safetensors")


def _save_random(model_type: str, hf_dir: Path) -> None:
    """A random-weight HF model of ``CONFIGS[model_type]`` (inside the venv: transformers 4.57)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(CONFIGS[model_type])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05 if model_type == "gemma3" else 0.3)
    model.save_pretrained(hf_dir, safe_serialization=True)


def _export_inside(archs: list[str], out: Path) -> None:
    from optimum.exporters.onnx import main_export

    for arch in archs:
        with tempfile.TemporaryDirectory() as tmp:
            hf_dir, onnx_dir = Path(tmp) / "hf", Path(tmp) / "onnx"
            _save_random(arch, hf_dir)
            main_export(str(hf_dir), onnx_dir, task="text-generation-with-past", no_post_process=True)
            target = out / arch
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            for name in KEPT:
                source = onnx_dir / name if (onnx_dir / name).exists() else hf_dir / name
                shutil.copy2(source, target / name)
            config = json.loads((target / "config.json").read_text())
            assert "rope_theta" in config or "rope_theta" not in CONFIGS[arch], config  # 5.x reads it from here
        print(f"{arch}: {sum(f.stat().st_size for f in target.iterdir()) / 1e3:.0f} kB in {target}", flush=True)


def _venv_python(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = subprocess.run([str(python), "-c", "import optimum.exporters.onnx, onnxruntime"], capture_output=True)
    if probe.returncode != 0:
        subprocess.run([str(python), "-m", "pip", "install", "-q", *PINS], check=True)
    return python


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default=",".join(CONFIGS))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "optvenv")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # running in the venv
    args = parser.parse_args()
    archs = args.archs.split(",")
    unknown = sorted(set(archs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown architectures {unknown}; choose from {sorted(CONFIGS)}")
    if args.inside:
        _export_inside(archs, args.out)
        return
    python = _venv_python(args.venv)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of trtopt's venv leaks in
    subprocess.run([str(python), __file__, "--inside", "--archs", args.archs, "--out", str(args.out)],
                   check=True, env=env)


if __name__ == "__main__":
    main()
