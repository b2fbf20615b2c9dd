"""Step CUDA graphs: bucketing and padding are checked on CPU; capture/replay only on a GPU (`gpu` marker)."""

from __future__ import annotations

import pytest
import torch

from trtopt.builder.plan import read_plan
from trtopt.check.driver import BlockSource, Seq, make_step
from trtopt.runtime.batch import fill_placeholders_
from trtopt.runtime.executors.cuda_graphs import (
    GraphBucket, StepGraphs, dummy_step, field_views, graph_buckets, input_layout, pack_step, pad_step, token_buckets,
)
from trtopt.signature import STEP_INPUT_NAMES
from trtopt.runtime.executors.torch_executor import TorchExecutor


def test_token_buckets_cover_every_step_size():
    assert token_buckets(1, 1) == (1,)
    assert token_buckets(8, 8) == (1, 2, 4, 8)
    assert token_buckets(12, 12) == (1, 2, 4, 8, 12)
    assert token_buckets(40, 40) == (1, 2, 4, 8, 16, 32, 40)
    assert token_buckets(8, 4) == (1, 2, 4)
    buckets = token_buckets(256, 8192)
    assert buckets[:20] == (1, 2, 4, 8, *range(16, 257, 16)) and buckets[-1] == 8192
    assert len(buckets) == 36, buckets  # bounded: what start-up captures
    for n in range(1, 8193):  # every step size has a bucket: < 16 rows of padding up to 256, then < 25%
        b = min(b for b in buckets if b >= n)
        assert b - n < 16 if n <= 256 else b - n < 0.25 * n + 16, (n, b)


def test_graph_buckets_hold_every_step_up_to_the_logits_cap():
    buckets = graph_buckets(256, 8192)
    assert all(b.num_seqs == min(b.num_tokens, 256) == b.num_logits for b in buckets)
    assert graph_buckets(4, 64, max_logits=16)[-1] == GraphBucket(64, 4, 16)
    source = BlockSource(64)
    # A mixed step (two decode rows and a 9-token prefill chunk) and a multi-row (verification) step.
    mixed = make_step([Seq([1, 2, 3], cached=2), Seq([4, 5], cached=1), Seq(list(range(9)))], [1, 1, 9], 16, source)
    assert StepGraphs.bucket_of(graph_buckets(4, 64), mixed) == GraphBucket(16, 4, 4)
    verify = make_step([Seq(list(range(8)), cached=4)], [4], 16, source)
    verify.logits_indices = torch.arange(4)
    assert StepGraphs.bucket_of(graph_buckets(4, 64), verify) == GraphBucket(4, 4, 4)
    wide = make_step([Seq(list(range(12)), cached=2)], [10], 16, source)
    wide.logits_indices = torch.arange(10)
    assert StepGraphs.bucket_of(graph_buckets(4, 64), wide) is None  # 10 logits rows > max_logits 4: eager


def test_graphs_are_on_by_default_only_for_torch_on_cuda():
    from trtopt.runtime.config import default_cuda_graphs

    assert default_cuda_graphs("torch", "cuda") and default_cuda_graphs("torch", "cuda:1")
    assert not default_cuda_graphs("torch", "cpu") and not default_cuda_graphs("onnxruntime", "cuda")
    assert not default_cuda_graphs("tensorrt", "cuda")


def test_dummy_step_is_all_padding():
    """What capture runs equals the padding of a real padded step: no writes, null block only, no tokens owned."""
    source = BlockSource(16)
    bucket = GraphBucket(8, 4, 4)
    real = pad_step(make_step([Seq([1, 2, 3], cached=1)], [2], 16, source), bucket, 6)
    dummy = dummy_step(bucket, 6)
    for name in ("block_tables", "seq_lens"):
        torch.testing.assert_close(getattr(dummy, name)[1:], getattr(real, name)[1:])
    assert dummy.slot_mapping.eq(-1).all() and dummy.block_tables.eq(0).all() and dummy.query_start_loc.eq(0).all()
    assert real.slot_mapping[2:].eq(-1).all() and real.query_start_loc.tolist() == [0, 2, 2, 2, 2]
    assert real.input_ids.shape == (1, 8) and real.logits_indices.tolist() == [1, 0, 0, 0]


def test_packed_inputs_are_the_padded_step_in_one_buffer():
    """One copy per step: every bucket's inputs are 64-byte-aligned fields of one buffer, and packing a step into
    it (over whatever the previous, larger step left there) gives exactly pad_step's tensors."""
    source = BlockSource(64)
    steps = [make_step([Seq(list(range(40)), cached=3), Seq([4, 5], cached=1), Seq(list(range(9)))], [37, 1, 9], 16,
                       source),
             make_step([Seq([1, 2, 3], cached=2), Seq([4, 5], cached=1)], [1, 1], 16, source),
             make_step([Seq(list(range(8)), cached=4)], [4], 16, source)]
    steps[2].logits_indices = torch.arange(4)
    buckets = graph_buckets(4, 64)
    size = max(input_layout(b, 6)[1] for b in buckets)
    buffer = torch.full((size,), 0xAB, dtype=torch.uint8)  # garbage, as a reused buffer holds
    for step in steps:
        bucket = StepGraphs.bucket_of(buckets, step)
        layout, nbytes = input_layout(bucket, 6)
        assert list(layout) == list(STEP_INPUT_NAMES) and nbytes <= size
        assert all(offset % 64 == 0 for offset, _, _ in layout.values())
        ends = sorted((o, o + torch.tensor([], dtype=d).element_size() * torch.Size(sh).numel()) for o, d, sh in
                      layout.values())
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:]))  # no field overlaps another
        views = field_views(buffer, layout)
        pack_step(step, {name: v.numpy() for name, v in views.items()})
        want = pad_step(step, bucket, 6)
        for name in STEP_INPUT_NAMES:
            assert torch.equal(views[name], getattr(want, name)), name


def test_placeholders_are_filled_in_place():
    ids = torch.tensor([[7, -1, 9, -3, -2]])
    out = fill_placeholders_(ids, torch.tensor([70, 80, 90]))
    assert out is ids and ids.tolist() == [[7, 70, 9, 90, 80]]


@pytest.mark.parametrize("counts", [[1, 1, 1], [5, 1, 3], [2, 2, 2]], ids=["decode", "mixed", "multi-row"])
def test_padded_step_gives_the_same_logits_and_writes(plan_dir, counts):
    """The padding of a step changes nothing: same logits for the real rows, same pools (decode, mixed prefill +
    decode, and several query rows per sequence with logits for each, as speculative verification runs)."""
    built = plan_dir("tiny-llama")
    plan = read_plan(built)
    bs = plan.limits.block_size
    runs = {}
    for padded in (False, True):
        ex = TorchExecutor(built, plan)
        ex.allocate_kv_cache(24)
        source = BlockSource(24)
        seqs = [Seq(list(range(3, 3 + n))) for n in (20, 7, 33)]
        ex.execute(make_step(seqs, [len(s.tokens) - 3 for s in seqs], bs, source))
        for s in seqs:
            s.tokens.extend([9, 10, 11])
        step = make_step(seqs, counts, bs, source)
        if counts == [2, 2, 2]:
            step.logits_indices = torch.arange(6)
        if padded:
            bucket = GraphBucket(16, 8, 8)
            step = pad_step(step, bucket, plan.max_blocks_per_seq)
            assert step.num_tokens == 16 and step.block_tables.shape == (8, plan.max_blocks_per_seq)
            assert step.slot_mapping[sum(counts):].eq(-1).all() and step.block_tables[3:].eq(0).all()
        n = 6 if counts == [2, 2, 2] else 3
        runs[padded] = (ex.execute(step)[:n], [p[1:].clone() for p in ex.kv_caches])
    torch.testing.assert_close(runs[True][0], runs[False][0], atol=1e-5, rtol=0)
    # Block 0 (the null block) is nobody's data; elsewhere only matmul rounding differs (16 rows vs fewer).
    for a, b in zip(runs[True][1], runs[False][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.gpu
def test_graph_replay_matches_eager_on_cuda(plan_dir):
    """Every step replays a graph after start-up capture (prefill, mixed, decode, multi-row) with eager's logits."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a CUDA GPU")
    built = plan_dir("tiny-llama")
    plan = read_plan(built)
    bs = plan.limits.block_size
    logits = {}
    for graphs in (False, True):
        ex = TorchExecutor(built, plan, device="cuda", cuda_graphs=graphs)
        ex.allocate_kv_cache(32)
        report = ex.capture_graphs(max_num_seqs=8, max_num_tokens=128)  # every bucket at start-up
        if graphs:
            assert report.num_graphs == len(ex.graphs.buckets) and set(ex.graphs._captured) == set(ex.graphs.buckets)
        source = BlockSource(32)
        seqs = [Seq(list(range(3, 3 + n))) for n in (20, 7, 33)]
        rows = [ex.execute(make_step(seqs, [len(s.tokens) - 4 for s in seqs], bs, source)).cpu()]
        for s in seqs:
            s.tokens.extend([11, 12, 13, 14])
        rows.append(ex.execute(make_step(seqs, [1, 3, 1], bs, source)).cpu())  # mixed
        multi = make_step(seqs, [2, 2, 2], bs, source)
        multi.logits_indices = torch.arange(6)
        rows.append(ex.execute(multi).cpu())  # several rows per sequence, logits for each
        if graphs:  # the device inputs the graph read are the step padded as pad_step specifies
            bucket = ex.graphs.bucket_for(multi)
            want = pad_step(multi, bucket, plan.max_blocks_per_seq)
            for name, got in ex.graphs.device_inputs(bucket).items():
                assert torch.equal(got.cpu(), getattr(want, name)), name
        for _ in range(4):  # decode steps
            for s in seqs:
                s.tokens.append(11)
            rows.append(ex.execute(make_step(seqs, [1, 1, 1], bs, source)).cpu())
        if graphs:
            assert ex.graphs.enabled and ex.graphs.num_eager == 0 and ex.graphs.num_replayed == len(rows)
        logits[graphs] = torch.cat(rows)
    torch.testing.assert_close(logits[True], logits[False], atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["ngram", "self_draft", "draft_model"])
def test_speculative_steps_replay_graphs_after_warm_up(plan_dir, method):
    """With speculation on, every step after the prefill replays a graph: the target's K+1-row verification
    steps and the draft's K forwards (own buckets, captured at start-up); greedy output is unchanged."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a CUDA GPU")
    from trtopt.builder.draft import build_draft_plan, self_draft_dir
    from trtopt.runtime.engine import LLMEngine
    from trtopt.runtime.sampling_params import SamplingParams

    built = plan_dir("tiny-llama")
    if not (self_draft_dir(built, 1) / "plan.json").is_file():
        build_draft_plan(built, 1)
    k = 3
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1},
            "self_draft": {"method": "self_draft", "num_layers": 1, "num_speculative_tokens": k},
            "draft_model": {"method": "draft_model", "model": str(self_draft_dir(built, 1)),
                            "num_speculative_tokens": k}}[method]
    # Repetitive prompts so that n-gram lookup proposes; every request is admitted in the first step.
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [12, 13] * 7, [20, 21, 22, 23, 24] * 3]

    def run(speculative_config):
        engine = LLMEngine.from_plan(built, device="cuda", max_model_len=256, speculative_config=speculative_config)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p},
                               SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        done = {o.request_id: o for o in engine.step() if o.finished}  # the prefill step (an own-pool draft
        graphs = [engine.executor.graphs]                                 # mirrors it eagerly: T > its buckets)
        if engine.spec is not None and hasattr(engine.spec.proposer, "executor"):
            graphs.append(engine.spec.proposer.executor.graphs)
        for g in graphs:
            g.num_eager = g.num_replayed = 0
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))], engine, graphs

    base, _, _ = run(None)
    out, engine, graphs = run(spec)
    assert out == base
    st = engine.stats()
    assert st.num_draft_tokens > 0
    for g in graphs:
        assert g.enabled and g.num_eager == 0 and g.num_replayed > 0, (g.num_eager, g.num_replayed)
    if method != "ngram":
        report = engine.spec.capture_report
        draft_graphs = graphs[1]
        assert report is not None and report.num_graphs == len(draft_graphs.buckets)
        assert draft_graphs.buckets[-1].num_tokens <= 2 * engine.limits.max_num_seqs
        assert draft_graphs.num_replayed >= k * len(prompts)  # K forwards per speculating step


@pytest.mark.gpu
@pytest.mark.parametrize("capture", ["at_start", "lazily"])
def test_graphs_fill_placeholders_and_take_the_greedy_argmax_inside(plan_dir, capture):
    """Each graph fills async scheduling's placeholders from the previous step's greedy tokens and leaves the argmax
    of its own logits rows in last_greedy_tokens (argmax_in_graph, on by default): greedy decoding through those
    buffers alone gives the logits and tokens of ids filled on the host, whether the previous tokens are the
    graph's own or came from elsewhere (copied into the buffer first), and an eager step leaves None. Buckets
    captured lazily, mid-run, keep the previous step's tokens through their warm-up runs."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a CUDA GPU")
    built = plan_dir("tiny-llama")
    plan = read_plan(built)
    bs = plan.limits.block_size
    runs = {}
    for mode in ("host", "own", "foreign"):
        ex = TorchExecutor(built, plan, device="cuda", cuda_graphs=True)
        ex.allocate_kv_cache(32)
        if capture == "at_start":
            ex.capture_graphs(max_num_seqs=8, max_num_tokens=128)
        assert ex.graphs.argmax_in_graph and ex.last_greedy_tokens is None
        source = BlockSource(32)
        seqs = [Seq(list(range(3, 3 + n))) for n in (20, 7, 33)]
        logits = ex.execute(make_step(seqs, [len(s.tokens) for s in seqs], bs, source))
        rows, tokens = [logits.cpu()], [ex.last_greedy_tokens.cpu()]
        prev = ex.last_greedy_tokens
        for _ in range(5):
            for k, s in enumerate(seqs):  # the token each sequence samples: known on the host only in "host"
                s.tokens.append(int(tokens[-1][k]) if mode == "host" else -1 - k)
            step = make_step(seqs, [1, 1, 1], bs, source)
            if mode != "host":
                step.sampled_ids = prev if mode == "own" else prev.clone()
            logits = ex.execute(step)
            assert ex.graphs.num_eager == 0 and ex.last_greedy_tokens.shape == (3,)
            rows.append(logits.cpu())
            tokens.append(ex.last_greedy_tokens.cpu())
            assert torch.equal(tokens[-1], logits.argmax(-1).cpu())
            prev = ex.last_greedy_tokens
        runs[mode] = (torch.cat(rows), torch.cat(tokens))
        ex.graphs.enabled = False  # an eager step: no graph, no argmax of its own
        for s in seqs:
            s.tokens.append(5)
        ex.execute(make_step(seqs, [1, 1, 1], bs, source))
        assert ex.last_greedy_tokens is None
    for mode in ("own", "foreign"):
        torch.testing.assert_close(runs[mode][0], runs["host"][0], atol=0, rtol=0)
        assert torch.equal(runs[mode][1], runs["host"][1])


@pytest.mark.gpu
@pytest.mark.parametrize("failures", [1, 99], ids=["once", "always"])
def test_a_failed_capture_is_tried_once_more_then_graphs_go_off(failures):
    """A capture that fails (here: a host sync inside it) is tried once more; if it fails again, graphs go off and
    steps run eagerly (try_run returns None) instead of failing."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a CUDA GPU")
    device = torch.device("cuda")
    left = {"failures": failures}

    def run(feeds, logits_out):  # a stand-in model: logits [N, 8] from the ids of the logits rows
        if torch.cuda.is_current_stream_capturing() and left["failures"] > 0:
            left["failures"] -= 1
            torch.cuda.synchronize()  # not allowed while capturing: the capture fails
        ids = feeds["input_ids"][0][feeds["logits_indices"]].float()
        logits = ids[:, None] * torch.arange(8.0, device=device)
        return logits_out.copy_(logits) if logits_out is not None else logits

    graphs = StepGraphs(run, device=device, max_num_seqs=2, max_num_tokens=2, max_blocks_per_seq=2)
    graphs.capture_all()
    step = make_step([Seq([3, 5])], [2], 16, BlockSource(4))
    logits = graphs.try_run(step)
    if failures == 1:
        assert graphs.enabled and len(graphs._captured) == len(graphs.buckets) == 2
        assert torch.equal(logits.cpu(), 5 * torch.arange(8.0)[None]) and graphs.last_tokens.tolist() == [7]
    else:
        assert not graphs.enabled and logits is None and graphs.num_eager == 1


def test_argmax_options_are_the_executors(plan_dir):
    """argmax_in_graph and argmax_kernel are options of the executor (create_executor and TorchExecutor keywords,
    on by default), read whenever it makes its StepGraphs; off CUDA there are no graphs to give them to."""
    from trtopt.runtime.executors import create_executor

    built = plan_dir("tiny-llama")
    plan = read_plan(built)
    assert TorchExecutor(built, plan).argmax_in_graph and TorchExecutor(built, plan).argmax_kernel
    ex = create_executor("torch", built, plan, argmax_in_graph=False)
    assert ex.argmax_in_graph is False and ex.argmax_kernel and ex.graphs is None


@pytest.mark.gpu
def test_a_speculative_draft_follows_the_targets_argmax_in_graph(plan_dir):
    """LLMEngine.from_plan(argmax_in_graph=False): the target's step graphs and a self-draft's leave the placeholder
    fill and the greedy argmax to Python (at every capture), with the greedy tokens of the default."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a CUDA GPU")
    from trtopt.builder.draft import build_draft_plan, self_draft_dir
    from trtopt.runtime.engine import LLMEngine
    from trtopt.runtime.sampling_params import SamplingParams

    built = plan_dir("tiny-llama")
    if not (self_draft_dir(built, 1) / "plan.json").is_file():
        build_draft_plan(built, 1)
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5]
    tokens = {}
    for in_graph in (True, False):
        engine = LLMEngine.from_plan(built, device="cuda", max_model_len=256, argmax_in_graph=in_graph,
                                     speculative_config={"method": "self_draft", "num_layers": 1,
                                                         "num_speculative_tokens": 3})
        target, draft = engine.executor, engine.spec.proposer.executor
        assert target.graphs.argmax_in_graph is in_graph and draft.graphs.argmax_in_graph is in_graph
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p},
                               SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        tokens[in_graph] = done
        assert (target.graphs._tokens is None) is (not in_graph)  # no token buffer without the in-graph argmax
    assert tokens[True] == tokens[False]
