"""megarl's colocated SGLang adapter (`SGLangEngine`) against SGLang 0.5.23's in-process `Engine`, on CPU.

What is checked, each against the 0.5.23 wheel's own text or code (`sglang_upstream` says how it is read):
- every `sglang.Engine(...)` keyword `SGLangEngine.launch` passes is a `ServerArgs` input field, and its value
  converts to the field's declared type (msgspec, strict);
- every Engine method the adapter calls in a colocation cycle exists, and its arguments bind to that method's
  signature as 0.5.23 declares it (names and kinds, read with `ast`): a renamed keyword fails;
- the sampling dicts given to `Engine.generate` are valid SGLang sampling params (the generated `SamplingParams`,
  which refuses unknown keys, as `SamplingParams(**d)` in the tokenizer manager would, and which the recorder's
  `generate` applies before answering);
- the bucket the adapter pushes with `load_format="flattened_bucket"` goes through what SGLang does with it, as
  SGLang's code run here: the payload normaliser, `deserialize_own_rank` (its `SafeUnpickler` allows only listed
  globals), `_update_weights_from_flattened_bucket` and `FlattenedTensorBucket.reconstruct_tensors`, and comes out
  as the tensors the actor exported, at SGLang TP 1.

Not checked here: `ServerArgs(**kwargs)` itself (test_sglang_runtime_contract.py builds it, with SGLang imported
for real in a subprocess) and the engine module's import (its chain needs a torchvision that loads under this torch
2.13 CPU; see sglang_runtime); CUDA IPC handles (a CPU tensor travels as a shared
memory file descriptor instead); TP > 1, where each TP rank needs its own payload made on its GPU (on CPU the same
payload can be opened once only, so `[payload] * 2` fails on the second rank here too).
"""

from __future__ import annotations

import sys
import types

import msgspec
import pytest
import sglang_upstream as upstream
import torch

from megarl.rollout import sglang_engine
from megarl.rollout.base import SamplingParams
from megarl.rollout.sglang_engine import SGLangEngine
from megarl.rollout.weight_sync import push

class Engine:
    """`sglang.Engine` with 0.5.23's method signatures and nothing else: a call binds its arguments to the declared
    signature first (TypeError on an unknown keyword or a missing argument), then is recorded and answered as
    SGLang answers it."""

    def __init__(self, **kwargs):
        upstream.engine_signatures()["__init__"].bind(self, **kwargs)
        self.server_args, self.calls, self.loaded = kwargs, [], {}

    def __getattr__(self, name):
        if name.startswith("_") or name not in upstream.engine_signatures():
            raise AttributeError(f"sglang {upstream.SGLANG_VERSION} Engine has no method {name!r}")
        signature = upstream.engine_signatures()[name]

        def call(*args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            self.calls.append((name, dict(list(bound.arguments.items())[1:])))
            answer = getattr(self, f"_answer_{name}", None)
            return answer(**kwargs) if answer else None

        return call

    def _answer_generate(self, input_ids, sampling_params, return_logprob=False, logprob_start_len=None, **_):
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(input_ids)
        out = []
        for ids, sp in zip(input_ids, params):
            # As SGLang's tokenizer manager refuses a sampling key it does not know (JsonContractError here).
            new = list(range(7, 7 + upstream.api_types().SamplingParams.from_json_value(sp).max_new_tokens))
            meta = {"finish_reason": {"type": "stop", "matched": 2},
                    "output_token_logprobs": [(-0.5, t, None) for t in new]}
            if logprob_start_len == 0:
                meta["input_token_logprobs"] = [(None if i == 0 else -0.25, t, None) for i, t in enumerate(ids)]
            out.append({"output_ids": new, "meta_info": meta})
        return out

    def _answer_update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        """What 0.5.23 does with a flattened bucket, each step SGLang's own code: `Engine._serialize_tensors_per_rank`
        normalises the payloads, each TP rank deserialises its own (`deserialize_own_rank`) and loads it
        (`_update_weights_from_flattened_bucket`, which calls the model's `load_weights`)."""
        assert load_format == "flattened_bucket", load_format
        payloads = self.ws.utils.normalize_serialized_named_tensor_payloads(named_tensors)
        for rank in range(self.server_args["tp_size"]):
            self.ws.tp_rank = rank
            data = self.ws.deserialize_own_rank(None, payloads)
            model = types.SimpleNamespace(load_weights=lambda pairs, rank=rank: self.loaded.setdefault(
                rank, {}).update({n: t.clone() for n, t in pairs}))
            ok, message = self.ws.update_from_flattened_bucket(types.SimpleNamespace(get_model=lambda m=model: m),
                                                               data)
            if not ok:
                return ok, message
        return True, "Success"


@pytest.fixture
def launched(monkeypatch):
    """`SGLangEngine.launch` as `--rollout-backend sglang` calls it, with `sglang.Engine` the signature-checked
    recorder above (the real one needs GPUs), and SGLang's weight-sync modules in place for the adapter's
    serializer."""
    ws = upstream.weight_sync(monkeypatch)
    sys.modules["sglang"].Engine = Engine
    monkeypatch.setattr(sglang_engine, "sglang_available", lambda: (True, ""))

    def launch(**kw):
        engine = SGLangEngine.launch("/ckpt/hf", **kw)
        engine.engine.ws = ws
        return engine

    return launch


def test_launch_arguments_are_server_args_fields_of_the_declared_types(launched):
    fields = upstream.server_args_fields()
    assert {"model_path", "tp_size", "mem_fraction_static"} <= fields.keys(), "ServerArgs fields were not found"
    for kw in [dict(tp_size=1, mem_fraction=0.45, dtype="bfloat16", seed=3, tokenizer=True),
               dict(tp_size=1, base_gpu_id=4, dtype="auto", seed=None, colocated=False)]:
        server_args = launched(**kw).engine.server_args
        unknown = sorted(server_args.keys() - fields.keys())
        assert not unknown, f"megarl passes sglang.Engine keywords that are no ServerArgs field: {unknown}"
        for name, value in server_args.items():
            declared = upstream.declared_type(fields[name])
            try:
                msgspec.convert(value, declared, strict=True)
            except msgspec.ValidationError as e:
                raise AssertionError(f"ServerArgs.{name} is declared {fields[name]}; megarl passes {value!r}: "
                                     f"{e}") from None


def test_a_colocation_cycle_calls_engine_methods_as_declared(launched):
    engine = launched(tp_size=1, seed=5, tokenizer=True)
    params = SamplingParams(n=2, temperature=0.8, top_k=10, max_new_tokens=3, stop_token_ids=(2,), seed=5,
                            stop=("</tool>",))
    groups = engine.generate([[1, 4, 5], [1, 6]], params)
    scores = engine.score([[1, 4, 5, 6]], [2])
    engine.release_memory()
    weights = [("model.embed_tokens.weight", torch.randn(9, 4)), ("model.norm.weight", torch.randn(4))]
    engine.update_weights(weights, version=1)
    engine.resume_memory()
    engine.shutdown()

    called = [name for name, _ in engine.engine.calls]
    for name in ("generate", "release_memory_occupation", "resume_memory_occupation", "begin_weight_update",
                 "update_weights_from_tensor", "end_weight_update", "flush_cache", "shutdown"):
        assert name in called, f"the cycle no longer calls Engine.{name} (called: {called})"
    assert [len(g) for g in groups] == [2, 2] and scores == [[-0.25, -0.25]]  # sampling params checked in generate
    tags = [t for name, args in engine.engine.calls if name.endswith("_memory_occupation") for t in args["tags"]]
    assert set(tags) <= {"kv_cache", "weights", "cuda_graph"}, tags  # torch_memory_saver's tags in 0.5.23


def test_the_pushed_bucket_is_what_sglangs_own_code_loads(launched):
    """At TP 1 (see the module docstring for TP > 1)."""
    engine = launched(tp_size=1, dtype="bfloat16", seed=0)
    g = torch.Generator().manual_seed(0)
    weights = [("model.embed_tokens.weight", torch.randn(11, 6, generator=g)),
               ("model.layers.0.mlp.gate_up_proj.weight", torch.randn(3, 5, 7, generator=g)),
               ("model.layers.0.input_layernorm.weight", torch.randn(7, generator=g))]
    push(engine, weights, version=1, bucket_bytes=300)  # the trainer's sync: cast to the engine's dtype, 2 buckets
    assert [name for name, _ in engine.engine.calls].count("update_weights_from_tensor") == 2
    loaded = engine.engine.loaded[0]
    assert loaded.keys() == {name for name, _ in weights}
    for name, tensor in weights:
        assert loaded[name].dtype == torch.bfloat16 and torch.equal(loaded[name], tensor.to(torch.bfloat16)), name


def test_the_judges_refuse_what_sglang_refuses(launched):
    """The checks above fail on calls SGLang 0.5.23 would refuse: a renamed keyword, a method it lacks, a sampling
    key it does not know, a payload whose pickle names a class outside SafeUnpickler's list."""
    engine = launched(tp_size=1).engine
    with pytest.raises(TypeError):
        engine.update_weights_from_tensor(named_tensors=[], load_formats="flattened_bucket")
    with pytest.raises(AttributeError):
        engine.release_memory(tags=["weights"])
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert("0.5", upstream.declared_type(upstream.server_args_fields()["mem_fraction_static"]),
                        strict=True)
    with pytest.raises(Exception, match="unknown field `max_tokens`"):
        upstream.api_types().SamplingParams.from_json_value({"max_tokens": 3})
    payload = engine.ws.utils.MultiprocessingSerializer.serialize({"metadata": [SamplingParams()]}, output_str=True)
    with pytest.raises(RuntimeError, match="Blocked unsafe global"):
        engine.ws.deserialize_own_rank(None, [payload])
