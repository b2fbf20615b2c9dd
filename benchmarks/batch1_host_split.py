"""Where a batch-1 async step's host time goes, engine after engine on one executor (issue 11, sessions 15-16).

For each engine on one executor (the 1.24B plan of gpu_e2e.py), it decodes 256 tokens of one request and reports
per step: the wall time of step(), of the executor's execute (packing, the input copy, the placeholder fill, the
graph replay's launch), of _process (mostly the wait for the previous step's tokens) and of sampling (argmax
launches, the copy to the host, bookkeeping), and how often the next step had already finished when the previous
one's tokens arrived (a sign that the host, not the GPU, set the pace). Engines alternate between the placeholder
fill and greedy argmax inside the step graphs (the executor's argmax_in_graph, the default) and launched from Python
between replays, so both are measured on one host in one run; each is also timed by gpu_e2e's own batch1_decode.
Then the host time of each piece of a step alone (median of 400 calls, the stream idle before each).

    python3 benchmarks/batch1_host_split.py      # on the GPU machine; prints one line per engine, then the pieces
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
import gpu_e2e as g
from trtopt.builder.plan import read_plan
from trtopt.runtime.executors import create_executor
from trtopt.runtime.sampling_params import SamplingParams

def instrumented(executor, plan, shape, device, tag, n=256):
    engine = g.make_engine(executor, plan, max_num_seqs=256, kv_gb=4.0, async_scheduling=True)
    prompt = list(range(1000, 1128))
    engine.add_request("warm", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    acc = {"execute": 0.0, "process": 0.0, "sample": 0.0, "step": 0.0, "done_at_resolve": 0, "steps": 0}
    events = []
    inner_execute, inner_process, inner_sample = engine.executor.execute, engine._process, engine._sample_in_flight

    def execute(step):
        t = time.perf_counter()
        out = inner_execute(step)
        e = torch.cuda.Event()
        e.record()
        events.append(e)
        acc["execute"] += time.perf_counter() - t
        return out

    def process(prev):
        t = time.perf_counter()
        out = inner_process(prev)
        acc["process"] += time.perf_counter() - t
        acc["done_at_resolve"] += bool(events and events[-1].query())
        return out

    def sample(batch, logits):
        t = time.perf_counter()
        out = inner_sample(batch, logits)
        acc["sample"] += time.perf_counter() - t
        return out

    engine.executor.execute, engine._process, engine._sample_in_flight = execute, process, sample
    engine.add_request("b1", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))
    torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        acc["step"] += time.perf_counter() - t
        acc["steps"] += 1
    wall = time.perf_counter() - start
    del engine.executor.execute
    s = acc["steps"]
    print(f"{tag}: {s / wall:.0f} steps/s; per step ms: step {1e3 * acc['step'] / s:.3f} execute "
          f"{1e3 * acc['execute'] / s:.3f} process(wait) {1e3 * acc['process'] / s:.3f} sample "
          f"{1e3 * acc['sample'] / s:.3f}; next step already done when the previous resolved: "
          f"{acc['done_at_resolve']}/{s}; replay {g.graph_replay_ms(engine, device):.3f} ms", flush=True)
    return engine


def pieces(engine, device) -> None:
    """Host time of each piece of a served batch-1 step alone: median of 400 calls, the stream idle before each."""
    from trtopt.runtime.kernels.argmax import greedy_argmax
    from trtopt.runtime.batch import fill_placeholders_
    from trtopt.runtime.executors.cuda_graphs import GraphBucket, dummy_step, pack_step

    graphs = engine.executor.graphs
    one = GraphBucket(1, 1, 1)
    step = dummy_step(one, graphs.max_blocks_per_seq)
    fields, host, nbytes = graphs._bucket_fields(one)
    logits = graphs._logits[:1]
    ids = greedy_argmax(logits)
    pinned = torch.empty(1, dtype=torch.int64, pin_memory=True)
    sampled = torch.zeros(1, dtype=torch.int64, device=device)
    for name, fn in {
        "graph replay (launch)": graphs._captured[one].replay,
        "pack_step": lambda: pack_step(step, host),
        "input copy": lambda: graphs._device_bytes[:nbytes].copy_(graphs._host_bytes[:nbytes], non_blocking=True),
        "placeholder fill launch": lambda: fill_placeholders_(fields["input_ids"], sampled),
        "logits clone": logits.clone,
        "greedy argmax launches": lambda: greedy_argmax(logits),
        "pinned empty + copy to host": lambda: torch.empty((1,), dtype=torch.int64, pin_memory=True).copy_(ids, non_blocking=True),
        "event + record": lambda: torch.cuda.Event().record(),
        "try_run (all of the executor's part)": lambda: graphs.try_run(step),
    }.items():
        times = []
        for _ in range(400):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        print(f"  {name:40s} {1e6 * sorted(times)[len(times) // 2]:7.1f} us", flush=True)


def main() -> None:
    device = torch.device("cuda")
    shape = g.Shape()
    _, plan_dir, _, _ = g.build(Path("/tmp/trtopt-batch1-host"), shape, device, 256, ())
    plan = read_plan(plan_dir)
    executor = create_executor("torch", plan_dir, plan, device="cuda", cuda_graphs=True)
    for i, in_graph in enumerate((True, False, True, False)):
        executor.argmax_in_graph = in_graph  # read when each engine captures its graphs
        tag = "in graph" if in_graph else "from Python"
        instrumented(executor, plan, shape, device, f"engine {i} (fill + argmax {tag})")
        e = g.make_engine(executor, plan, max_num_seqs=256, kv_gb=4.0, async_scheduling=True)
        b = g.batch1_decode(e, shape.vocab, device)
        print(f"  batch1_decode (fill + argmax {tag}): {b['decode_tok_s']:.0f} tok/s, GPU {b['gpu_ms_per_token']:.3f} "
              f"ms, exposed host {b['host_ms_per_token']:.3f} ms", flush=True)
        del e
    executor.argmax_in_graph = True
    e = g.make_engine(executor, plan, max_num_seqs=256, kv_gb=4.0, async_scheduling=True)
    g.batch1_decode(e, shape.vocab, device, new_tokens=16)
    pieces(e, device)


if __name__ == "__main__":
    main()
