"""Tiny random-weight decoder-only LMs of every architecture family `trtopt export` claims, built from transformers
configs (nothing is downloaded). Each is 2 layers, hidden 64, a 256-token vocabulary, with weights scaled up so
greedy decoding is decisive (near-uniform logits would make token-for-token comparisons meaningless)."""

from __future__ import annotations

from pathlib import Path

VOCAB = 256
SLIDING_WINDOW = 8  # Mistral/Gemma-3 windows small enough that the tests' prompts cross them


def _config(arch: str):
    import transformers as t

    llama_like = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2)
    if arch == "llama":  # GQA + llama3 rope scaling (the frequencies depend on the wavelength band)
        return t.LlamaConfig(**llama_like, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if arch == "mistral":
        return t.MistralConfig(**llama_like, sliding_window=SLIDING_WINDOW)
    if arch == "qwen2":  # QKV bias, MQA
        return t.Qwen2Config(**{**llama_like, "num_key_value_heads": 1}, tie_word_embeddings=True)
    if arch == "phi3":  # fused qkv_proj / gate_up_proj, partial rotary
        return t.Phi3Config(**llama_like, partial_rotary_factor=0.5, pad_token_id=0)
    if arch == "gpt_neox":  # parallel residual, rotary on a quarter of each head, fused QKV per head
        return t.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, max_position_embeddings=256, rotary_pct=0.25,
                               bos_token_id=1, eos_token_id=2)
    if arch == "stablelm":  # LayerNorm, partial rotary, QKV bias
        return t.StableLmConfig(**llama_like, partial_rotary_factor=0.25, use_qkv_bias=True)
    if arch == "opt":  # learned positions (offset 2), LayerNorm, ReLU
        return t.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                           max_position_embeddings=256, word_embed_proj_dim=64, bos_token_id=1, eos_token_id=2,
                           pad_token_id=0)
    if arch == "gemma3":  # mixed sliding/global layers, QK norm, soft-capped... (text-only Gemma3ForCausalLM)
        return t.Gemma3TextConfig(**{**llama_like, "num_hidden_layers": 3}, head_dim=16,
                                  sliding_window=SLIDING_WINDOW,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                  pad_token_id=0)
    if arch == "falcon-mq":  # the original Falcon-7B form: multi_query (1 KV head), parallel attention
        return t.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              multi_query=True, new_decoder_architecture=False, parallel_attn=True, bias=False,
                              alibi=False, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    if arch == "falcon-new":  # Falcon-40B/180B form: grouped KV heads, two LayerNorms
        return t.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_kv_heads=2, new_decoder_architecture=True, bias=False, alibi=False,
                              max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    if arch == "bloom":  # ALiBi, heads-folded attention
        return t.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2)
    if arch == "gpt2":  # learned absolute positions, Conv1D projections
        return t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                            bos_token_id=1, eos_token_id=2)
    if arch == "granite":  # logits_scaling divides the logits after the LM head; embedding/residual/attention scales
        return t.GraniteConfig(**llama_like, logits_scaling=4.0, embedding_multiplier=6.0, residual_multiplier=0.5,
                               attention_multiplier=0.2)
    raise KeyError(arch)


ARCHS = ("llama", "mistral", "qwen2", "phi3", "gpt_neox", "stablelm", "opt", "gemma3", "falcon-mq", "falcon-new",
         "bloom", "gpt2", "granite")


# Gemma-3 multiplies embeddings by sqrt(hidden) and norms by (1 + w): a smaller scale keeps its greedy output varied.
_SCALE = {"gemma3": 0.05}


def save_tiny(arch: str, out: Path, scale: float | None = None) -> Path:
    """Write the tiny random model of ``arch`` as an HF directory (config + safetensors, no tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, scale or _SCALE.get(arch, 0.3))
    model.save_pretrained(out)
    return out
