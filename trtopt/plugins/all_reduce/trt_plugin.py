"""AllReduce, face 5 of docs/architecture.md §4: how TensorRT would take it. Importing this module registers nothing.

Today a trtopt.AllReduce node carries no ``plugin_namespace`` (SCHEMA.tensorrt_plugin is False), so the TensorRT
ONNX parser inlines its Identity body: right for a plan sharded for one rank, and the TensorRT executor refuses
plans sharded for more (trtopt/runtime/executors/__init__.py). The multi-rank route, written to TensorRT-LLM's API
and NOT run here (neither tensorrt nor tensorrt_llm can be installed on the project's machines), is NCCL through
TensorRT-LLM's ``AllReduce`` plugin (cpp/tensorrt_llm/plugins/ncclPlugin/allreducePlugin.cpp, namespace
``tensorrt_llm``, version "1"):

- Load the plugin library once per process (``tensorrt_llm.plugin`` does it on import: it dlopens
  libnvinfer_plugin_tensorrt_llm.so and calls ``initTrtLlmPlugins``), and start the ranks under MPI
  (``mpirun -n N`` or TensorRT-LLM's MpiSession): the plugin's ``initialize()`` creates its NCCL communicator for
  ``group`` through MPI (``getComm(mGroup)``), not through torch.distributed.
- Build one engine per rank from that rank's plan (rank{r}/model.onnx): every AllReduce node becomes the plugin
  layer below, fed the node's input, with the PluginFields the creator reads: ``group`` (INT32 array of the ranks,
  0..N-1), ``type_id`` (INT32, the trt.DataType of x), ``strategy`` (INT8; 0 = NCCL: plain ncclAllReduce, the
  strategy that matches the torch face; AUTO would pick TensorRT-LLM's one-shot custom kernel for small messages
  over NVLink), ``config`` (INT8, 0), ``fusion_op`` (INT8, 0 = NONE: no residual+RMSNorm fusion), ``counter``
  (INT32, 0), ``eps`` (FLOAT32, unused without fusion), ``affine``/``bias``/``scale`` (INT8, 0).
- The engine's output is the reduced tensor, x's shape and dtype, exactly the torch face's contract.

Doing it through the parser rather than by hand would mean setting ``plugin_namespace="tensorrt_llm"`` on the node
(the parser then looks the op up by name, "AllReduce", in that namespace), but the parser hands a plugin only the
node's ONNX attributes, and ``group`` is an INT32 array the node would have to carry; ``add_all_reduce_layer``
below does it on the network instead, after parsing, which keeps the ONNX plan free of TensorRT-LLM specifics.
"""

from __future__ import annotations

from typing import Any

PLUGIN_NAME = "AllReduce"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "tensorrt_llm"
STRATEGY_NCCL = 0  # AllReduceStrategyType::NCCL in tensorrt_llm/kernels/customAllReduceKernels.h
FUSION_NONE = 0  # AllReduceFusionOp::NONE
HAS_TENSORRT_PLUGIN = False  # mirrors SCHEMA.tensorrt_plugin: nodes carry no plugin_namespace


def add_all_reduce_layer(network: Any, x: Any, world_size: int) -> Any:
    """Add TensorRT-LLM's NCCL AllReduce over ranks 0..world_size-1 to a TensorRT ``network``; return its output.

    ``x`` is an ``ITensor``. Not run on the project's machines (see the module docstring); kept to the documented
    IPluginCreator API of TensorRT 10 (``get_plugin_creator`` / ``create_plugin`` / ``add_plugin_v2``).
    """
    import numpy as np
    import tensorrt as trt

    import tensorrt_llm.plugin  # noqa: F401  (loads libnvinfer_plugin_tensorrt_llm.so and registers its creators)

    creator = trt.get_plugin_registry().get_plugin_creator(PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE)
    if creator is None:
        raise RuntimeError("TensorRT-LLM's AllReduce plugin is not registered; install tensorrt_llm.")
    fields = [
        trt.PluginField("group", np.arange(world_size, dtype=np.int32), trt.PluginFieldType.INT32),
        trt.PluginField("type_id", np.array([int(x.dtype)], np.int32), trt.PluginFieldType.INT32),
        trt.PluginField("strategy", np.array([STRATEGY_NCCL], np.int8), trt.PluginFieldType.INT8),
        trt.PluginField("config", np.array([0], np.int8), trt.PluginFieldType.INT8),
        trt.PluginField("fusion_op", np.array([FUSION_NONE], np.int8), trt.PluginFieldType.INT8),
        trt.PluginField("counter", np.array([0], np.int32), trt.PluginFieldType.INT32),
        trt.PluginField("eps", np.array([0.0], np.float32), trt.PluginFieldType.FLOAT32),
        trt.PluginField("affine", np.array([0], np.int8), trt.PluginFieldType.INT8),
        trt.PluginField("bias", np.array([0], np.int8), trt.PluginFieldType.INT8),
        trt.PluginField("scale", np.array([0], np.int8), trt.PluginFieldType.INT8),
    ]
    plugin = creator.create_plugin("allreduce", trt.PluginFieldCollection(fields))
    layer = network.add_plugin_v2([x], plugin)
    return layer.get_output(0)
