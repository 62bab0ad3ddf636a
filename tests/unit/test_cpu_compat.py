"""The CPU compatibility layer for megatron-core (`megarl/mcore/cpu_compat.py`).

`test_patch_points_exist` is the canary: it fails, naming the attribute, when a megatron-core or torch upgrade
moves something the layer patches.

`install()` patches process-global state (torch.cuda.current_device / synchronize and megatron's RNG-tracker
module globals) and cannot be undone. That is acceptable inside a pytest process: it is exactly what every
megarl process does at start-up on a CPU machine, nothing in the unit tests expects the unpatched functions,
and the multi-process tests (tests/distributed) run in their own subprocesses.
"""

from __future__ import annotations

import pytest
import torch

from megarl.mcore import cpu_compat
from megarl.mcore.cpu_compat import CpuRNGStatesTracker, megatron_scope

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is inert where CUDA is available")
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def installed():
    assert cpu_compat.install() is True
    return cpu_compat


def seeded_randn(seed: int, *sizes: int) -> list[torch.Tensor]:
    """Consecutive draws of torch.randn from a fresh CPU generator seeded with `seed`."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in sizes]


# ------------------------------------------------------------------------------------------------ (a) patch points


def test_patch_points_exist():
    points = cpu_compat.patch_points()
    assert set(points) >= {"torch.cuda.current_device", "torch.cuda.synchronize", "megatron RNG tracker class",
                           "megatron RNG tracker singleton", "megatron RNG tracker init flag"}
    missing = [f"{what} ({getattr(owner, '__name__', owner)}.{attr})" for what, (owner, attr) in points.items()
               if not hasattr(owner, attr)]
    assert missing == [], f"patch points gone in this megatron-core/torch: {missing}"


def test_cpu_tracker_has_megatron_tracker_interface():
    import megatron.core.transformer.cuda_graphs as cuda_graphs  # keeps a reference to megatron's own class

    original = cuda_graphs.CudaRNGStatesTracker
    assert original is not CpuRNGStatesTracker
    public = {m for m in dir(original) if not m.startswith("_")}
    assert public == {"add", "fork", "get_states", "is_initialized", "reset", "set_states"}
    assert public <= set(dir(CpuRNGStatesTracker))
    # megatron constructs its tracker with these keywords (initialize_rng_tracker)
    CpuRNGStatesTracker(use_cudagraphable_rng=False, is_inference_rng_tracker=False)


# ------------------------------------------------------------------------------------------------ (b) install


@cpu_only
def test_install_returns_true_and_is_idempotent():
    from megatron.core.tensor_parallel import random as mp_random

    assert cpu_compat.install() is True
    assert cpu_compat.installed() is True
    tracker = mp_random._CUDA_RNG_STATE_TRACKER
    assert isinstance(tracker, CpuRNGStatesTracker)
    tracker_name = "test-idempotent-rng"
    if tracker_name not in tracker.get_states():
        tracker.add(tracker_name, 987654)
    # A second install keeps the same singleton and its states.
    assert cpu_compat.install() is True
    assert mp_random._CUDA_RNG_STATE_TRACKER is tracker
    assert tracker_name in mp_random._CUDA_RNG_STATE_TRACKER.get_states()


@cpu_only
def test_install_patches_device_queries_but_does_not_fake_a_gpu(installed):
    assert torch.cuda.current_device() == 0
    assert torch.cuda.synchronize() is None
    assert torch.cuda.is_available() is False  # callers still see the truth


@gpu_only
def test_install_is_a_noop_with_cuda():
    assert cpu_compat.install() is False
    assert cpu_compat.installed() is False
    with megatron_scope():
        assert torch.zeros(1, device="cuda").is_cuda


# ------------------------------------------------------------------------------------------------ (c) the scope


@cpu_only
def test_cuda_requests_land_on_cpu_inside_scope(installed):
    t = torch.arange(3, dtype=torch.float32)
    with megatron_scope():
        results = {
            "zeros(device='cuda')": torch.zeros(2, device="cuda"),
            "ones(device=0)": torch.ones(1, device=0),
            "tensor(device='cuda')": torch.tensor([1.0], device="cuda"),
            "empty(device=torch.device('cuda', 0))": torch.empty(2, device=torch.device("cuda", 0)),
            "empty(device=current_device())": torch.empty(2, device=torch.cuda.current_device()),
            "arange(device='cuda:0')": torch.arange(4, device="cuda:0"),
            "new_zeros(device='cuda')": t.new_zeros(2, device="cuda"),
            "t.cuda()": t.cuda(),
            "t.cuda(non_blocking=True)": t.cuda(non_blocking=True),
            "t.to('cuda')": t.to("cuda"),
            "t.to(device='cuda')": t.to(device="cuda"),
            "t.to(0)": t.to(0),
            "t.to('cuda', torch.float64)": t.to("cuda", torch.float64),
        }
        type_name = t.type()
        type_names = {dt: torch.zeros(1, dtype=dt).type() for dt in (torch.float16, torch.bfloat16, torch.int64)}
    wrong = [k for k, v in results.items() if v.device.type != "cpu"]
    assert wrong == []
    assert torch.equal(results["ones(device=0)"], torch.ones(1))
    assert torch.equal(results["tensor(device='cuda')"], torch.tensor([1.0]))
    assert torch.equal(results["t.to('cuda')"], t)
    assert results["t.to('cuda', torch.float64)"].dtype == torch.float64
    assert type_name == "torch.cuda.FloatTensor"
    assert type_names == {torch.float16: "torch.cuda.HalfTensor", torch.bfloat16: "torch.cuda.BFloat16Tensor",
                          torch.int64: "torch.LongTensor"}


@cpu_only
def test_scope_is_scoped(installed):
    with megatron_scope():
        torch.zeros(1, device="cuda")
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")
    assert torch.zeros(1).type() == "torch.FloatTensor"
    # Leaving by an exception also ends the mode.
    with pytest.raises(KeyError):
        with megatron_scope():
            raise KeyError("boom")
    with pytest.raises((RuntimeError, AssertionError)):
        torch.ones(1, device="cuda")


@cpu_only
def test_scopes_nest(installed):
    @cpu_compat.in_megatron_scope
    def inner():
        return torch.ones(1, device="cuda").device

    with megatron_scope():
        with megatron_scope():
            assert inner().type == "cpu"
        assert torch.ones(1, device="cuda").device.type == "cpu"  # still inside the outer scope
    with pytest.raises((RuntimeError, AssertionError)):
        torch.ones(1, device="cuda")


@cpu_only
def test_decorator_form(installed):
    @cpu_compat.in_megatron_scope
    def make(n):
        """docstring kept"""
        return torch.zeros(n, device="cuda")

    assert make(3).device.type == "cpu" and make.__doc__ == "docstring kept" and make.__name__ == "make"


@cpu_only
def test_scope_is_inert_before_install(installed, monkeypatch):
    monkeypatch.setattr(cpu_compat, "_INSTALLED", False)
    with megatron_scope():
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(1, device="cuda")


# ------------------------------------------------------------------------------------------------ (d) megatron helpers


@cpu_only
def test_megatron_default_causal_mask_on_cpu(installed):
    from megatron.core.transformer.utils import get_default_causal_mask

    with megatron_scope():
        mask = get_default_causal_mask(4)
    expected = torch.tensor([
        [False, True, True, True],
        [False, False, True, True],
        [False, False, False, True],
        [False, False, False, False],
    ])
    assert mask.device.type == "cpu" and mask.dtype == torch.bool
    assert torch.equal(mask, expected)


@cpu_only
def test_megatron_rotary_embedding_on_cpu(installed):
    # RoPE puts inv_freq on torch.cuda.current_device(): patch point 1.
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    with megatron_scope():
        rope = RotaryEmbedding(kv_channels=4, rotary_percent=1.0, rotary_base=10000)
        freqs = rope(3)
    # inv_freq = 1 / 10000 ** ([0, 2] / 4) = [1, 0.01]; position p gives [p, 0.01 p, p, 0.01 p].
    assert torch.allclose(rope.inv_freq, torch.tensor([1.0, 0.01]))
    assert freqs.shape == (3, 1, 1, 4) and freqs.device.type == "cpu"
    assert torch.allclose(freqs[:, 0, 0], torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 0.01, 1.0, 0.01],
                                                         [2.0, 0.02, 2.0, 0.02]]))


# ------------------------------------------------------------------------------------------------ (e) RNG tracker


def test_tracker_rejects_duplicate_seed_or_name():
    tracker = CpuRNGStatesTracker()
    assert tracker.is_initialized() is False
    tracker.add("a", 1)
    assert tracker.is_initialized() is True
    with pytest.raises(ValueError, match="seed 1 already exists"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="state a already exists"):
        tracker.add("a", 2)
    tracker.reset()
    tracker.add("a", 1)  # allowed again after reset
    assert set(tracker.get_states()) == {"a"}


def test_fork_unknown_name_raises():
    with pytest.raises(KeyError, match="nope"):
        with CpuRNGStatesTracker().fork("nope"):
            pass


def test_fork_draws_from_the_named_stream_and_restores_the_outer_state():
    tracker = CpuRNGStatesTracker()
    tracker.add("model-parallel-rng", 42)
    tracker.add("other", 43)
    first, second = seeded_randn(42, 3, 3)

    torch.manual_seed(7)
    (outer_expected,) = seeded_randn(7, 2)
    with tracker.fork():  # the default name is megatron's "model-parallel-rng"
        a = torch.randn(3)
    with tracker.fork("other"):
        other = torch.randn(3)
    with tracker.fork("model-parallel-rng"):
        b = torch.randn(3)  # continues the stream, does not restart it
    outer = torch.randn(2)  # the global generator is untouched by what happened inside the forks

    assert torch.equal(a, first) and torch.equal(b, second)
    assert torch.equal(other, seeded_randn(43, 3)[0])
    assert torch.equal(outer, outer_expected)


def test_fork_restores_outer_state_after_an_exception():
    tracker = CpuRNGStatesTracker()
    tracker.add("x", 5)
    torch.manual_seed(11)
    before = torch.get_rng_state()
    with pytest.raises(RuntimeError):
        with tracker.fork("x"):
            torch.randn(4)
            raise RuntimeError("inside")
    assert torch.equal(torch.get_rng_state(), before)


def test_tracker_states_round_trip():
    tracker = CpuRNGStatesTracker()
    tracker.add("x", 5)
    with tracker.fork("x"):
        torch.randn(2)
    saved = tracker.get_states()
    with tracker.fork("x"):
        expected = torch.randn(4)
    restored = CpuRNGStatesTracker()
    restored.set_states(saved)
    assert restored.is_initialized()
    with restored.fork("x"):
        assert torch.equal(torch.randn(4), expected)


@cpu_only
def test_megatron_returns_cpu_tracker_after_install(installed):
    from megatron.core import tensor_parallel

    assert isinstance(tensor_parallel.random.get_cuda_rng_tracker(), CpuRNGStatesTracker)
    assert isinstance(tensor_parallel.get_cuda_rng_tracker(), CpuRNGStatesTracker)


@cpu_only
def test_megatron_model_parallel_seed_uses_cpu_tracker(installed):
    from megatron.core.tensor_parallel import random as mp_random

    with megatron_scope():
        # force_reset makes megatron build a fresh tracker from its (patched) tracker class.
        mp_random.model_parallel_cuda_manual_seed(123, tp_rank=1, ep_rank=0, etp_rank=0, force_reset_rng=True)
        tracker = mp_random.get_cuda_rng_tracker()
        with tracker.fork():
            x = torch.randn(3)
    assert isinstance(tracker, CpuRNGStatesTracker)
    assert set(tracker.get_states()) == {"data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"}
    # megatron seeds the TP stream with seed + 2718 + tp_rank
    assert torch.equal(x, seeded_randn(123 + 2718 + 1, 3)[0])


# ------------------------------------------------------------------------------------------------ (c) MoE points


def test_router_still_references_te_general_gemm():
    """(5) megatron-core's router GEMM names `te_general_gemm`; without TE only the layer's None defines it."""
    from megatron.core.transformer.moe import moe_utils

    assert "te_general_gemm" in moe_utils.RouterGatingLinearFunction.forward.__code__.co_names, (
        "the router no longer uses te_general_gemm: cpu_compat's patch (5) can go")


@cpu_only
def test_router_gemm_runs_on_cpu_after_install(installed):
    from megatron.core.transformer.moe import moe_utils

    assert moe_utils.te_general_gemm is None
    x, w = torch.randn(5, 8), torch.randn(3, 8)
    out = moe_utils.RouterGatingLinearFunction.apply(x, w, None, torch.float32)
    assert torch.allclose(out, x @ w.t(), atol=1e-6)


@cpu_only
def test_collective_backwards_allocate_on_the_cpu(installed):
    """(6) The backward passes that allocate on torch.cuda.current_device() (0: a CUDA ordinal) run in the
    layer's scope: outside it the same allocation fails on a CPU machine."""
    import inspect

    from megatron.core.tensor_parallel import layers, mappings

    scoped = {f.__name__ for f in cpu_compat._scoped_backward_functions() if f.backward._megarl_scoped}
    assert {"_AllToAll", "_GatherFromSequenceParallelRegion", "_ReduceScatterToSequenceParallelRegion",
            "LinearWithGradAccumulationAndAsyncCommunication"} <= scoped
    assert "current_device" in mappings._gather_along_first_dim.__code__.co_names
    linear = layers.LinearWithGradAccumulationAndAsyncCommunication
    assert "torch.cuda.current_device()" in inspect.getsource(linear.backward)
    with pytest.raises(RuntimeError):
        torch.empty(2, device=torch.cuda.current_device())
    with megatron_scope():
        assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"


def test_alltoall_dispatcher_still_uses_cuda_streams_and_host_moves():
    """(7, 8) the dispatcher's constructor creates a CUDA stream unless one is set, and its host-copy method uses
    streams, an event and `maybe_move_tensor_to_cpu`, which moves only CUDA tensors."""
    import inspect

    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    cls = token_dispatcher.MoEAlltoAllTokenDispatcher
    assert "torch.cuda.Stream()" in inspect.getsource(cls.__init__)
    original = inspect.getsource(moe_utils.maybe_move_tensor_to_cpu)
    assert "tensor.is_cuda" in original
    method = cls.__dict__["_maybe_dtoh_and_synchronize"]
    if method is cpu_compat._dtoh_without_streams:  # installed: megatron's own is gone from the class
        return
    source = inspect.getsource(method)
    assert "record_event" in source and "maybe_move_tensor_to_cpu" in source


@cpu_only
def test_alltoall_split_sizes_become_host_arrays(installed):
    from megatron.core.transformer.moe import token_dispatcher

    assert token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is not None
    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert splits.tolist() == [3, 1] and not torch.is_tensor(splits)
    counts = torch.tensor([2, 2])
    assert token_dispatcher.maybe_move_tensor_to_cpu(counts) is counts


def test_router_gemm_name_is_set_on_a_gpu_without_transformer_engine(monkeypatch):
    """On a CUDA machine `install()` patches nothing else, but the router still needs `te_general_gemm` defined
    (None) when Transformer Engine is absent: without it a Qwen3-MoE's first forward raises NameError."""
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.setattr(cpu_compat, "cuda_available", lambda: True)
    monkeypatch.setattr(cpu_compat, "_INSTALLED", False)
    if hasattr(moe_utils, "te_general_gemm"):
        monkeypatch.delattr(moe_utils, "te_general_gemm")
    assert cpu_compat.install() is False
    assert moe_utils.te_general_gemm is None
