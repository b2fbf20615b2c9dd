"""The executor contract (runtime/executors/base.py): every backend subclasses one base class, whose capabilities
have the defaults its docstring states, and callers read them as plain attributes."""

from __future__ import annotations

import pytest
import torch

from trtopt.builder.plan import read_plan
from trtopt.runtime.executors import create_executor
from trtopt.runtime.executors.base import Executor
from trtopt.runtime.executors.ort_executor import OrtExecutor
from trtopt.runtime.executors.tensor_parallel import TensorParallelExecutor
from trtopt.runtime.executors.torch_executor import TorchExecutor

CAPABILITIES = ("resolves_placeholders", "last_greedy_tokens", "graphs", "extra_outputs", "capture_graphs",
                "set_cuda_graphs", "shutdown")


def _trt_executor_class() -> type:
    # The module imports without tensorrt (it imports the package only when an executor is made).
    from trtopt.runtime.executors.trt_executor import TrtExecutor

    return TrtExecutor


class _Bare(Executor):
    """The three abstract methods and nothing else: every capability is the base's default."""

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def execute(self, step):
        raise AssertionError("not run here")

    def copy_blocks(self, pairs) -> None:
        pass


def test_every_backend_is_an_executor():
    for cls in (TorchExecutor, OrtExecutor, _trt_executor_class(), TensorParallelExecutor):
        assert issubclass(cls, Executor), cls


def test_the_base_is_abstract_in_its_three_methods_only():
    with pytest.raises(TypeError):
        Executor()  # type: ignore[abstract]
    assert Executor.__abstractmethods__ == {"allocate_kv_cache", "execute", "copy_blocks"}

    class NoCopy(Executor):
        def allocate_kv_cache(self, num_blocks):
            pass

        def execute(self, step):
            pass

    with pytest.raises(TypeError):
        NoCopy()  # type: ignore[abstract]


def test_defaults_are_the_documented_ones():
    ex = _Bare()
    assert ex.num_blocks == 0
    assert ex.resolves_placeholders is False
    assert ex.last_greedy_tokens is None
    assert ex.graphs is None
    assert dict(ex.extra_outputs) == {}
    with pytest.raises(TypeError):  # the shared default is read-only: an executor assigns its own mapping
        ex.extra_outputs["x"] = torch.zeros(1)  # type: ignore[index]
    assert ex.capture_graphs(max_num_seqs=4, max_num_tokens=16) is None
    assert ex.capture_graphs(max_num_seqs=4, max_num_tokens=16, max_logits=8) is None
    ex.set_cuda_graphs(False)  # no graphs: nothing to turn off
    ex.shutdown()
    ex.shutdown()  # idempotent
    ex.allocate_kv_cache(7)
    assert ex.num_blocks == 7 and _Bare().num_blocks == 0


def test_the_docstring_states_every_capability_once():
    doc = Executor.__doc__
    for name in CAPABILITIES:
        assert f"\n      {name}" in doc, f"{name} is not documented in Executor's docstring"
        assert hasattr(Executor, name)


def test_which_backend_overrides_what():
    TrtExecutor = _trt_executor_class()
    assert TorchExecutor.resolves_placeholders is True
    assert isinstance(TorchExecutor.last_greedy_tokens, property)
    assert TorchExecutor.capture_graphs is not Executor.capture_graphs
    for cls in (OrtExecutor, TrtExecutor):
        assert cls.resolves_placeholders is False and cls.last_greedy_tokens is None and cls.graphs is None
        assert cls.capture_graphs is Executor.capture_graphs and cls.shutdown is Executor.shutdown
    # Tensor parallel: it resolves placeholders (the sampled ids broadcast to every rank); greedy tokens stay the
    # default; graphs, capture and shutdown are its own.
    assert TensorParallelExecutor.resolves_placeholders is True and TensorParallelExecutor.last_greedy_tokens is None
    assert isinstance(TensorParallelExecutor.graphs, property)
    for name in ("capture_graphs", "set_cuda_graphs", "shutdown"):
        assert getattr(TensorParallelExecutor, name) is not getattr(Executor, name), name


def test_set_cuda_graphs_default_switches_the_executors_graphs():
    class WithGraphs(_Bare):
        def __init__(self):
            self.graphs = type("Graphs", (), {"enabled": True})()

    ex = WithGraphs()
    ex.set_cuda_graphs(False)
    assert ex.graphs.enabled is False
    ex.set_cuda_graphs(True)
    assert ex.graphs.enabled is True


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_cpu_executors_have_the_defaults_of_a_cpu_run(backend, plan_dir):
    """On CPU no executor has graphs or greedy tokens on hand; a plan without marked outputs has no extra ones."""
    path = plan_dir("tiny-llama")
    ex = create_executor(backend, path, num_blocks=8)  # plan=None: read here, and kept on the executor
    assert ex.plan == read_plan(path)
    assert ex.num_blocks == 8
    assert ex.graphs is None and ex.last_greedy_tokens is None
    assert ex.capture_graphs(max_num_seqs=2, max_num_tokens=16) is None
    assert dict(ex.extra_outputs) == {}
    assert ex.resolves_placeholders is (backend == "torch")
    ex.shutdown()
