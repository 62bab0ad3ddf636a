"""Everything that touches megatron-core: parallel state, the model, weights, log-probs, checkpoints."""

import importlib.abc
import importlib.util
import sys
import warnings

# megatron-core warns at import and at model build, on every rank, that Apex and Transformer Engine are absent and
# it falls back to torch (optimizers, norms, multi-tensor ops), and that the default CUDA-graph scope is
# deprecated. megarl never uses Apex (its own kernels or Transformer Engine's spec, `parallel.layer_spec`) and
# takes no CUDA graphs, so these say nothing about a run; a run that asks for Transformer Engine without it stops
# with its own error.
for _message in (r"(Transformer Engine and )?Apex (is|are) not installed", r"full scope is deprecated"):
    warnings.filterwarnings("ignore", message=_message, category=UserWarning, module=r"megatron\.")


def _deferred_compile(real):
    """`torch.compile` as a decorator whose work, imports included, waits for the decorated function's first call."""
    import functools
    import inspect

    def deferred(model=None, **kwargs):
        if model is None:  # @torch.compile(mode=...)
            return lambda fn: deferred(fn, **kwargs)
        if not inspect.isfunction(model):
            return real(model, **kwargs)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **kwargs)
            return compiled(*args, **kw)

        return call

    return deferred


class _DeferMegatronCompile(importlib.abc.MetaPathFinder):
    """Imports `megatron.core.jit` with its `jit_fuser` (`torch.compile`) deferred to each fused function's first call.

    `jit.py` sets `jit_fuser = torch.compile` and megatron-core's fusions apply it as a decorator while they are
    imported; `torch.compile` imports TorchDynamo and Inductor on that first use: ~2.4 s of every process's start
    on this project's CPUs, a third of it, for functions that a CPU run never calls (megarl turns the fused kernels
    off without CUDA: `parallel.layer_spec`). A decorated function's compilation waits for its first call anyway;
    this defers the import with it, so a function that is called compiles exactly as before. Only without CUDA: on
    a GPU machine megatron-core is imported untouched. Installed here, at no cost, so that whichever megarl module
    imports megatron-core first goes through it; `megarl.mcore` itself still imports no torch."""

    def find_spec(self, name, path=None, target=None):
        if name != "megatron.core.jit":
            return None
        sys.meta_path.remove(self)  # once; and the lookup below must not find this finder again
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_deferred(module):
            import torch

            if torch.cuda.is_available():
                return exec_module(module)
            real = torch.compile
            torch.compile = _deferred_compile(real)
            try:
                exec_module(module)
            finally:
                torch.compile = real

        spec.loader.exec_module = exec_deferred
        return spec


if "megatron.core.jit" not in sys.modules:  # (this module's body runs once a process)
    sys.meta_path.insert(0, _DeferMegatronCompile())
