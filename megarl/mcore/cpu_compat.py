"""Run megatron-core on a machine without CUDA.

megatron-core assumes CUDA in four places that training needs (found by disabling one patch at a time with
megatron-core 0.16.1 on torch 2.13 CPU; docs/megatron-on-cpu.md has the measurements):

1. `torch.cuda.current_device()` is used as a device everywhere (RoPE `inv_freq`, global memory buffer, ...).
2. Factory calls with a hard-coded `device="cuda"` or `.cuda()` (default causal mask, optimizer `found_inf`,
   token counts in the schedules, grad scaler, grad clipping).
3. The model-parallel RNG tracker forks CUDA generator state; activation recomputation (`--recompute-granularity`)
   saves and restores the CUDA generator's state around each recomputed block.
4. The optimizers check `param.type()` against `torch.cuda.*Tensor` names.

This module handles exactly those, and only when CUDA is absent: `install()` is a no-op on a GPU machine, so the
GPU path stays untouched. Points 1 and 3 are patched once at install; points 2 and 4 are handled by a
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
    from megatron.core.tensor_parallel import random as mp_random

    return {
        "torch.cuda.current_device": (torch.cuda, "current_device"),
        "torch.cuda.synchronize": (torch.cuda, "synchronize"),
        "megatron RNG tracker class": (mp_random, "CudaRNGStatesTracker"),
        "megatron RNG tracker singleton": (mp_random, "_CUDA_RNG_STATE_TRACKER"),
        "megatron RNG tracker init flag": (mp_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED"),
        "megatron CUDA generator state (recomputation)": (mp_random, "_get_cuda_rng_state"),
    }


def install() -> bool:
    """Make megatron-core usable on CPU. Idempotent; does nothing (returns False) when CUDA is available."""
    global _INSTALLED
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
    _INSTALLED = True
    return True


def installed() -> bool:
    return _INSTALLED
