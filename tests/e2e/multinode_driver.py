"""Node 0 of tests/e2e/test_tensor_parallel_multinode_gpu.py, in its own process (NCCL reads its environment once
per process, so the network-transport settings must be there from the start): generate greedily on CUDA and print
the token ids as JSON, or, with --kill-pgid, SIGKILL that process group (node 1) after 3 tokens and print the
WorkerDiedError with the seconds it took.

    python tests/e2e/multinode_driver.py PLAN TP PORT MAX_TOKENS [--kill-pgid PGID] PROMPT...
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

from trtopt import LLM
from trtopt.errors import WorkerDiedError
from trtopt.runtime.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("plan")
    parser.add_argument("tp", type=int)
    parser.add_argument("port", type=int)
    parser.add_argument("max_tokens", type=int)
    parser.add_argument("prompts", nargs="+")
    parser.add_argument("--kill-pgid", type=int, default=None)
    args = parser.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, min_tokens=args.max_tokens, ignore_eos=True)
    llm = LLM(args.plan, device="cuda", tensor_parallel_size=args.tp, nnodes=2, node_rank=0,
              master_addr="127.0.0.1", master_port=args.port)
    try:
        if args.kill_pgid is None:
            outs = llm.generate(args.prompts, params)
            print(json.dumps({"prompt_ids": [o.prompt_token_ids for o in outs],
                              "token_ids": [o.outputs[0].token_ids for o in outs]}))
            return
        killed_at: list[float] = []

        def kill(out) -> None:
            if not killed_at and len(out.outputs[0].token_ids) == 3:
                os.killpg(args.kill_pgid, signal.SIGKILL)
                killed_at.append(time.monotonic())

        try:
            llm.generate(args.prompts[0], params, on_output=kill)
            print(json.dumps({"error": None}))
        except WorkerDiedError as e:
            print(json.dumps({"error": str(e), "seconds": time.monotonic() - killed_at[0]}))
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
