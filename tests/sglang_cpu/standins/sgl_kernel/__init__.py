"""A placeholder for `sgl_kernel` (PyPI `sglang-kernel`), whose only build is CUDA-only (373 MB, torch 2.14.1).

SGLang 0.5.23's CPU path (`SGLANG_USE_CPU_ENGINE=1`) imports `*_cpu` kernels from `sgl_kernel` at module level
(`kernels/ops/kvcache/cache_move.py`, `mem_cache/allocation.py`: copy_all_layer_kv_cache_cpu,
assign_req_to_token_pool_cpu and six speculative-decoding ops) and never calls them for a Qwen2 model with
`torch_native` attention. Every attribute of this module is a function that records its call (sitecustomize's
`record_call`, read by the tests after each test) and raises; no `torch.ops.sgl_kernel` operator is registered,
so SGLang's AMX path (`convert_weight_packed`) stays off and its layers run their native torch code.
"""


def __getattr__(name: str):
    if name.startswith("__"):  # the import machinery's and hasattr's questions: nothing is there
        raise AttributeError(name)

    def placeholder(*args, **kwargs):
        from sitecustomize import record_call

        record_call("sgl_kernel", name)
        raise RuntimeError(f"sgl_kernel.{name} is a placeholder (tests/sglang_cpu/standins): SGLang called a "
                           "kernel megarl's CPU tests assumed it never calls")

    placeholder.__name__ = placeholder.__qualname__ = name
    return placeholder
