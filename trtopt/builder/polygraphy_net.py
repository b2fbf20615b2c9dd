"""A Polygraphy network + config script for a trtopt plan: check the TensorRT engine (AOT plugins included)
against ONNX Runtime running the same plan.

Polygraphy's ``--plugins`` only dlopens .so files; trtopt's plugins are Python (`tensorrt.plugin`), registered by
importing ``trtopt.plugins.<op>.trt_plugin``. So ``load_network()`` (``--model-type=trt-network-script``) and
``load_config(builder, network)`` return the loaders of trtopt/builder/trt_engine.py, the very network and config
that ``trtopt``'s own engine build uses: the plugins registered, the optimization profile from plan.json's limits,
aliased plugin I/O for the in-place KV pools, and the workspace. The plan directory comes from the environment,
since Polygraphy passes the script no arguments:

    export TRTOPT_PLAN=/path/to/plan
    # 1. ONNX Runtime on the fused plan (function bodies) is the reference; keep its inputs and outputs.
    polygraphy run $TRTOPT_PLAN/model.onnx --onnxrt \\
        --data-loader-script trtopt/builder/polygraphy_net.py \\
        --save-inputs inputs.json --save-outputs ort_outputs.json
    # 2. TensorRT on the same plan, same inputs, compared with ORT's outputs.
    polygraphy run trtopt/builder/polygraphy_net.py --model-type=trt-network-script --trt \\
        --trt-config-script trtopt/builder/polygraphy_net.py \\
        --load-inputs inputs.json --load-outputs ort_outputs.json --atol 1e-3 --rtol 1e-3

Step 1 needs valid paged inputs: Polygraphy's random data would index outside the pool, so ``load_data()`` here
yields them (mixed steps: one prefill and one decode row over a cached context). The kv_cache_out.{i} outputs are
compared too: TensorRT aliases them to the pools (in place), Polygraphy's runner gives them their own buffers;
whether TensorRT then copies is unconfirmed (TENSORRT_NOTES.md).

Written against TensorRT 10.x/11.x and Polygraphy's documented script interfaces (NVIDIA/TensorRT
tools/Polygraphy/examples/cli/run/04_defining_a_tensorrt_network_or_config_manually: ``load_network()`` →
(builder, network, parser), ``load_config(builder, network)`` → config; ``load_data()`` yields feed dicts). Not run
here, where TensorRT cannot be installed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import numpy as np

from trtopt import signature
from trtopt.builder.plan import MODEL_FILE, PlanConfig, read_plan
from trtopt.builder.trt_engine import config_loader, network_loader
from trtopt.errors import ConfigError

PLAN_ENV = "TRTOPT_PLAN"


def plan_dir() -> Path:
    """The plan directory named by $TRTOPT_PLAN; ConfigError when unset or not a plan."""
    value = os.environ.get(PLAN_ENV)
    if not value:
        raise ConfigError(f"set {PLAN_ENV} to a plan directory (trtopt build's output) before running polygraphy.")
    path = Path(value)
    if not (path / MODEL_FILE).is_file():
        raise ConfigError(f"{PLAN_ENV}={value} has no {MODEL_FILE}; point it at a directory made by trtopt build.")
    return path


def load_network():
    """Polygraphy's network-script entry: () -> (builder, network, parser) for $TRTOPT_PLAN/model.onnx."""
    return network_loader(plan_dir() / MODEL_FILE)()


def load_config(builder, network):
    """Polygraphy's config-script entry: (builder, network) -> IBuilderConfig with the plan's profile."""
    return config_loader(read_plan(plan_dir()))(builder, network)


def paged_feeds(plan: PlanConfig, *, prefill_len: int = 7, context_len: int = 20, seed: int = 0
                ) -> dict[str, np.ndarray]:
    """One valid mixed step of the paged signature (docs/architecture.md §3), as numpy feeds.

    Sequence 0 is a prefill of ``prefill_len`` tokens; sequence 1 has ``context_len`` tokens cached (random K/V in
    its blocks) and decodes one. Blocks are numbered from 1 (0 is the null block), the tables are padded with 0 to
    the plan's width, and every size stays inside the engine's optimization profile.
    """
    lim, m = plan.limits, plan.model
    if m.dtype not in ("float32", "float16"):
        raise ConfigError(f"numpy has no {m.dtype}; compare a float32 or float16 plan with polygraphy.")
    n0 = max(1, min(prefill_len, lim.max_num_tokens - 1, lim.max_model_len))
    c1 = max(0, min(context_len, lim.max_model_len - 1))
    bs, width = lim.block_size, plan.max_blocks_per_seq
    nb0, nb1 = -(-n0 // bs), -(-(c1 + 1) // bs)
    tables = np.zeros((2, width), dtype=np.int32)
    tables[0, :nb0] = np.arange(1, 1 + nb0)
    tables[1, :nb1] = np.arange(1 + nb0, 1 + nb0 + nb1)
    positions = [*range(n0), c1]
    owners = [0] * n0 + [1]
    slots = [int(tables[s, p // bs]) * bs + p % bs for s, p in zip(owners, positions)]
    rng = np.random.default_rng(seed)
    num_blocks = 2 + nb0 + nb1  # + the null block + one block nobody owns
    pool_shape = signature.kv_dims(num_blocks, m.num_kv_heads, bs, m.head_dim)
    values = {
        signature.INPUT_IDS: rng.integers(0, m.vocab_size, size=(1, n0 + 1)),
        signature.POSITION_IDS: [positions],
        signature.BLOCK_TABLES: tables,
        signature.SEQ_LENS: [n0, c1 + 1],
        signature.QUERY_START_LOC: [0, n0, n0 + 1],
        signature.SLOT_MAPPING: slots,
        signature.LOGITS_INDICES: [n0 - 1, n0],
    }
    feeds = {spec.name: np.asarray(value, dtype=spec.dtype) for spec, value in values.items()}
    for layer in range(m.num_layers):
        feeds[signature.kv_input(layer)] = (0.5 * rng.standard_normal(pool_shape)).astype(m.dtype)
    return feeds


def load_data() -> Iterator[dict[str, np.ndarray]]:
    """Polygraphy's data-loader entry (``--data-loader-script``): two mixed steps of the $TRTOPT_PLAN plan."""
    plan = read_plan(plan_dir())
    yield paged_feeds(plan, seed=0)
    yield paged_feeds(plan, prefill_len=plan.limits.block_size + 3, context_len=2 * plan.limits.block_size, seed=1)
