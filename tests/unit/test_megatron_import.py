"""`megarl.mcore`'s import of megatron-core without CUDA: `jit_fuser` (`torch.compile`) deferred to each fused
function's first call, so that a process that never calls one never imports TorchDynamo and Inductor."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import REPO, env

from megarl.mcore import _deferred_compile

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine megatron-core is imported untouched")

_PROBE = """
import json, sys
{first}
import megatron.core.models.gpt
from megatron.core import jit
print(json.dumps({{"dynamo": "torch._dynamo" in sys.modules, "inductor": "torch._inductor" in sys.modules,
                  "torch_at_megarl_mcore": {torch_at}, "jit_fuser": jit.jit_fuser.__qualname__}}))
"""


def _probe(first: str, torch_at: str = "None") -> dict:
    code = _PROBE.format(first=first, torch_at=torch_at)
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=REPO, env=env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@cpu_only
def test_megatron_through_megarl_imports_no_dynamo_and_plain_megatron_does():
    through = _probe("import megarl.mcore\ntorch_at = 'torch' in sys.modules", torch_at="torch_at")
    assert through["torch_at_megarl_mcore"] is False, "megarl.mcore itself must stay free of torch (the CLI's parser)"
    assert through["dynamo"] is False and through["inductor"] is False, through
    assert through["jit_fuser"] == "_deferred_compile.<locals>.deferred", through
    plain = _probe("")  # the same imports without megarl.mcore first: what the deferral saves
    assert plain["dynamo"] is True and plain["jit_fuser"] == "compile", plain


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, model, **kwargs):
        self.calls.append((getattr(model, "__name__", model), kwargs))
        return lambda *a, **k: ("compiled", model(*a, **k))


def test_deferred_compile_compiles_once_at_the_first_call_with_the_decorators_arguments():
    real = _Recorder()
    deferred = _deferred_compile(real)

    @deferred
    def plain(x):
        return x + 1

    @deferred(mode="max-autotune-no-cudagraphs")
    def with_mode(x):
        return x * 2

    assert real.calls == [], "decorating compiles nothing"
    assert plain.__name__ == "plain" and with_mode.__wrapped__.__name__ == "with_mode"
    assert plain(1) == ("compiled", 2) and plain(2) == ("compiled", 3)
    assert with_mode(3) == ("compiled", 6)
    assert real.calls == [("plain", {}), ("with_mode", {"mode": "max-autotune-no-cudagraphs"})]
    module = torch.nn.Linear(2, 2)
    deferred(module, dynamic=False)  # a module goes to the real compile at once, as torch.compile(module) does
    assert real.calls[-1] == (module, {"dynamic": False}) and len(real.calls) == 3


def test_a_deferred_function_gives_what_torch_compile_gives():
    def f(x):
        return torch.nn.functional.silu(x) * x + 1

    x = torch.randn(5, 7)
    deferred = _deferred_compile(torch.compile)(f, backend="eager")
    assert torch.equal(deferred(x), torch.compile(f, backend="eager")(x))
    assert torch.equal(deferred(x), f(x))
