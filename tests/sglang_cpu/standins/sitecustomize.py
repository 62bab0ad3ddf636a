"""Stand-ins that let SGLang 0.5.23 import on a CPU-only machine; loaded by every Python process of the SGLang
test environment (the tests put this folder first on PYTHONPATH, which SGLang's spawned scheduler and detokenizer
processes inherit). Neither is ever meant to run: each records any call in $MEGARL_SGLANG_STANDIN_LOG and raises,
and the tests fail if that file is not empty (tests/sglang_cpu/conftest.py, `no_standin_called`).

1. torchvision's operator schemas. SGLang imports `torchvision.transforms` at import time
   (`srt/multimodal/internvl_utils.py`); the only torchvision for torch 2.13 on PyPI (0.28.0) is a CUDA build whose
   compiled operators do not load beside the CPU torch, and its Python then fails on `torchvision::nms does not
   exist`. Defining the two schemas (`nms`, `qnms`) before torchvision is first imported is enough for it to
   import; their kernels here only record and raise (nothing megarl runs does detection).
2. `sgl_kernel` (this folder's package): SGLang's CPU path imports eight `*_cpu` kernels from it at module level
   and calls none of them for the models the tests use (Qwen2, `torch_native` attention); see its docstring.
"""

import importlib.abc
import os
import sys

_LIB = None  # the torch.library.Library holding the schemas: it must outlive the import


def record_call(standin: str, name: str) -> None:
    """Append the call to the log the tests check, then the caller raises."""
    path = os.environ.get("MEGARL_SGLANG_STANDIN_LOG")
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
            raise RuntimeError(f"torchvision::{name} is a stand-in (tests/sglang_cpu/standins): it has no kernel")
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


if os.environ.get("MEGARL_SGLANG_STANDINS", "1") == "1":
    sys.meta_path.insert(0, _BeforeTorchvision())
