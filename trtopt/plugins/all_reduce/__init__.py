"""trtopt::AllReduce: the sum of ``x`` over the ranks of the tensor-parallel group, inserted by the sharding pass
(trtopt/builder/sharding/analysis.py) after every row-parallel projection.

Faces (docs/architecture.md §4): schema; function (Identity: the sum over a group of one, so a rank plan built for one
rank
runs unchanged on every single-device runtime); reference (the torch face, over torch.distributed: gloo on CPU, NCCL
on CUDA); no Triton kernel (NCCL is the kernel); trt_plugin (how TensorRT-LLM's NCCL AllReduce plugin would take it,
written to the API, not runnable here).
"""
