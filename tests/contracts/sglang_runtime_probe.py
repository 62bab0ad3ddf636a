"""Run by `sglang_runtime.probe` in a subprocess: SGLang 0.5.23 itself, imported from its unpacked wheel, against
megarl's adapter. Prints one JSON object: {check: "ok" | the error}. Not a test module (no `test_` prefix).

argv: SITE DEPS STUB CHECK... The subprocess keeps the test process clean: SGLang's import patches transformers and
torch, and a `triton` stand-in is on the path here only.

The stand-in: `sglang.srt.utils.common` does `import triton` at module level (for `@triton.jit` kernels and
`triton.next_power_of_2`); triton is a 286 MB wheel and builds nothing on CPU. The stub is an empty module: no
check here runs a kernel, and torch is asked whether triton exists before the stub is visible, so torch keeps
its own (correct) answer, no. A check that needed triton's behaviour would fail on the empty module, not pass.
"""

from __future__ import annotations

import json
import sys
import traceback

SITE, DEPS, STUB, *CHECKS = sys.argv[1:]

import torch  # noqa: E402
import torch.utils._triton as torch_triton  # noqa: E402

torch_triton.has_triton_package()  # cached False: torch must not take the stub below for a triton install
sys.path[:0] = [STUB, SITE, DEPS]


def server_args(model_dir: str, **extra) -> None:
    """`SGLangEngine.launch` as `--rollout-backend sglang` calls it, with `sglang.Engine` replaced by what 0.5.23's
    `Engine.__init__` does with its keywords before it starts any process: `ServerArgs(**kwargs)` (log_level
    defaulted to "error"), whose `__post_init__` validates and completes them."""
    import sglang
    from sglang.srt.server_args import ServerArgs

    from megarl.rollout.sglang_engine import SGLangEngine

    built = []

    class Engine:
        def __init__(self, **kwargs):
            kwargs.setdefault("log_level", "error")
            built.append(ServerArgs(**kwargs))

    sglang.Engine = Engine
    for kw in [dict(tp_size=1, mem_fraction=0.45, dtype="bfloat16", seed=3, tokenizer=True),
               dict(tp_size=1, base_gpu_id=0, dtype="float16", seed=None, colocated=False)]:
        SGLangEngine.launch(model_dir, **kw, **extra)
    first, second = built
    assert (first.mem_fraction_static, first.random_seed, first.enable_memory_saver, first.skip_tokenizer_init,
            first.enable_deterministic_inference) == (0.45, 3, True, False, True), first
    assert (second.dtype, second.enable_memory_saver, second.skip_tokenizer_init,
            second.enable_deterministic_inference) == ("float16", False, True, False), second


def bucket_round_trip() -> None:
    """megarl's `serialize_bucket` with SGLang's own `MultiprocessingSerializer` and `FlattenedTensorMetadata`,
    read back as SGLang's TP worker does (`MultiprocessingSerializer.deserialize`: its `SafeUnpickler` refuses any
    global outside its list) and rebuilt by `FlattenedTensorBucket.reconstruct_tensors`: the same tensors."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from megarl.rollout.sglang_ipc import serialize_bucket
    from megarl.rollout.weight_sync import pack_buckets

    g = torch.Generator().manual_seed(0)
    weights = [("model.embed_tokens.weight", torch.randn(11, 6, generator=g).to(torch.bfloat16)),
               ("model.layers.0.mlp.gate_up_proj.weight", torch.randn(3, 5, 7, generator=g).to(torch.bfloat16)),
               ("model.layers.0.input_layernorm.weight", torch.randn(7, generator=g)),
               ("model.layers.0.self_attn.q_proj.bias", torch.arange(5, dtype=torch.int64))]
    got = []
    for bucket in pack_buckets(weights, 1 << 20):
        data = MultiprocessingSerializer.deserialize(serialize_bucket(bucket))
        got += FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"],
                                     metadata=data["metadata"]).reconstruct_tensors()
    got = dict(got)  # one bucket per dtype: the order is by bucket
    assert sorted(got) == sorted(n for n, _ in weights), sorted(got)
    for name, want in weights:
        have = got[name]
        assert have.dtype == want.dtype and have.shape == want.shape and torch.equal(have, want), name


def misspelt_server_arg_refused(model_dir: str) -> None:
    """The judge: a keyword 0.5.23's ServerArgs lacks (passed through `launch(**server_args)`) raises."""
    try:
        server_args(model_dir, mem_fraction_statc=0.5)
    except TypeError as e:
        assert "mem_fraction_statc" in str(e), e
        return
    raise AssertionError("ServerArgs accepted a misspelt keyword")


def foreign_metadata_refused() -> None:
    """The judge: bucket metadata of a class outside SafeUnpickler's list (megarl's own, say) is refused."""
    import dataclasses

    import sglang.srt.weight_sync.tensor_bucket as tensor_bucket

    @dataclasses.dataclass
    class FlattenedTensorMetadata:  # same fields, megarl's module: what a copy of SGLang's class would pickle as
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    FlattenedTensorMetadata.__module__ = "megarl.rollout.sglang_ipc"  # pickle names it so
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    original, tensor_bucket.FlattenedTensorMetadata = tensor_bucket.FlattenedTensorMetadata, FlattenedTensorMetadata
    import megarl.rollout.sglang_ipc as ipc

    ipc.FlattenedTensorMetadata = FlattenedTensorMetadata
    try:
        bucket_round_trip()
    except RuntimeError as e:
        assert "Blocked unsafe global" in str(e), e
        return
    finally:
        tensor_bucket.FlattenedTensorMetadata = original
    raise AssertionError("SafeUnpickler loaded metadata of a class outside its list")


def shifted_slot_detected() -> None:
    """The judge: a bucket whose metadata points one element off (a wrong `start_idx`) does not round-trip."""
    import megarl.rollout.weight_sync as weight_sync

    pack = weight_sync.pack_buckets

    def shifted(*args, **kwargs):
        for bucket in pack(*args, **kwargs):
            s = bucket.slots[0]
            bucket.slots[0] = type(s)(s.name, s.shape, s.dtype, s.start + 1, s.end + 1)
            yield bucket

    weight_sync.pack_buckets = shifted
    try:
        bucket_round_trip()
    except (AssertionError, RuntimeError):  # wrong values, or a view past the end of the flat tensor
        return
    finally:
        weight_sync.pack_buckets = pack
    raise AssertionError("a shifted slot round-tripped")


if __name__ == "__main__":
    out = {}
    for check in CHECKS:
        name, _, arg = check.partition("=")
        try:
            globals()[name](*([arg] if arg else []))
            out[name] = "ok"
        except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
            out[name] = traceback.format_exc(limit=-6)
    print("\n@@" + json.dumps(out))
