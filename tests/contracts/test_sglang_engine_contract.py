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
- --lora-weight-sync adapter: the launch's LoRA keywords (`enable_lora`, `max_lora_rank`, `lora_target_modules`,
  its targets among SGLang's choices), `load_lora_adapter_from_tensors` / `unload_lora_adapter` / `generate`'s
  `lora_path` as declared, and the adapters as SGLang reads them: serialised per TP rank and deserialised by its
  own code, the config through its `LoRAConfig`, each layer's tensors stacked by its own `normalize_qkv_proj` /
  `normalize_gate_up_proj` into the fused buffers.

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

from megarl.mcore import lora
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
        self.server_args, self.calls, self.loaded, self.adapters = kwargs, [], {}, {}

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


    def _answer_load_lora_adapter_from_tensors(self, lora_name, tensors, config_dict, load_format=None):
        """What 0.5.23 does with adapters from tensors, each step SGLang's own code: `_serialize_tensors_per_rank`
        (no load_format: one `MultiprocessingSerializer` payload per TP rank), each rank's `deserialize_own_rank`,
        `LoRAConfig.from_dict`, and `LoRAAdapter.initialize_weights_from_tensors`' reading: tensors grouped by
        `get_layer_id`, then q/k/v and gate/up stacked (`normalize_qkv_proj`, `normalize_gate_up_proj`).
        Answers as `LoRAUpdateOutput` does: an object with `success` and `error_message`."""
        assert load_format is None, load_format
        read = upstream.lora()
        payloads = [self.ws.utils.MultiprocessingSerializer.serialize(tensors)
                    for _ in range(self.server_args["tp_size"])]
        for rank in range(self.server_args["tp_size"]):
            self.ws.tp_rank = rank
            data = self.ws.deserialize_own_rank(None, payloads)
        config = read.LoRAConfig.from_dict(config_dict, None, base_vocab_size=11)
        layers: dict[int, dict] = {}
        for name, tensor in data.items():
            layers.setdefault(read.get_layer_id(name), {})[name] = tensor.cpu()
        for weights in layers.values():
            read.normalize_qkv_proj(None, list(weights), weights)
            read.normalize_gate_up_proj(None, list(weights), weights)
        self.adapters[lora_name] = types.SimpleNamespace(tensors=data, config=config, layers=layers)
        return types.SimpleNamespace(success=True, error_message=None)


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


def _peft_adapters(targets, rank, seed, layers=2, hidden=6, q=6, kv=2, ffn=10) -> dict[str, torch.Tensor]:
    """Whole adapters as `megarl.mcore.lora.peft_tensors` names them, A [rank, in] and B [out, rank]."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, ffn), "up_proj": (hidden, ffn), "down_proj": (ffn, hidden)}
    out = {}
    for layer in range(layers):
        for t in targets:
            prefix = f"base_model.model.model.layers.{layer}.{lora.HF_MODULE[t]}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(rank, shapes[t][0], generator=g)
            out[f"{prefix}.lora_B.weight"] = torch.randn(shapes[t][1], rank, generator=g)
    return out


def test_lora_adapters_go_through_sglangs_own_calls_and_readers(launched):
    """--lora-weight-sync adapter, colocated: the launch keywords, the calls, and what SGLang makes of the adapters
    megarl sends (its PEFT names and its `adapter_config.json` dict, `lora.peft_config`)."""
    targets, rank = lora.TARGETS, 4
    engine = launched(tp_size=1, seed=0, lora_rank=rank, lora_targets=targets)
    fields, server_args = upstream.server_args_fields(), engine.engine.server_args
    for name, value in (("enable_lora", True), ("max_lora_rank", rank)):
        assert server_args[name] == value
        msgspec.convert(value, upstream.declared_type(fields[name]), strict=True)
    assert "lora_target_modules" in fields  # Optional[Union[set[str], List[str]]], with choices:
    assert server_args["lora_target_modules"] == list(targets)
    assert set(targets) <= set(upstream.lora().supported_targets)
    engine.release_memory()
    engine.update_weights([("model.norm.weight", torch.ones(6))], version=1)  # the base, once
    opts = lora.LoRAOptions(rank=rank, alpha=8.0, targets=targets)
    sent = {v: _peft_adapters(targets, rank, seed=v) for v in (1, 2)}
    for version, tensors in sent.items():
        engine.load_lora_adapter(tensors, lora.peft_config(opts, base=""), version)
    engine.resume_memory()
    engine.generate([[1, 4, 5], [1, 6]], SamplingParams(n=2, max_new_tokens=2))
    engine.score([[1, 4, 5, 6]], [2])

    calls = engine.engine.calls
    assert [a["lora_name"] for n, a in calls if n == "load_lora_adapter_from_tensors"] == ["megarl-v1", "megarl-v2"]
    assert [a for n, a in calls if n == "unload_lora_adapter"] == [{"lora_name": "megarl-v1"}]
    generates = [a for n, a in calls if n == "generate"]
    assert len(generates) == 2 and all(a["lora_path"] == ["megarl-v2"] * len(a["input_ids"]) for a in generates)
    read = engine.engine.adapters["megarl-v2"]
    assert read.tensors.keys() == sent[2].keys()
    assert all(torch.equal(read.tensors[n], t) for n, t in sent[2].items())
    assert (read.config.r, read.config.target_modules) == (rank, list(targets))
    assert read.config.lora_alpha / read.config.r == opts.scale  # SGLang's scaling, the actor's
    for layer, weights in read.layers.items():  # every part found its place in SGLang's fused buffers
        assert sorted(weights) == sorted(f"base_model.model.model.layers.{layer}.{m}.lora_{w}.weight"
                                         for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                                   "mlp.down_proj") for w in "AB")
        qkv_b = weights[f"base_model.model.model.layers.{layer}.self_attn.qkv_proj.lora_B.weight"]
        parts = [sent[2][f"base_model.model.model.layers.{layer}.self_attn.{p}_proj.lora_B.weight"] for p in "qkv"]
        assert torch.equal(qkv_b, torch.cat(parts))


def test_sglang_cannot_stack_a_q_adapter_without_v():
    """Why --lora-weight-sync adapter refuses q_proj without v_proj (megarl.config): SGLang's own stacking of
    q, k, v fails on it; with v_proj (and no k_proj) it fills k with zeros."""
    read = upstream.lora()
    alone = _peft_adapters(("q_proj",), 4, seed=0, layers=1)
    with pytest.raises(KeyError, match="v_proj"):
        read.normalize_qkv_proj(None, list(alone), alone)
    pair = _peft_adapters(("q_proj", "v_proj"), 4, seed=0, layers=1)
    read.normalize_qkv_proj(None, list(pair), pair)
    assert [tuple(t.shape) for t in pair.values()] == [(12, 6), (10, 4)]
