"""AllGather, face 5 of docs/architecture.md §4: how TensorRT would take it. Importing this module registers nothing.

Today a trtopt.AllGather node carries no ``plugin_namespace`` (SCHEMA.tensorrt_plugin is False), so the TensorRT
ONNX parser inlines its Tile body (the identity for one rank): right for a plan sharded for one rank; the TensorRT
executor refuses plans sharded for more (trtopt/runtime/executors/__init__.py). The multi-rank route, written to
TensorRT-LLM's API and NOT run here (neither tensorrt nor tensorrt_llm can be installed on the project's machines),
is NCCL through TensorRT-LLM's ``AllGather`` plugin (cpp/tensorrt_llm/plugins/ncclPlugin/allgatherPlugin.cpp,
namespace ``tensorrt_llm``, version "1"), next to the AllReduce plugin that all_reduce/trt_plugin.py describes:

- The same process setup as for AllReduce: ``import tensorrt_llm.plugin`` (dlopens libnvinfer_plugin_tensorrt_llm.so
  and registers its creators) and ranks started under MPI: the plugin's ``initialize()`` creates the NCCL
  communicator of ``group`` through MPI, not through torch.distributed. AllReduce and AllGather of one group share
  that communicator (``getCommMap()`` is keyed by the group).
- The creator reads two PluginFields: ``group`` (INT32 array of the ranks, 0..N-1) and ``type_id`` (INT32, the
  trt.DataType of x). ``enqueue`` is one ``ncclAllGather`` of the whole input on the engine's stream, so it sits in
  the engine's CUDA graph like the all-reduce.
- The plugin concatenates along dim 0 only (``getOutputDimensions``: d0 x group size), as the torch face's
  ``all_gather_into_tensor`` does; the vocabulary-parallel LM head needs the last axis. For the paged signature's
  LM-head output, ``[1, N, V/W]`` (batch always 1), dim-0 blocks are ``[W, N, V/W]``: a shuffle that transposes to
  ``[N, W, V/W]`` and reshapes to ``[1, N, V]`` puts rank r's columns at ``[r·V/W, (r+1)·V/W)``, exactly the torch
  face's layout (TensorRT-LLM's ``functional.allgather(..., gather_dim=k)`` does the same with split + concat).

``add_all_gather_layer`` below does it on the network after parsing, which keeps the ONNX plan free of TensorRT-LLM
specifics (the parser would hand a plugin only the node's ONNX attributes, and ``group`` is an array).
"""

from __future__ import annotations

from typing import Any

PLUGIN_NAME = "AllGather"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "tensorrt_llm"
HAS_TENSORRT_PLUGIN = False  # mirrors SCHEMA.tensorrt_plugin: nodes carry no plugin_namespace


def add_all_gather_layer(network: Any, x: Any, world_size: int) -> Any:
    """Add TensorRT-LLM's NCCL AllGather over ranks 0..world_size-1 to a TensorRT ``network`` for the LM head's
    ``x`` of shape ``[1, N, V/world_size]``; return the ``[1, N, V]`` ITensor, rank-major along the last axis.

    Not run on the project's machines (see the module docstring); kept to the documented IPluginCreator API of
    TensorRT 10 (``get_plugin_creator`` / ``create_plugin`` / ``add_plugin_v2``, ``add_shuffle``).
    """
    import numpy as np
    import tensorrt as trt

    import tensorrt_llm.plugin  # noqa: F401  (loads libnvinfer_plugin_tensorrt_llm.so and registers its creators)

    assert len(x.shape) == 3 and x.shape[0] == 1, "the paged signature's LM-head output is [1, N, V/world_size]"
    creator = trt.get_plugin_registry().get_plugin_creator(PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE)
    if creator is None:
        raise RuntimeError("TensorRT-LLM's AllGather plugin is not registered; install tensorrt_llm.")
    fields = [
        trt.PluginField("group", np.arange(world_size, dtype=np.int32), trt.PluginFieldType.INT32),
        trt.PluginField("type_id", np.array([int(x.dtype)], np.int32), trt.PluginFieldType.INT32),
    ]
    plugin = creator.create_plugin("allgather", trt.PluginFieldCollection(fields))
    gathered = network.add_plugin_v2([x], plugin).get_output(0)  # [W, N, V/W]: rank r's block at row r
    shuffle = network.add_shuffle(gathered)
    shuffle.first_transpose = trt.Permutation([1, 0, 2])  # [N, W, V/W]
    shuffle.reshape_dims = trt.Dims([1, -1, world_size * int(x.shape[2])])  # [1, N, V]
    return shuffle.get_output(0)
