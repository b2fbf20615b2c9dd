"""Where a batch-1 async step's host time goes, engine after engine on one executor (issue 11, session 15).

For each of three engines on one executor (the 1.24B plan of gpu_e2e.py), it decodes 256 tokens of one request and
reports per step: the wall time of step(), of the executor's execute (packing, the input copy, the placeholder fill,
the graph replay's launch), of _process (mostly the wait for the previous step's tokens) and of sampling (argmax
launches, the copy to the host, bookkeeping), and how often the next step had already finished when the previous
one's tokens arrived (a sign that the host, not the GPU, set the pace). A fourth engine is timed by gpu_e2e's own
batch1_decode.

    python3 benchmarks/batch1_host_split.py      # on the GPU machine; prints one line per engine
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
import gpu_e2e as g
from trtopt.build.plan import read_plan
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


def main() -> None:
    device = torch.device("cuda")
    shape = g.Shape()
    _, plan_dir, _, _ = g.build(Path("/tmp/trtopt-batch1-host"), shape, device, 256, ())
    plan = read_plan(plan_dir)
    executor = create_executor("torch", plan_dir, plan, device="cuda", cuda_graphs=True)
    for i in range(2):
        instrumented(executor, plan, shape, device, f"engine {i}")
    e = g.make_engine(executor, plan, max_num_seqs=256, kv_gb=4.0, async_scheduling=True)
    b = g.batch1_decode(e, shape.vocab, device)
    print(f"batch1_decode engine 2: {b['decode_tok_s']:.0f} tok/s, GPU {b['gpu_ms_per_token']:.3f} ms, exposed host "
          f"{b['host_ms_per_token']:.3f} ms")
    del e
    instrumented(executor, plan, shape, device, "engine 3")


if __name__ == "__main__":
    main()
