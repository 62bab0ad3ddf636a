"""The adapter's CPU rules without SGLang (a recording stand-in for `sglang.Engine`): these run in the test venv,
with or without the SGLang environment. The same rules against the real engine: test_engine.py, test_train.py."""

import os
import sys
import types
from pathlib import Path

import pytest

from megarl.rollout import sglang_engine
from megarl.rollout.sglang_engine import CPU_ENGINE_ARGS, SGLangEngine, cpu_engine_args


@pytest.fixture()
def fake_sglang(monkeypatch):
    """`sglang` as a module whose Engine records its keyword arguments and the environment it was built in."""
    calls = []

    class Engine:
        def __init__(self, **kwargs):
            calls.append((kwargs, dict(os.environ)))
            os.environ["NCCL_ALGO"] = "allreduce:tree"  # as SGLang's argument resolution does at TP > 1

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=Engine))
    monkeypatch.setattr(sglang_engine, "sglang_available", lambda: (True, ""))
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")  # launch sets it on CPU; restored after the test
    return calls


def test_colocated_refused_on_cpu_before_anything_starts(fake_sglang):
    with pytest.raises(ValueError, match="cannot run colocated.*torch_memory_saver"):
        SGLangEngine.launch("/nowhere", device="cpu", colocated=True)
    assert fake_sglang == []


def test_cpu_launch_is_not_colocated_and_says_so(fake_sglang, capsys, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # as under torchrun
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    engine = SGLangEngine.launch("/model", device="cpu", seed=3, dtype="float32")
    kwargs, environ = fake_sglang[0]
    assert engine.colocated is False and kwargs["enable_memory_saver"] is False
    assert {k: kwargs[k] for k in CPU_ENGINE_ARGS} == CPU_ENGINE_ARGS
    assert kwargs["enable_deterministic_inference"] is False  # SGLang refuses it for torch_native attention
    # SGLang's schedulers must not inherit torchrun's agent-store switch (torch 2.13 then waits for a store
    # nobody hosts); the trainer gets it back, and loses the NCCL setting SGLang wrote, keeping its own.
    assert "TORCHELASTIC_USE_AGENT_STORE" not in environ
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert "NCCL_ALGO" not in os.environ and os.environ["NCCL_DEBUG"] == "WARN"
    err = capsys.readouterr().err
    assert "not colocated" in err and "seeded sampling is not reproducible (seed 3)" in err


def test_cpu_engine_args_keep_the_callers_choices(capsys, monkeypatch):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    args = cpu_engine_args({"max_total_tokens": 512, "attention_backend": "intel_amx"}, seed=None)
    assert args["max_total_tokens"] == 512 and args["attention_backend"] == "intel_amx"
    assert args["device"] == "cpu" and args["disable_cuda_graph"] is True
    assert "seeded" not in capsys.readouterr().err  # unseeded: nothing to warn about


def test_lora_refused_on_cpu_before_anything_starts(fake_sglang):
    """SGLang 0.5.23's LoRA layers pin memory at start, which needs CUDA (its scheduler died so when tried on CPU,
    killing the process that launched it): refused at once, pointing at --lora-weight-sync merged."""
    with pytest.raises(ValueError, match="does not take LoRA.*--lora-weight-sync merged"):
        SGLangEngine.launch("/nowhere", device="cpu", lora_rank=4, lora_targets=["q_proj", "v_proj"])
    assert fake_sglang == []


def test_the_sgl_kernel_placeholder_records_every_call(tmp_path, monkeypatch):
    """What `no_standin_called` relies on: a call to the placeholder is written to the log, then raises."""
    # the folder by path: `from conftest import ...` at run time gets whichever conftest pytest loaded last
    standins = Path(__file__).resolve().parent / "standins"
    log = tmp_path / "calls.log"
    monkeypatch.setenv("MEGARL_SGLANG_STANDIN_LOG", str(log))
    monkeypatch.setenv("MEGARL_SGLANG_STANDINS", "0")  # no torchvision hook in this process
    monkeypatch.syspath_prepend(str(standins))
    for name in ("sgl_kernel", "sitecustomize"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import sgl_kernel

    kernel = sgl_kernel.copy_all_layer_kv_cache_cpu  # importing a name is fine (SGLang's CPU path does)
    with pytest.raises(RuntimeError, match="placeholder"):
        kernel(1, 2)
    assert "sgl_kernel.copy_all_layer_kv_cache_cpu called" in log.read_text()
    assert not hasattr(sgl_kernel, "__version__")
    for name in ("sgl_kernel", "sitecustomize"):
        sys.modules.pop(name, None)
