"""Give the actor's GPU memory to a colocated rollout engine while it generates, and take it back to train.

Works on tensor storages, not tensors: Megatron's parameters and `main_grad`s are views into DDP's flat param and
grad buffers, and the distributed optimizer's fp32 shards of fp32 params are views into the same buffers. So each
distinct storage (model weights, gradients, optimizer state: fp32 main params and Adam moments) is copied to a
CPU buffer (pinned when CUDA is present) and resized to 0 bytes; every view into it stays valid and sees the
bytes again after `onload` resizes the storage back and copies them in. Gradients are freed without a copy: each
step zeroes them first.

What it does not free: activations (gone after a step anyway), the CUDA caching allocator's reserve (emptied
here), Megatron's global buffers, the reference model (kept where it is), and memory outside torch (NCCL).
On a CPU-only machine it still moves the bytes to a separate buffer and back, which is how the tests check it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

PARAMS, GRADS, OPTIMIZER = "params", "grads", "optimizer"


@dataclass
class _Stored:
    storage: torch.UntypedStorage
    nbytes: int
    device: torch.device
    kind: str
    host: torch.Tensor | None = None  # the bytes while offloaded (None for gradients)


@dataclass
class Offloader:
    """Offload / onload one Megatron model (DDP-wrapped or not) and its Megatron optimizer."""

    model: torch.nn.Module
    optimizer: object | None = None
    _stored: dict[tuple, _Stored] = field(default_factory=dict, repr=False)

    def _storages(self) -> dict[tuple, tuple[torch.UntypedStorage, str, torch.device]]:
        """Every storage the actor owns, keyed by (device, address), each counted once, the first kind wins:
        params, then grads, then optimizer (the fp32 optimizer's params *are* the model's)."""
        found: dict[tuple, tuple[torch.UntypedStorage, str, torch.device]] = {}

        def add(t, kind):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                s = t.untyped_storage()
                found.setdefault((t.device, s.data_ptr()), (s, kind, t.device))

        params = list(self.model.parameters())
        for p in params:
            add(p.data, PARAMS)
        for p in params:
            add(getattr(p, "main_grad", None), GRADS)
            add(p.grad, GRADS)
        for opt in _torch_optimizers(self.optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    add(p.data, OPTIMIZER)
            for state in opt.state.values():
                for value in state.values():
                    add(value, OPTIMIZER)
        return found

    @torch.no_grad()
    def offload(self, *, params: bool = True, grads: bool = True, optimizer: bool = True) -> int:
        """Free the chosen kinds of storage on the model's device; returns the bytes freed."""
        kinds = {k for k, on in ((PARAMS, params), (GRADS, grads), (OPTIMIZER, optimizer)) if on}
        home = next(self.model.parameters()).device
        freed = 0
        for key, (storage, kind, device) in self._storages().items():
            if kind not in kinds or device != home or key in self._stored:
                continue
            nbytes = storage.nbytes()
            host = None
            if kind != GRADS:
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
                host.copy_(_bytes_of(storage, device), non_blocking=True)
            self._stored[key] = _Stored(storage, nbytes, device, kind, host)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies must finish before the storages go
        for _key, stored in self._stored.items():
            if stored.storage.nbytes():
                freed += stored.nbytes
                stored.storage.resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return freed

    @torch.no_grad()
    def onload(self) -> int:
        """Re-allocate everything offloaded and copy its bytes back (gradients come back zeroed)."""
        restored = 0
        for stored in self._stored.values():
            stored.storage.resize_(stored.nbytes)
            view = _bytes_of(stored.storage, stored.device)
            if stored.host is None:
                view.zero_()
            else:
                view.copy_(stored.host, non_blocking=True)
            restored += stored.nbytes
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._stored.clear()
        return restored

    @property
    def offloaded_bytes(self) -> int:
        return sum(s.nbytes for s in self._stored.values())


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _torch_optimizers(opt):
    """The torch optimizers inside a Megatron optimizer (possibly chained)."""
    if opt is None:
        return
    if isinstance(opt, torch.optim.Optimizer):
        yield opt
        return
    children = getattr(opt, "chained_optimizers", None)
    if children:  # a ChainedOptimizer (dense and expert parameters, at EP > 1): its `.optimizer` asserts one child
        for child in children:
            yield from _torch_optimizers(child)
        return
    inner = getattr(opt, "optimizer", None)
    if inner is not None and inner is not opt:
        yield from _torch_optimizers(inner)
