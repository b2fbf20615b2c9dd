"""trtopt::AllReduce: the sum of ``x`` over the ranks of the tensor-parallel group, inserted by the sharding pass
(trtopt/builder/sharding/analysis.py) after every row-parallel projection.

Faces (docs/architecture.md §4): schema; function (Identity: the sum over a group of one, so a rank plan built for one
rank runs unchanged on every single-device runtime); reference (the torch face, over torch.distributed: gloo on CPU,
NCCL on CUDA); p2p (the CUDA fast path: one-shot and two-shot sums over peer-to-peer memory with torch's symmetric
memory, NCCL for larger messages; docs/architecture.md §7b "All-reduce paths"); trt_plugin (how TensorRT-LLM's NCCL
AllReduce plugin would take it, written to the API, not runnable here).
"""
