"""Which path the tensor-parallel all-reduces take (runtime/executors/all_reduce.py), on CPU: the TRTOPT_ALL_REDUCE
modes, the start-up decision and its fallbacks (with the ranks' agreement and the symmetric-memory calls stubbed:
they need GPUs, tests/plugins/test_all_reduce_p2p.py runs them on two or four), and the routing of a converted
graph's trtopt::AllReduce calls to the fast path, which leaves a plan's logits unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from test_executors import NUM_BLOCKS, generate_and_compare
from trtopt.builder.pipeline import build_plan
from trtopt.builder.plan import Limits, rank_dir, read_plan
from trtopt.errors import ConfigError
from trtopt.plugins.all_reduce import p2p
from trtopt.runtime.executors import all_reduce as paths
from trtopt.runtime.executors import create_executor, trtopt_ops

LIMITS = Limits(block_size=16, max_num_tokens=256, max_num_seqs=8, max_model_len=256)
CUDA0 = torch.device("cuda", 0)


class FakeComm:
    """A P2PAllReduce stand-in: counts calls; takes messages up to ``max_bytes`` (returns a copy: one rank's sum)."""

    def __init__(self, *, world_size: int = 1, max_bytes: int = 1 << 30, agrees: bool = True):
        self.world_size, self.device, self.max_bytes, self.agrees = world_size, torch.device("cpu"), max_bytes, agrees
        self.calls = self.taken = 0
        self.closed = False
        self.limits = p2p.default_limits(2)
        self.rank = 0

    def all_reduce(self, x):
        self.calls += 1
        if x.numel() * x.element_size() > self.max_bytes:
            return None
        self.taken += 1
        return x.clone()

    def agrees_with_sum(self) -> bool:
        return self.agrees

    def close(self) -> None:
        self.closed = True


def test_mode_from_the_environment(monkeypatch):
    monkeypatch.delenv(paths.ALL_REDUCE_ENV, raising=False)
    assert paths.all_reduce_mode() == "nccl"  # until the fast path's e2e GPU tests pass (all_reduce.py)
    monkeypatch.setenv(paths.ALL_REDUCE_ENV, " NCCL ")
    assert paths.all_reduce_mode() == "nccl"
    assert paths.all_reduce_mode("p2p") == "p2p"  # an explicit value wins
    monkeypatch.setenv(paths.ALL_REDUCE_ENV, "fast")
    with pytest.raises(ConfigError, match="TRTOPT_ALL_REDUCE='fast' is not one of auto, nccl, p2p"):
        paths.all_reduce_mode()


def test_cpu_takes_nccl_face_without_any_collective():
    """On CPU (gloo) nothing changes: no group needed, no collective, no communicator; a bad mode still fails."""
    assert not dist.is_initialized()
    assert paths.setup_all_reduce(torch.device("cpu"), local_world_size=2, mode="p2p") is None
    with pytest.raises(ConfigError):
        paths.setup_all_reduce(torch.device("cpu"), local_world_size=2, mode="bogus")


@pytest.fixture
def two_cuda_ranks(monkeypatch):
    """setup_all_reduce as rank 0 of two CUDA ranks sees it: the agreement is this rank's own answer ("other": what
    the other rank says), the communicator a FakeComm (``made``)."""
    state = {"other": True, "made": [], "agreements": 0, "reason": None, "agrees": True}

    def every_rank(ok, device):
        state["agreements"] += 1
        return ok and state["other"]

    def create(group, device, limits, **kw):
        state["made"].append(comm := FakeComm(world_size=2, agrees=state["agrees"]))
        return comm

    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(dist, "group", type("G", (), {"WORLD": type("W", (), {"group_name": "0"})()}))
    monkeypatch.setattr(paths, "_every_rank", every_rank)
    monkeypatch.setattr(p2p, "unavailable_reason", lambda device, **k: state["reason"])
    monkeypatch.setattr(p2p.P2PAllReduce, "create", staticmethod(create))
    return state


def test_setup_takes_p2p_when_every_rank_can(two_cuda_ranks):
    for mode in ("auto", "p2p"):
        comm = paths.setup_all_reduce(CUDA0, local_world_size=2, mode=mode)
        assert isinstance(comm, FakeComm) and not comm.closed
    assert two_cuda_ranks["agreements"] == 4  # can use it? built and checked? (each mode)


def test_setup_nccl_mode_never_allocates(two_cuda_ranks):
    assert paths.setup_all_reduce(CUDA0, local_world_size=2, mode="nccl") is None
    assert two_cuda_ranks["made"] == [] and two_cuda_ranks["agreements"] == 1  # the other ranks still ask


@pytest.mark.parametrize("failure", ["local", "other-rank", "wrong-sum"])
def test_setup_falls_back_to_nccl_or_refuses_p2p(two_cuda_ranks, failure):
    if failure == "local":
        two_cuda_ranks["reason"] = "cuda:0 cannot access the memory of cuda:[1] (no peer-to-peer path)"
    elif failure == "other-rank":
        two_cuda_ranks["other"] = False
    else:
        two_cuda_ranks["agrees"] = False
    assert paths.setup_all_reduce(CUDA0, local_world_size=2, mode="auto") is None
    assert all(comm.closed for comm in two_cuda_ranks["made"])  # a buffer built but not agreed on is released
    want = {"local": "no peer-to-peer path", "other-rank": "another rank cannot use it",
            "wrong-sum": "start-up sum came out wrong"}[failure]
    with pytest.raises(ConfigError, match=f"TRTOPT_ALL_REDUCE=p2p but .*{want}"):
        paths.setup_all_reduce(CUDA0, local_world_size=2, mode="p2p")


def test_setup_survives_a_failed_rendezvous(two_cuda_ranks, monkeypatch):
    def refuse(group, device, limits, **kw):
        raise RuntimeError("CUDA driver error: invalid argument")

    monkeypatch.setattr(p2p.P2PAllReduce, "create", staticmethod(refuse))
    assert paths.setup_all_reduce(CUDA0, local_world_size=2, mode="auto") is None
    with pytest.raises(ConfigError, match="symmetric memory failed: CUDA driver error"):
        paths.setup_all_reduce(CUDA0, local_world_size=2, mode="p2p")


def test_fast_face_falls_back_to_the_nccl_face():
    """p2p.all_reduce: the communicator's sum when it takes the message, else the torch face (identity for one
    rank outside a group; a world_size that disagrees with the group is refused there, as before)."""
    x = torch.randn(4, 8)
    comm = FakeComm(max_bytes=64)
    assert torch.equal(p2p.all_reduce(x[:2], world_size=1, comm=comm), x[:2]) and comm.taken == 1
    assert p2p.all_reduce(x, world_size=1, comm=comm) is x and comm.calls == 2 and comm.taken == 1
    with pytest.raises(RuntimeError, match="sharded for 2 ranks but runs in a group of 1"):
        p2p.all_reduce(x, world_size=2, comm=comm)


def test_route_all_reduces_keeps_a_plans_logits(export_dir, module_tmp):
    """Every AllReduce of a plan sharded for one rank goes through the communicator once per layer and step, and
    the logits stay those of the original graph (the fake sums one rank: the identity)."""
    built = build_plan(export_dir("tiny-llama"), module_tmp / "tp1", limits=LIMITS, force=True, progress=False,
                       tensor_parallel=1)
    rank0 = rank_dir(built.plan_dir, 0)
    plan = read_plan(rank0)
    routed = create_executor("torch", rank0, plan, num_blocks=NUM_BLOCKS)
    gm = routed.graph.module
    before = sum(n.target is trtopt_ops.all_reduce for n in gm.graph.nodes)
    assert before == 2 * plan.model.num_layers
    comm = FakeComm()
    assert paths.route_all_reduces(gm, comm) == before
    assert sum(n.target is p2p.all_reduce for n in gm.graph.nodes) == before
    assert not any(n.target is trtopt_ops.all_reduce for n in gm.graph.nodes)
    assert getattr(gm, paths.COMM_ATTR) is comm
    worst = generate_and_compare(rank0, export_dir("tiny-llama"), {"routed": routed})
    assert worst["routed"] <= 1e-4, worst
    assert comm.taken > 0 and comm.taken % before == 0  # every layer's two all-reduces, every step
    assert paths.route_all_reduces(gm, comm) == 0  # nothing left to route


def test_every_engine_rendezvouses_under_a_name_of_its_own():
    """torch keeps a group name's symmetric-memory info (rank, size, store) for the process's life, and every new
    default group is named "0" again: each engine's P2P communicator takes a fresh name, never the default group's."""
    names = {p2p.engine_group_name() for _ in range(100)}
    assert len(names) == 100 and all(n.startswith("trtopt-p2p-") and n != "0" for n in names)


def test_setup_registers_a_name_of_its_own_with_the_store(two_cuda_ranks, monkeypatch):
    seen = []

    def create(group, device, limits, **kw):
        seen.append((group, kw))
        return FakeComm(world_size=2, agrees=True)

    monkeypatch.setattr(p2p.P2PAllReduce, "create", staticmethod(create))
    store = object()
    paths.setup_all_reduce(CUDA0, local_world_size=2, mode="p2p", group_name="0", store=store)
    paths.setup_all_reduce(CUDA0, local_world_size=2, mode="p2p", group_name="trtopt-p2p-1-0", store=store)
    assert seen == [("0", {}), ("trtopt-p2p-1-0", {"store": store})]  # the default group's name needs no store
