"""`trtopt generate` (trtopt/cli/generate.py) on the tiny-llama plan. Lives here to share the plan fixtures."""

from typer.testing import CliRunner

from trtopt.cli.main import app

runner = CliRunner()


def test_generate_streams_a_greedy_completion(built_plan, engine_for):
    plan = str(built_plan("tiny-llama"))
    # --eager is a no-op on the CPU (no CUDA graphs there) and must be accepted.
    result = runner.invoke(app, ["generate", plan, "-p", "Hello there", "--max-tokens", "8", "--eager"],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    engine = engine_for("tiny-llama", "torch")
    from trtopt.runtime.sampling_params import SamplingParams

    engine.add_request("x", "Hello there", SamplingParams(temperature=0, max_tokens=8))
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
    assert text.strip() and text.strip() in result.output.replace("\n", "")
    assert "greedy, max_tokens=8" in result.output


def test_generate_batch_chat_and_bad_values(built_plan):
    plan = str(built_plan("tiny-llama"))
    result = runner.invoke(app, ["generate", plan, "-p", "Hi", "-p", "Bye", "--chat", "--max-tokens", "3", "--n", "2",
                                 "--temperature", "0.8", "--seed", "1", "--backend", "onnxruntime"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert result.output.count("(length)") == 4
    bad = runner.invoke(app, ["generate", plan, "-p", "Hi", "--top-p", "0"])
    assert bad.exit_code == 1 and "SamplingParams.top_p" in bad.output and "Traceback" not in bad.output


def test_generate_help_has_examples():
    result = runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "--chat --prompt" in result.output and "--eager" in result.output


def test_plan_with_external_data_outside_it_is_one_line_error(built_plan, tmp_path):
    """A plan dir whose model.onnx points its weights outside the dir: a BuildError for every backend, no traceback."""
    import shutil

    import onnx

    plan = tmp_path / "plan"
    shutil.copytree(built_plan("tiny-llama"), plan)
    proto = onnx.load(str(plan / "model.onnx"))
    onnx.save(proto, str(plan / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights.data", size_threshold=0)
    shutil.move(plan / "weights.data", tmp_path / "outside.data")
    proto = onnx.load(str(plan / "model.onnx"), load_external_data=False)
    for tensor in onnx.external_data_helper._get_all_tensors(proto):
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../outside.data"
    (plan / "model.onnx").write_bytes(proto.SerializeToString())
    for backend in ("torch", "onnxruntime"):
        result = runner.invoke(app, ["generate", str(plan), "-p", "Hi", "--max-tokens", "2", "--backend", backend],
                               env={"COLUMNS": "400"})
        assert result.exit_code == 1, result.output
        assert "BuildError" in result.output and "outside the model directory" in result.output, result.output
        assert "Traceback" not in result.output


def test_generate_with_speculation_prints_acceptance_and_refuses_bad_configs(built_plan, tmp_path):
    plan = str(built_plan("tiny-llama"))
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    args = ["generate", plan, "-p", "one two one two one two one two", "--max-tokens", "12"]
    result = runner.invoke(app, [*args, "--speculative-config", spec], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "speculative:" in result.output and "draft tokens accepted" in result.output
    plain = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert plain.output.split("\n")[1] == result.output.split("\n")[1]  # the same greedy text
    bad = runner.invoke(app, [*args, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'])
    assert bad.exit_code == 1 and "num_speculative_tokens=0" in bad.output and "Traceback" not in bad.output
    missing = runner.invoke(app, [*args, "--speculative-config",
                                  f'{{"method": "draft_model", "model": "{tmp_path}/nope", "num_speculative_tokens": 2}}'])
    assert missing.exit_code == 1 and "does not exist" in missing.output


def test_build_draft_layers_writes_a_self_draft_plan_that_speculates(built_plan, tmp_path):
    from trtopt.builder.draft import build_draft_plan
    from trtopt.builder.plan import read_plan
    from trtopt.runtime.llm import LLM
    from trtopt.runtime.sampling_params import SamplingParams

    plan = built_plan("tiny-llama")
    draft = build_draft_plan(plan, 1)
    assert read_plan(draft).model.num_layers == 1 and (draft / "tokenizer.json").is_file()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = LLM(plan).generate("The capital of France", params)[0].outputs[0].token_ids
    for spec in ({"method": "self_draft", "num_layers": 1, "num_speculative_tokens": 2},
                 {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}):
        llm = LLM(plan, speculative_config=spec)
        out = llm.generate("The capital of France", params)[0]
        assert out.outputs[0].token_ids == base
        assert out.metrics.num_draft_tokens > 0 and llm.engine.stats().num_draft_tokens > 0


def test_kv_cache_memory_holds_a_draft_models_own_pool(built_plan):
    """kv_cache_memory_gb covers the target's pools and a draft plan's own pools (same block count: the block ids
    are shared), split in proportion to their per-block bytes; a self-draft runs on the target's pools and adds none."""
    from trtopt.builder.draft import build_draft_plan, self_draft_dir
    from trtopt.builder.plan import read_plan
    from trtopt.runtime.config import block_bytes
    from trtopt.runtime.engine import LLMEngine

    plan_dir = built_plan("tiny-llama")
    draft = self_draft_dir(plan_dir, 1)
    if not (draft / "plan.json").is_file():
        build_draft_plan(plan_dir, 1)
    gb = 0.002
    target_bytes, draft_bytes = block_bytes(read_plan(plan_dir)), block_bytes(read_plan(draft))
    assert 0 < draft_bytes < target_bytes

    def num_blocks(spec):
        return LLMEngine.from_plan(plan_dir, kv_cache_memory_gb=gb, speculative_config=spec).limits.num_blocks

    assert num_blocks(None) == int(gb * 2**30) // target_bytes + 1
    assert num_blocks({"method": "self_draft", "num_layers": 1, "num_speculative_tokens": 2}) == num_blocks(None)
    own = num_blocks({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})
    assert own == int(gb * 2**30) // (target_bytes + draft_bytes) + 1 < num_blocks(None)


def test_self_draft_plan_equals_hf_early_exit(built_plan, tmp_path):
    """The N-layer self-draft is the target's first N layers + its final norm and LM head: on tiny-llama (whose plan
    fuses the residual adds into AddRMSNorm, the final norm included) its greedy tokens equal HF's model cut to N
    layers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trtopt.builder.draft import build_draft_plan
    from trtopt.export.models import ALIASES
    from trtopt.runtime.llm import LLM
    from trtopt.runtime.sampling_params import SamplingParams

    draft = build_draft_plan(built_plan("tiny-llama"), 1, tmp_path / "draft_1")
    hf_dir = ALIASES["tiny-llama"]()
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    ids = tok("The capital of France", return_tensors="pt").input_ids
    want = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, ids.shape[1]:].tolist()
    got = LLM(draft).generate({"prompt_token_ids": ids[0].tolist()},
                              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids
    assert got == want
