"""Run megatron-core on a machine without CUDA.

megatron-core assumes CUDA in four places that training needs (found by disabling one patch at a time with
megatron-core 0.16.1 on torch 2.13 CPU; docs/megatron-on-cpu.md has the measurements):

1. `torch.cuda.current_device()` is used as a device everywhere (RoPE `inv_freq`, global memory buffer, ...).
2. Factory calls with a hard-coded `device="cuda"` or `.cuda()` (default causal mask, optimizer `found_inf`,
   token counts in the schedules, grad scaler, grad clipping).
3. The model-parallel RNG tracker forks CUDA generator state; activation recomputation (`--recompute-granularity`)
   saves and restores the CUDA generator's state around each recomputed block.
4. The optimizers check `param.type()` against `torch.cuda.*Tensor` names.

Mixture-of-experts layers (Qwen3-MoE) and sequence parallelism add four more (`_install_moe`):

5. `moe_utils.te_general_gemm` is referenced by the router but defined only with Transformer Engine (a 0.16.1
   bug: every router forward raises NameError without TE).
6. Backward passes of the tensor-parallel collectives and linear layers allocate on `torch.cuda.current_device()`
   inside autograd functions, which run outside `megatron_scope`.
7. The alltoall token dispatcher creates a CUDA stream and waits on a CUDA event.
8. Its split sizes stay tensors on the CPU, where gloo's `all_to_all_single` needs host lists / arrays.

This module handles exactly those, and only when CUDA is absent, except point 5, which is a megatron-core bug on
any machine without a working Transformer Engine and is patched on GPU machines too; otherwise `install()` leaves
a GPU machine untouched. Points 1, 3 and 5-8 are patched once at install; points 2 and 4 are handled by a
`TorchFunctionMode` that is active only inside `megatron_scope()`, which megarl's Megatron-facing code wraps
around its calls into megatron-core (the rollout engine and the algorithm code never pay its overhead).

`patch_points()` lists what is patched so that `tests/unit/test_cpu_compat.py` fails loudly if megatron-core
moves one of them.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False
_CPU = torch.device("cpu")


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA ordinal in torch's factory functions.
    return isinstance(device, int) and not isinstance(device, bool)


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU and makes `.type()` report CUDA tensor names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to:
            args = tuple(_CPU if _is_cuda_device(a) else a for a in args)
        return func(*args, **kwargs)


_MODE = _CudaToCpu()


@contextlib.contextmanager
def megatron_scope() -> Iterator[None]:
    """Context for calls into megatron-core: on a CPU machine, CUDA device requests land on the CPU."""
    if not _INSTALLED:
        yield
        return
    with _MODE:
        yield


def in_megatron_scope(fn):
    """Decorator form of `megatron_scope`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with megatron_scope():
            return fn(*args, **kwargs)

    return wrapper


class CpuRNGStatesTracker:
    """The model-parallel RNG tracker over CPU generator states (megatron's forks the CUDA generator).

    Same interface as `megatron.core.tensor_parallel.random.CudaRNGStatesTracker`: named states seeded per
    TP rank, `fork(name)` swaps a named state in for the duration of a block.
    """

    def __init__(self, *args, **kwargs):
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"rng seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def patch_points() -> dict[str, tuple[object, str]]:
    """The attributes this module replaces, as {description: (owner, attribute)}; each must exist."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer.moe import token_dispatcher

    alltoall = token_dispatcher.MoEAlltoAllTokenDispatcher
    return {
        "MoE alltoall dispatcher's stream": (alltoall, "cuda_dtoh_stream"),
        "MoE alltoall dispatcher's host copies": (alltoall, "_maybe_dtoh_and_synchronize"),
        "MoE dispatcher's host move of split sizes": (token_dispatcher, "maybe_move_tensor_to_cpu"),
        "tensor-parallel all-to-all (MoE dispatch)": (mappings, "_AllToAll"),
        "torch.cuda.current_device": (torch.cuda, "current_device"),
        "torch.cuda.synchronize": (torch.cuda, "synchronize"),
        "megatron RNG tracker class": (mp_random, "CudaRNGStatesTracker"),
        "megatron RNG tracker singleton": (mp_random, "_CUDA_RNG_STATE_TRACKER"),
        "megatron RNG tracker init flag": (mp_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED"),
        "megatron CUDA generator state (recomputation)": (mp_random, "_get_cuda_rng_state"),
    }


def install() -> bool:
    """Make megatron-core usable on CPU. Idempotent; when CUDA is available only the router's GEMM is patched
    (`define_router_gemm`), and it returns False."""
    global _INSTALLED
    define_router_gemm()
    if _INSTALLED:
        return True
    if cuda_available():
        return False
    from megatron.core.tensor_parallel import random as mp_random

    for what, (owner, attr) in patch_points().items():
        if not hasattr(owner, attr):
            raise RuntimeError(
                f"megarl.mcore.cpu_compat: patch point {what} ({owner.__name__}.{attr}) is gone in this "
                "megatron-core/torch version; the CPU compatibility layer needs updating"
            )
    # (1) Any CUDA ordinal is rewritten to the CPU by the mode; 0 keeps int-expecting callers working.
    torch.cuda.current_device = lambda: 0
    # Pipeline p2p synchronises the device after each send/recv; gloo's CPU ops are already complete.
    torch.cuda.synchronize = lambda device=None: None
    # (3) Megatron's tracker calls torch.cuda RNG functions; ours keeps CPU generator states.
    mp_random.CudaRNGStatesTracker = CpuRNGStatesTracker
    mp_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # A recomputed block saves the CUDA generator's state beside the CPU one; without CUDA there is none to save
    # (restoring it is already a no-op: torch queues CUDA calls until CUDA initialises, which it never does).
    mp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    _install_moe()
    _INSTALLED = True
    return True


def define_router_gemm() -> None:
    """(5) The router's gating GEMM tests `te_general_gemm is not None`, a name moe_utils imports only when
    Transformer Engine imports: without it (a CPU, or a GPU machine without a working TE) every router forward
    raises NameError. None selects its torch.mm path; a TE that imported keeps its GEMM."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _install_moe() -> None:
    """Mixture-of-experts layers on CPU, points 6-8 (point 5, `define_router_gemm`, applies on GPUs too)."""
    # (6) The backward passes of the dispatchers' collectives (all-to-all, gather / reduce-scatter along the
    # tokens), and of the linear layers under sequence parallelism, allocate on `torch.cuda.current_device()`;
    # autograd runs them outside `megatron_scope`, so the device mode never sees them: each such backward enters
    # the scope itself.
    for function in _scoped_backward_functions():
        if not getattr(function.backward, "_megarl_scoped", False):
            function.backward = staticmethod(_in_scope_backward(function.backward))
    from megatron.core.transformer.moe import token_dispatcher

    alltoall = token_dispatcher.MoEAlltoAllTokenDispatcher
    # (7) The alltoall dispatcher creates a CUDA stream for its device-to-host copies of the split sizes and
    # waits on a CUDA event: a placeholder stream, and the copies done where megatron-core would start them.
    alltoall.cuda_dtoh_stream = _NO_STREAM
    alltoall._maybe_dtoh_and_synchronize = _dtoh_without_streams
    # (8) The split sizes move to the host as numpy only from a CUDA tensor; on the CPU they stay tensors,
    # which gloo's all_to_all_single refuses as split sizes: host tensors asked for as numpy become numpy.
    token_dispatcher.maybe_move_tensor_to_cpu = _host_tensor


def _scoped_backward_functions() -> list[type]:
    """The autograd functions of megatron-core's tensor-parallel mappings (the MoE dispatchers' collectives) and
    linear layers (whose backward gathers the sequence under sequence parallelism)."""
    from megatron.core.tensor_parallel import layers, mappings

    return [f for module in (mappings, layers) for f in vars(module).values()
            if isinstance(f, type) and issubclass(f, torch.autograd.Function) and "backward" in vars(f)]


def _in_scope_backward(backward):
    @functools.wraps(backward)
    def scoped(*args, **kwargs):
        with megatron_scope():
            return backward(*args, **kwargs)

    scoped._megarl_scoped = True
    return scoped


_NO_STREAM = object()  # not None: the dispatcher's constructor then leaves torch.cuda.Stream() uncalled


def _host_tensor(tensor, as_numpy: bool = False, record_stream: bool = False):
    """`moe_utils.maybe_move_tensor_to_cpu` for tensors already on the host: numpy when asked for."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _dtoh_without_streams(self, point: str, tokens_per_expert=None):
    """`MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize` without a side stream or an event: at the
    device-to-host point the same tensors move to the host (they already are there); nothing to wait for."""
    from megatron.core.transformer.moe import token_dispatcher

    move = token_dispatcher.maybe_move_tensor_to_cpu
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        tokens_per_expert = move(tokens_per_expert)
        self.input_splits = move(self.input_splits, as_numpy=True)
        self.output_splits = move(self.output_splits, as_numpy=True)
        self.output_splits_tp = move(self.output_splits_tp, as_numpy=True)
        self.num_out_tokens = move(self.num_out_tokens)
        if self.num_local_experts > 1 and not self.config.moe_permute_fusion:
            self.num_global_tokens_per_local_expert = move(self.num_global_tokens_per_local_expert)
    return tokens_per_expert


def installed() -> bool:
    return _INSTALLED
