"""trtopt::AllGather: ``x`` of every rank of the tensor-parallel group, concatenated along ``axis`` in rank order,
inserted by the sharding pass (trtopt/builder/sharding/analysis.py) after a vocabulary-parallel LM head, so
every rank (the driver's rank 0 among them) holds the full-vocabulary logits rows it samples from.

Faces (docs/architecture.md §4): schema; function (Tile world_size times along axis: the identity for a group of one,
so a
rank plan built for one rank runs unchanged on every single-device runtime); reference (the torch face, over
torch.distributed's ``all_gather_single``: gloo on CPU, NCCL on CUDA, capturable in a CUDA graph like the
all-reduce); a torch.library custom op for compile mode (runtime/executors/torch_library.py); no Triton
kernel (NCCL is the kernel); trt_plugin (how TensorRT-LLM's NCCL AllGather plugin would take it, written to the API,
not runnable here).
"""
