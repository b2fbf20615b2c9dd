"""LLM: the offline batch API (vLLM's conventions, so users' code carries over).

    from trtopt import LLM, SamplingParams
    llm = LLM("out/plan")
    outs = llm.generate(["Hello, my name is", [{"role": "user", "content": "Hi!"}]], SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text, outs[0].metrics.time_to_first_token)
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from trtopt.errors import ConfigError, RequestError
from trtopt.runtime.batch import RequestOutput
from trtopt.runtime.beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search
from trtopt.runtime.config import NodeConfig
from trtopt.runtime.engine import LLMEngine, PromptType
from trtopt.runtime.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, plan_dir: str | Path, *, backend: str = "torch", device: str = "cpu",
                 tensor_parallel_size: int | None = None, nnodes: int = 1, node_rank: int = 0,
                 master_addr: str | None = None, master_port: int | None = None, **engine_config: Any) -> None:
        """Load a plan dir built by `trtopt build`. engine_config: EngineConfig fields (num_blocks, max_num_seqs, ...).

        tensor_parallel_size: for a plan built with --tensor-parallel N, N worker ranks (None = the plan's N); call
        shutdown() (or use ``with LLM(...) as llm``) to stop them.
        nnodes, node_rank, master_addr, master_port: those ranks over several hosts, torchrun's way (NodeConfig): the
        same call on every node but node_rank. Node 0 runs the engine. On node R > 0 this call only runs that node's
        ranks and returns when node 0's engine shuts down; that LLM is_driver False and cannot generate.
        """
        nodes = NodeConfig(nnodes, node_rank, master_addr, master_port)
        self.is_driver = nodes.node_rank == 0
        self._ids = itertools.count()
        if not self.is_driver:
            from trtopt.runtime.executors.tensor_parallel import run_worker_node

            run_worker_node(plan_dir, tensor_parallel_size, nodes, device=device)
            return
        self.engine = LLMEngine.from_plan(plan_dir, backend=backend, device=device,
                                          tensor_parallel_size=tensor_parallel_size, nodes=nodes, **engine_config)

    def shutdown(self) -> None:
        if self.is_driver:
            self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_output: Callable[[RequestOutput], None] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt, continuously batched; results come back in prompt order.

        A prompt is a string, a chat message list ([{"role": ..., "content": ...}], rendered with the chat
        template), token ids, or {"prompt_token_ids": [...]}. `on_output` sees every intermediate
        RequestOutput (for streaming). A bad prompt raises RequestError before anything runs. `use_tqdm` shows a
        progress bar of finished prompts with the input and output tokens/s so far (vLLM's flag name; drawn with rich).

        Without `on_output` nobody reads the intermediate outputs, so the requests run with
        output_kind=FINAL_ONLY (as vLLM's LLM does): the engine makes one output per request, when it finishes.
        """
        if not self.is_driver:
            raise ConfigError("this LLM ran a worker node (node_rank > 0) of a multi-node group, which has ended; only "
                              "node 0 generates.")
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        if on_output is None:
            copies: dict[int, SamplingParams] = {}  # one copy per distinct params object ([p] * n is the common case)
            for p in params:
                if id(p) not in copies:
                    copies[id(p)] = _final_only(p)
            params = [copies[id(p)] for p in params]
        ids = [f"llm-{next(self._ids)}" for _ in prompt_list]
        added = []
        try:
            for rid, prompt, p in zip(ids, prompt_list, params):
                self.engine.add_request(rid, prompt, p)
                added.append(rid)
        except RequestError:
            for rid in added:  # all or nothing: the batch does not half-run
                self.engine.abort(rid)
            raise
        if use_tqdm:
            return self._run_with_progress(ids, on_output)
        return self._run(ids, on_output)

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: the params.beam_width best sequences of each prompt, best first
        (runtime/beam_search.py says how they are searched). Each BeamSequence holds the prompt and output tokens, the
        text of both, the output's cumulative logprob and per output token its logprobs. A bad prompt raises
        RequestError before anything runs."""
        if not self.is_driver:
            raise ConfigError("this LLM ran a worker node (node_rank > 0) of a multi-node group, which has ended; only "
                              "node 0 generates.")
        ids = (f"llm-beam-{next(self._ids)}" for _ in itertools.count())
        return run_beam_search(self.engine, _as_prompt_list(prompts), params, request_ids=ids)

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]], sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """generate() for one conversation or a list of conversations."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        return self.generate(list(messages), sampling_params)

    def _run(self, ids: list[str], on_output: Callable[[RequestOutput], None] | None) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        while len(final) < len(ids):
            for out in self.engine.step():
                if on_output is not None:
                    on_output(out)
                if out.finished and out.request_id in wanted:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]


    def _run_with_progress(self, ids: list[str], on_output: Callable[[RequestOutput], None] | None) -> list[RequestOutput]:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn("Processed prompts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[speed]}"))
        with Progress(*columns) as progress:
            task = progress.add_task("generate", total=len(ids), speed="")
            start = time.perf_counter()
            tokens = {"in": 0, "out": 0}

            def tick(out: RequestOutput) -> None:
                tokens["out"] += sum(len(c.delta_token_ids) for c in out.outputs)
                if out.finished:
                    tokens["in"] += len(out.prompt_token_ids)
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    progress.update(task, advance=1, speed=f"input {tokens['in'] / elapsed:.1f} tok/s, "
                                                           f"output {tokens['out'] / elapsed:.1f} tok/s")
                if on_output is not None:
                    on_output(out)

            return self._run(ids, tick)


def _is_single_prompt(p: Any) -> bool:
    if isinstance(p, (str, dict)):
        return True
    # A list of ints is one tokenized prompt; a list of role/content dicts is one conversation.
    return isinstance(p, (list, tuple)) and bool(p) and (all(isinstance(x, int) for x in p) or all(isinstance(x, dict) and "role" in x for x in p))


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if _is_single_prompt(prompts):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise RequestError("prompts must be a prompt or a non-empty list of prompts (text, chat messages or token ids).")
    return list(prompts)


def _final_only(params: SamplingParams) -> SamplingParams:
    if params.output_kind is RequestOutputKind.FINAL_ONLY:
        return params
    return dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise RequestError(f"got {len(params)} SamplingParams for {n} prompts; pass one, or one per prompt.")
    return params
