"""One engine of tools/bench/rollout.py, in a process of its own: started by the bench with the python of the
engine's environment (megarl's venv for `builtin` and `transformers`, SGLang's and vLLM's own for theirs), megarl's
checkout on PYTHONPATH.

    python tools/bench/rollout_worker.py ENGINE JOB.json OUT.json

JOB holds the model directory, the prompts' token ids, `n`, `max_new_tokens`, `max_len` (the longest row and a
margin: the engines' context length), the seed and the torch threads.
The worker times the engine's start-up (its package's import and construction; torch is imported before), runs
one untimed warm-up call of the whole batch, then one timed call per mode (temperature 1 sampling, then greedy)
and writes, per mode, the wall seconds and the tokens of every completion. No stop token: every row runs to
`max_new_tokens`, so each engine does the same work.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

# generate(temperature, seed) -> the token count of each completion, prompt by prompt
Generate = Callable[[float, int], list[int]]


def start_builtin(job: dict) -> tuple[Generate, Callable[[], None]]:
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.builtin import BuiltinEngine

    engine = BuiltinEngine.from_pretrained(job["model"], dtype=torch.float32)

    def generate(temperature: float, seed: int) -> list[int]:
        params = SamplingParams(n=job["n"], temperature=temperature, max_new_tokens=job["max_new_tokens"], seed=seed)
        return [len(c.token_ids) for group in engine.generate(job["prompts"], params) for c in group]

    return generate, engine.shutdown


def start_transformers(job: dict) -> tuple[Generate, Callable[[], None]]:
    """`generate` of the HF model, left-padded batch, no EOS (the checkpoint's is cleared, as the engines stop
    only on the stop ids megarl gives them, here none). It returns no log-probs; the engines do."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    model.generation_config.pad_token_id = pad
    prompts, n, new = job["prompts"], job["n"], job["max_new_tokens"]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    # Each prompt's n rows side by side, as the engines' groups (greedy `generate` refuses num_return_sequences)
    ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)

    def generate(temperature: float, seed: int) -> list[int]:
        torch.manual_seed(seed)
        sampling = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) if temperature > 0 else \
            dict(do_sample=False)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, **sampling)
        return [out.shape[1] - width] * out.shape[0]  # no EOS, so no row ends before the others

    return generate, lambda: None


def start_sglang(job: dict) -> tuple[Generate, Callable[[], None]]:
    """megarl's adapter over SGLang's CPU engine, not colocated. `ignore_eos` is added to each request, as
    tests/sglang_cpu does where it needs full-length rows: SGLang stops at the checkpoint's EOS on its own, on top
    of the adapter's stop ids. Seeds are not sent: SGLang ignores them on CPU (the adapter says so)."""
    from unittest import mock

    from megarl.rollout import sglang_engine
    from megarl.rollout.base import SamplingParams

    rows = len(job["prompts"]) * job["n"]
    tokens = rows * (max(len(p) for p in job["prompts"]) + job["max_new_tokens"] + 1)
    engine = sglang_engine.SGLangEngine.launch(job["model"], device="cpu", colocated=False, dtype="float32",
                                               seed=None, mem_fraction=0.05, max_running_requests=rows,
                                               max_total_tokens=max(16384, tokens), context_length=job["max_len"])
    full_length = mock.patch.object(sglang_engine, "sampling_dict",
                                    lambda *a, _f=sglang_engine.sampling_dict: {**_f(*a), "ignore_eos": True})

    def generate(temperature: float, seed: int) -> list[int]:
        params = SamplingParams(n=job["n"], temperature=temperature, max_new_tokens=job["max_new_tokens"])
        with full_length:
            return [len(c.token_ids) for group in engine.generate(job["prompts"], params) for c in group]

    return generate, engine.shutdown


def start_vllm(job: dict) -> tuple[Generate, Callable[[], None]]:
    """megarl's adapter over vLLM's offline engine (CPU build), not colocated; it ends rows only on megarl's stop
    ids (`ignore_eos`), so nothing is added here."""
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine.launch(job["model"], dtype="float32", seed=job["seed"], colocated=False,
                               max_model_len=job["max_len"],
                               max_num_seqs=len(job["prompts"]) * job["n"])

    def generate(temperature: float, seed: int) -> list[int]:
        params = SamplingParams(n=job["n"], temperature=temperature, max_new_tokens=job["max_new_tokens"], seed=seed)
        return [len(c.token_ids) for group in engine.generate(job["prompts"], params) for c in group]

    return generate, engine.shutdown


ENGINES = {"builtin": start_builtin, "transformers": start_transformers, "sglang": start_sglang,
           "vllm": start_vllm}
MODES = {"sampled": 1.0, "greedy": 0.0}


def main(engine: str, job_path: str, out_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(job["threads"])
    start = time.perf_counter()
    generate, shutdown = ENGINES[engine](job)
    result = {"startup_s": time.perf_counter() - start, "modes": {}}
    try:
        generate(1.0, job["seed"] + 1000)  # warm-up, untimed: one-time costs (kernels, allocator, caches)
        for mode, temperature in MODES.items():
            start = time.perf_counter()
            counts = generate(temperature, job["seed"])
            result["modes"][mode] = {"seconds": time.perf_counter() - start, "tokens": counts}
    finally:
        shutdown()
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
