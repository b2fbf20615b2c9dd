"""The runtime's own Triton kernels: those the runtime launches directly, not through a graph op.

The rule: a Triton kernel lives beside the torch path it replaces. A trtopt op's kernels are launched by the op, so
they live in plugins/<op>/kernel.py; every other kernel is launched by runtime code and lives here, one
``<name>_triton.py`` per kernel (the ``@triton.jit`` functions and their host launcher, which checks shapes and
dtypes). Those modules import Triton at the top, so their callers import them lazily, only for CUDA tensors, and keep
the torch path beside the call:

- argmax.py (`greedy_argmax`, the sampler's argmax, also taken inside the executor's CUDA graphs) → argmax_triton.py;
- executors/gemv.py (decode-sized projections) → gemv_triton.py;
- batch.py `fill_placeholders_` (async scheduling's placeholder ids, filled by the executor) → placeholders_triton.py.
"""
