"""One pass over megarl's GPU path on a single GPU, with figures. `tools/gpu_check.sh` (`make gpu-check`) runs its
`sglang` part as its part (d); the others run on request: `python tools/gpu_check.py --parts tiny,0.5b,te,dynamic`.

Needs only torch, megatron-core (and the small packages it imports at run time) and this repository: models are
random and built here (no hub, no transformers, no tokenizer), prompts are random token ids, and the reward is a
synthetic one the policy can learn (the share of even token ids in a response). Parts, each timed and each
reported as ran / skipped (with why) / failed (with the error):

  tiny      megatron-core on NCCL, fp32, the built-in engine on the GPU: a few GRPO steps, every sync verified
  0.5b      a Qwen2.5-0.5B-shaped model in bf16 with fp32 main params, the colocation cycle with optimizer and
            weight offload, every sync verified
  te        the 0.5b part with the Transformer Engine layer spec (only when `transformer_engine` imports)
  sglang    the SGLang colocated cycle: release, train, resume weights, push buckets over CUDA IPC, resume KV
            cache, flush, verify (only when `sglang` imports and a checkpoint can be written with safetensors)
  sglang-lora  --lora-weight-sync merged against adapter on SGLang, timed: a 0.5B-shaped LoRA actor (rank 16, every
            projection), a fresh engine per mode (adapter: launched with LoRA), an initial sync and two GRPO steps
            each, every sync verified (only when `sglang` imports; not in the default parts, since two cold SGLang
            starts need more than their budget: `python tools/gpu_check.py --parts sglang-lora
            --budget-seconds 420`)
  dynamic   Megatron's dynamic inference engine as the rollout backend (`--rollout-backend megatron`, only when it
            can run: CUDA and flash-attn): greedy outputs against the built-in engine on the same bf16 weights, then
            a few GRPO steps generating with the actor's own model (each sync only stamps a version)

`--cpu-smoke` runs the same code on CPU (gloo) with small shapes, to check this script itself before a GPU run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

QWEN25_05B = dict(model_type="qwen2", num_hidden_layers=24, hidden_size=896, num_attention_heads=14,
                  num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, max_position_embeddings=4096,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu")
TINY = dict(QWEN25_05B, num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=256, tie_word_embeddings=False)
SMALL = dict(TINY, num_hidden_layers=4, hidden_size=128, intermediate_size=256, vocab_size=1024)


def log(msg: str) -> None:
    print(msg, flush=True)


class Budget:
    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def environment() -> dict:
    env = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    for name, module in (("megatron_core", "megatron.core"), ("einops", "einops"),
                         ("transformer_engine", "transformer_engine.pytorch"), ("sglang", "sglang"),
                         ("flash_attn", "flash_attn"), ("safetensors", "safetensors"),
                         ("transformers", "transformers")):
        try:
            mod = __import__(module, fromlist=["_"])
            top = sys.modules[module.split(".")[0]]
            env[name] = getattr(mod, "__version__", None) or getattr(top, "__version__", "yes")
        except Exception as e:  # noqa: BLE001 - a missing package or a CUDA kernel that fails to load in any way
            env[name] = f"unavailable ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    return env


def _config(args, **flags):
    from megarl.arguments import components
    from megarl.config import build_config

    return build_config({"n_samples_per_prompt": args.samples, "max_response_len": args.response_len,
                         "rollout_batch_size": args.prompts, "micro_batch_size": args.micro_batch, "lr": 1e-5,
                         "weight_decay": 0.01, "verify_weight_sync": True, "sync_bucket_mb": args.bucket_mb, **flags},
                        components())


def _prompts(vocab: int, count: int, step: int):
    from megarl.data import PromptRecord

    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for i in range(count):
        ids = torch.randint(2, vocab, (int(torch.randint(8, 24, (1,), generator=g)),), generator=g).tolist()
        out.append(PromptRecord(index=i, prompt="", prompt_ids=ids, label=None, verifier=""))
    return out


SGLANG_PART_NEEDS_S = 150  # a cold start of the 0.5B engine (CUDA graphs captured) and two GRPO steps
_PEAK = [0]  # the running peak of GPU memory: weight_sync.push resets CUDA's own peak counter for its window


def _peak() -> int:
    if torch.cuda.is_available():
        _PEAK[0] = max(_PEAK[0], torch.cuda.max_memory_allocated())
    return _PEAK[0]


def _sync(sync, version) -> dict:
    _peak()
    t = time.perf_counter()
    m = sync(version=version)
    m["sync_total_seconds"] = time.perf_counter() - t  # export (gather + convert) + push + probe check
    return m


class _EvenTokens:
    """A synthetic verifiable reward (a `RewardFn`): the share of even token ids in the response."""

    restarts = 0

    def __call__(self, samples, records):
        from megarl.verifiers import VerifyResult

        return [VerifyResult(sum(1 for x in s.response_ids if x % 2 == 0) / max(len(s.response_ids), 1), "correct")
                for s in samples]


class _NoText:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


def grpo_part(args, hf_config: dict, *, bf16: bool, offload: bool, use_te: bool | None, engine=None,
              steps_count: int | None = None, engine_factory=None, **flags) -> dict:
    """A few GRPO steps through megarl's own step functions and the colocation cycle; returns the figures."""
    from megarl.mcore.actor import MegatronPolicy
    from megarl.mcore.parallel import parallel_info
    from megarl.model_shape import ModelShape
    from megarl.rollout import single_turn
    from megarl.rollout.builtin import BuiltinEngine
    from megarl.stages.algorithm import Algorithm, LogProbs, pack
    from megarl.stages.colocation import WeightSync, enter_rollout, enter_training
    from megarl.stages.setup import optim_config
    from megarl.stages.update import update as update_actor
    from megarl.samples import RolloutBatch

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        _PEAK[0] = 0
    from megarl.mcore.lora import LoRAOptions

    shape = ModelShape.from_hf_config(hf_config)
    cfg = _config(args, bf16=bf16, offload_optimizer=offload, offload_params=offload,
                  verify_sync_tolerance=0.05 if bf16 else 1e-3, **flags)
    t0 = time.perf_counter()
    lora = LoRAOptions.from_config(cfg.model) if cfg.model.lora_rank else None
    actor = MegatronPolicy(shape, tp=1, pp=1, trainable=True, bf16=bf16, optim=optim_config(cfg.training),
                           use_transformer_engine=use_te, **({"lora": lora} if lora else {}))
    if engine_factory is not None:
        engine = engine_factory(actor)
    if engine is None:
        engine = BuiltinEngine(hf_config, device="cuda" if cuda else "cpu",
                               dtype=torch.bfloat16 if bf16 and cuda else torch.float32)
    build_s = time.perf_counter() - t0
    out = {"parameters": sum(p.numel() for p in actor.model.parameters()), "build_seconds": build_s, "steps": []}
    info = parallel_info()
    sync = WeightSync(actor, engine, cfg.rollout, info, training=cfg.training)  # colocated: frees grads before a push
    algorithm = Algorithm(cfg, info, None, None)
    out["initial_sync"] = _sync(sync, 0)
    from megarl.rollout.base import SamplingParams

    for step in range(steps_count or args.steps):
        row = {}
        t_step = time.perf_counter()
        mem0 = torch.cuda.memory_allocated() if cuda else 0
        probe = enter_rollout(actor, engine, cfg.training, sync)  # the engine scores the last sync's probe
        row["offload_freed_mib"] = ((mem0 - torch.cuda.memory_allocated()) / 2**20) if cuda else 0.0
        prompts = _prompts(shape.vocab_size, args.prompts, step)
        sp = SamplingParams(n=args.samples, temperature=1.0, max_new_tokens=args.response_len, seed=step)
        t = time.perf_counter()
        rollout = RolloutBatch(single_turn(engine, prompts, sp, _EvenTokens(), _NoText()), sp.n)
        if cuda:
            torch.cuda.synchronize()
        gen_s = time.perf_counter() - t
        tokens = sum(len(s.response_ids) for s in rollout.samples)
        enter_training(actor, engine)
        batch, _ = algorithm.train_batch(rollout, pack(rollout.samples, pad_id=0), LogProbs(None, None))
        t = time.perf_counter()
        update = update_actor(actor, batch, cfg.algorithm, cfg.training, cfg.rollout)
        if cuda:
            torch.cuda.synchronize()
        train_s = time.perf_counter() - t
        sync_row = _sync(sync, step + 1)
        row.update(step=step + 1, reward=float(batch.rewards.mean()), rollout_tokens=tokens,
                   rollout_seconds=gen_s, rollout_tokens_per_s=tokens / max(gen_s, 1e-9), train_seconds=train_s,
                   grad_norm=update.get("grad_norm"), step_seconds=time.perf_counter() - t_step, **sync_row, **probe)
        out["steps"].append(row)
        log(f"    step {row['step']}: {row['step_seconds']:.2f} s | rollout {tokens} tok in {gen_s:.2f} s "
            f"({row['rollout_tokens_per_s']:.0f} tok/s) | train {train_s:.2f} s | sync {row['sync_seconds']:.3f} s "
            f"push, {row['sync_total_seconds']:.3f} s total, {row['sync_bytes'] / 2**20:.1f} MiB in "
            f"{row['sync_buckets']} buckets | probe |dlogp| {row['sync_probe_absdiff_mean']:.2e} | "
            f"reward {row['reward']:.3f}")
    out["final_probe"] = enter_rollout(actor, engine, cfg.training, sync)  # the last sync's probe
    out["peak_gpu_mib"] = _peak() / 2**20 if cuda else None
    from megarl.rollout.weight_sync import model_parameter_count

    expected = model_parameter_count(shape) * (engine.dtype.itemsize if engine.dtype is not None else 4)
    if engine.shares_actor_weights:
        expected = 0  # the engine generates with the actor's own parameters: a sync moves nothing
    out["sync_bytes_equal_parameter_bytes"] = all(r["sync_bytes"] == expected for r in out["steps"])
    if cfg.rollout.lora_weight_sync == "adapter":  # the steps move the adapters only: no whole-model count
        out["sync_bytes_equal_parameter_bytes"] = None
    out["parameter_bytes"] = expected
    out["engine"] = engine
    del actor
    gc.collect()
    return out


def summarize(rows: list[dict]) -> dict:
    last = rows[1:] or rows  # the first step pays for warm-up
    mean = lambda k: sum(r[k] for r in last) / len(last)
    return {"rollout_tokens_per_s": mean("rollout_tokens_per_s"), "sync_seconds": mean("sync_seconds"),
            "sync_total_seconds": mean("sync_total_seconds"), "step_seconds": mean("step_seconds"),
            "train_seconds": mean("train_seconds")}


def sglang_part(args, budget: Budget, workdir: Path) -> dict:
    from megarl.rollout.sglang_engine import SGLangEngine, sglang_available

    ok, why = sglang_available()
    if not ok:
        return {"status": "skipped", "why": why}
    if not torch.cuda.is_available():
        return {"status": "skipped", "why": "SGLang runs models on CUDA only"}
    if budget.left() < SGLANG_PART_NEEDS_S:
        return {"status": "skipped", "why": f"only {budget.left():.0f} s left of the time budget"}
    try:
        from safetensors.torch import save_file
    except ImportError:
        return {"status": "skipped", "why": "safetensors is not importable: SGLang needs a checkpoint on disk"}
    # SGLang loads a checkpoint from disk; write a random one of the 0.5B shape (the sync overwrites it anyway).
    ckpt = workdir / "qwen2_05b_random"
    write_random_checkpoint(ckpt, QWEN25_05B, save_file)
    t = time.perf_counter()
    engine = SGLangEngine.launch(str(ckpt), tp_size=1, base_gpu_id=torch.cuda.current_device(),
                                 mem_fraction=args.sglang_mem_fraction, dtype="bfloat16", seed=0)
    launch_s = time.perf_counter() - t
    engine.release_memory()  # as in training (`setup.launch_engine_first`): the actor is built in what it frees
    try:
        out = grpo_part(args, QWEN25_05B, bf16=True, offload=True, use_te=None, engine=engine, steps_count=2)
        out["launch_seconds"] = launch_s
        return out
    finally:
        engine.shutdown()


LORA_RANK = 16


def sglang_lora_part(args, budget: Budget, workdir: Path) -> dict:
    """`--lora-weight-sync` merged against adapter on SGLang: the same LoRA actor and steps, a fresh engine per mode.
    Reports per mode the mean sync seconds (the export and push; adapter: the adapters alone after the first sync),
    rollout tokens/s (SGLang's LoRA kernels run in every adapter-mode forward) and step seconds."""
    from megarl.mcore.lora import TARGETS
    from megarl.rollout.sglang_engine import SGLangEngine, sglang_available

    ok, why = sglang_available()
    if not ok:
        return {"status": "skipped", "why": why}
    if not torch.cuda.is_available():
        return {"status": "skipped", "why": "SGLang runs models on CUDA only"}
    try:
        from safetensors.torch import save_file
    except ImportError:
        return {"status": "skipped", "why": "safetensors is not importable: SGLang needs a checkpoint on disk"}
    ckpt = write_random_checkpoint(workdir / "qwen2_05b_random_lora", QWEN25_05B, save_file)
    out: dict = {"comparison": {}}
    for mode in ("merged", "adapter"):
        if budget.left() < SGLANG_PART_NEEDS_S:
            out["comparison"][mode] = {"skipped": f"only {budget.left():.0f} s left of the time budget"}
            continue
        lora = {"lora_rank": LORA_RANK, "lora_targets": TARGETS} if mode == "adapter" else {}
        engine = SGLangEngine.launch(str(ckpt), tp_size=1, base_gpu_id=torch.cuda.current_device(),
                                     mem_fraction=args.sglang_mem_fraction, dtype="bfloat16", seed=0, **lora)
        engine.release_memory()
        try:
            res = grpo_part(args, QWEN25_05B, bf16=True, offload=True, use_te=None, engine=engine, steps_count=2,
                            rollout_backend="sglang", lora_rank=LORA_RANK, lora_weight_sync=mode)
        finally:
            engine.shutdown()
        out["comparison"][mode] = {**summarize(res["steps"]), "initial_sync_seconds":
                                   res["initial_sync"]["sync_seconds"], "sync_bytes": res["steps"][-1]["sync_bytes"],
                                   "probe_absdiff_max": max(r["sync_probe_absdiff_max"] for r in res["steps"])}
        log(f"    {mode}: " + ", ".join(f"{k} {v:.4g}" for k, v in out["comparison"][mode].items()))
    if not any("skipped" not in r for r in out["comparison"].values()):
        return {"status": "skipped", "why": out["comparison"]["merged"]["skipped"]}
    return out


def write_random_checkpoint(ckpt: Path, hf_config: dict, save_file) -> Path:
    """A random bf16 checkpoint of `hf_config`'s shape (config.json and one safetensors file) for SGLang to load:
    the first sync overwrites its weights anyway. `save_file`: safetensors' (imported by the caller, who reports
    it missing)."""
    from megarl.rollout.builtin import BuiltinEngine

    ckpt.mkdir(parents=True, exist_ok=True)
    cfg = dict(hf_config, architectures=["Qwen2ForCausalLM"], torch_dtype="bfloat16")
    (ckpt / "config.json").write_text(json.dumps(cfg))
    shell = BuiltinEngine(hf_config, device="cpu", dtype=torch.bfloat16)
    skip = {"lm_head.weight"} if hf_config.get("tie_word_embeddings") else set()
    tensors = {n: torch.randn_like(t) * 0.02 for n, t in shell._hf_views().items() if n not in skip}
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(ckpt / "model.safetensors"))
    return ckpt


def dynamic_part(args) -> dict:
    """Megatron's dynamic engine: greedy parity with the built-in engine on the same bf16 weights, then GRPO steps."""
    from megarl.mcore.actor import MegatronPolicy
    from megarl.mcore.inference_engine import MegatronEngine, megatron_engine_available
    from megarl.mcore.parallel import parallel_info
    from megarl.model_shape import ModelShape
    from megarl.rollout.base import Completion, SamplingParams
    from megarl.rollout.builtin import BuiltinEngine
    from megarl.stages.colocation import WeightSync
    from megarl.stages.setup import optim_config

    ok, why = megatron_engine_available()
    if not ok:
        return {"status": "skipped", "why": why}
    shape = ModelShape.from_hf_config(TINY)
    cfg = _config(args, bf16=True)
    actor = MegatronPolicy(shape, tp=1, pp=1, trainable=True, bf16=True, optim=optim_config(cfg.training),
                           use_transformer_engine=False)
    builtin = BuiltinEngine(TINY, device="cuda", dtype=torch.bfloat16)
    WeightSync(actor, builtin, cfg.rollout, parallel_info())(version=0)
    engine = MegatronEngine.for_actor(actor, max_sequence_length=256, completion=Completion, buffer_size_gb=1.0,
                                      max_requests=64)
    prompts = [p.prompt_ids for p in _prompts(shape.vocab_size, args.prompts, 0)]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=args.response_len)
    t = time.perf_counter()
    ours = [g[0] for g in engine.generate(prompts, greedy)]
    gen_s = time.perf_counter() - t
    ref = [g[0] for g in builtin.generate(prompts, greedy)]
    same = sum(a.token_ids == b.token_ids for a, b in zip(ours, ref))
    diffs = []  # log-probs where both engines chose the same tokens so far
    for a, b in zip(ours, ref):
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                break
            diffs.append(abs(a.logprobs[i] - b.logprobs[i]))
    parity = {"greedy_identical_frac": same / len(ref), "logprob_absdiff_mean": sum(diffs) / max(len(diffs), 1),
              "greedy_tokens_per_s": sum(len(c.token_ids) for c in ours) / max(gen_s, 1e-9)}
    log(f"    greedy vs built-in: {same}/{len(ref)} identical, |dlogp| {parity['logprob_absdiff_mean']:.2e} on "
        f"shared prefixes, {parity['greedy_tokens_per_s']:.0f} tok/s")
    engine.shutdown()
    del actor, builtin, engine
    gc.collect()
    out = grpo_part(args, TINY, bf16=True, offload=False, use_te=False, rollout_backend="megatron",
                    engine_factory=lambda a: MegatronEngine.for_actor(a, max_sequence_length=256, completion=Completion,
                                                                      buffer_size_gb=1.0, max_requests=64))
    out["parity"] = parity
    return out


def verdict(name: str, status: str, detail: str) -> None:
    """The stage's one-line verdict, which tools/gpu_check.sh reads (part d): `PASS stage NAME: figures`,
    `FAIL stage NAME: reason` or `SKIP stage NAME: reason`."""
    word = {"ran": "PASS", "failed": "FAIL", "skipped": "SKIP"}.get(status, status.upper())
    log(f"{word} stage {name}: {' '.join(detail.split())}")


def part_verdict(name: str, out: dict) -> tuple[str, str]:
    """(status, detail) of a part's results: a part that ran fails when a sync moved other than the parameter
    bytes (a probe mismatch has already raised)."""
    if out["status"] != "ran":
        return out["status"], str(out.get("why") or out.get("error"))
    if out.get("sync_bytes_equal_parameter_bytes") is False:
        return "failed", f"a sync moved other than the {out['parameter_bytes']} parameter bytes"
    probes = [r["sync_probe_absdiff_max"] for r in out.get("steps", ()) if "sync_probe_absdiff_max" in r]
    figures = f"{out['seconds']:.0f} s"
    if probes:
        figures += f", {len(probes)} verified syncs, probe |dlogp| max {max(probes):.2e}"
    if out.get("summary"):
        figures += (f", rollout {out['summary']['rollout_tokens_per_s']:.0f} tok/s, sync "
                     f"{out['summary']['sync_seconds']:.3f} s")
    if out.get("peak_gpu_mib"):
        figures += f", peak GPU {out['peak_gpu_mib']:.0f} MiB"
    for mode, r in out.get("comparison", {}).items():
        figures += (f"; {mode}: skipped ({r['skipped']})" if "skipped" in r else
                    f"; {mode}: sync {r['sync_seconds']:.3f} s, rollout {r['rollout_tokens_per_s']:.0f} tok/s, "
                    f"step {r['step_seconds']:.2f} s")
    return "ran", figures


def skip(results: dict, name: str, title: str, why: str) -> None:
    results[name] = {"status": "skipped", "why": why, "title": title}
    log(f"\n== {name}: {title}\n   skipped: {why}")
    verdict(name, "skipped", why)


def run_part(name: str, title: str, fn, results: dict, budget: Budget, need_s: float) -> None:
    log(f"\n== {name}: {title}")
    if budget.left() < need_s:
        results[name] = {"status": "skipped", "why": f"only {budget.left():.0f} s left of the time budget"}
        log(f"   skipped: {results[name]['why']}")
        verdict(name, "skipped", results[name]["why"])
        return
    t = time.perf_counter()
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - report and go on: one broken part must not hide the others' figures
        out = {"status": "failed", "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        log(out["trace"])
    out.pop("engine", None)
    out.setdefault("status", "ran")
    out["title"] = title
    out["seconds"] = time.perf_counter() - t
    if out["status"] == "ran" and out.get("steps"):
        out["summary"] = summarize(out["steps"])
    results[name] = out
    log(f"   {out['status']}" + (f": {out.get('why') or out.get('error')}" if out["status"] != "ran" else
                                 f" in {out['seconds']:.1f} s"))
    verdict(name, *part_verdict(name, out))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="run on CPU with small shapes (checks this script)")
    p.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_check", help="where results.json goes")
    p.add_argument("--budget-seconds", type=float, default=420.0, help="parts that would not fit are skipped")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--response-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--sglang-mem-fraction", type=float, default=0.3)
    p.add_argument("--parts", default="tiny,0.5b,te,sglang,dynamic", help="comma-separated subset of the parts")
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    unknown = parts - {"tiny", "0.5b", "te", "sglang", "sglang-lora", "dynamic"}
    if unknown:
        p.error(f"--parts: unknown {sorted(unknown)}; choose from tiny, 0.5b, te, sglang, sglang-lora, dynamic")
    budget = Budget(args.budget_seconds)
    if args.cpu_smoke:
        args.steps, args.prompts, args.samples, args.response_len, args.micro_batch = 2, 2, 4, 8, 8
        args.bucket_mb = 1
    elif not torch.cuda.is_available():
        log("gpu_check: torch sees no CUDA GPU; use --cpu-smoke to check the script on CPU")
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"environment": environment(), "mode": "cpu-smoke" if args.cpu_smoke else "gpu"}
    log("gpu_check: " + json.dumps(results["environment"]))
    missing = [n for n in ("megatron_core", "einops") if str(results["environment"][n]).startswith("unavailable")]
    if missing:
        log(f"gpu_check: {', '.join(missing)} required (`make gpu-wheels` fetches them, tools/gpu_check.sh installs)")
        return 2

    from megarl.mcore import parallel

    if "MASTER_PORT" not in os.environ:  # a single process: any free port
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    info = parallel.init_distributed(1, 1, timeout_s=300, seed=0)
    log(f"gpu_check: torch.distributed backend {parallel.default_backend()}, world size {info.world_size}")
    te_ok = parallel.transformer_engine_available()
    big = SMALL if args.cpu_smoke else QWEN25_05B
    big_name = "small (cpu smoke)" if args.cpu_smoke else "0.5b"
    workdir = Path(tempfile.mkdtemp(prefix="megarl_gpu_check_"))

    backend = parallel.default_backend()
    if "tiny" in parts:
        run_part("tiny", f"fp32, {backend}, built-in engine, verified syncs", lambda: grpo_part(
            args, TINY, bf16=False, offload=False, use_te=False), results, budget, 20)
    if "0.5b" in parts:
        run_part("0.5b", f"{big_name}: bf16 + fp32 main params, offload, built-in engine, verified syncs",
                 lambda: grpo_part(args, big, bf16=True, offload=True, use_te=False), results, budget, 60)
    if "te" in parts:
        if te_ok:
            run_part("te", f"{big_name}: Transformer Engine layer spec", lambda: grpo_part(
                args, big, bf16=True, offload=True, use_te=True, steps_count=2), results, budget, 60)
        else:
            skip(results, "te", "Transformer Engine layer spec", "transformer_engine is not importable (or no CUDA)")
    if "sglang" in parts:
        run_part("sglang", "SGLang colocated cycle", lambda: sglang_part(args, budget, workdir), results, budget, 0)
    if "sglang-lora" in parts:
        run_part("sglang-lora", "--lora-weight-sync merged against adapter on SGLang",
                 lambda: sglang_lora_part(args, budget, workdir), results, budget, 0)
    if "dynamic" in parts:
        run_part("dynamic", "Megatron dynamic inference engine (--rollout-backend megatron)",
                 lambda: dynamic_part(args), results, budget, 45)
    parallel.destroy()

    (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    log("\n== summary")
    for name, r in results.items():
        if name in ("environment", "mode"):
            continue
        if r.get("status") != "ran":
            log(f"  {name:<7} {r.get('status')}: {r.get('why') or r.get('error')}")
            continue
        if "comparison" in r:
            for mode, c in r["comparison"].items():
                log(f"  {name:<7} {mode}: " + (f"skipped ({c['skipped']})" if "skipped" in c else
                                                ", ".join(f"{k} {v:.4g}" for k, v in c.items())))
            continue
        s = r.get("summary", {})
        log(f"  {name:<7} params {r['parameters'] / 1e6:.1f} M | rollout {s['rollout_tokens_per_s']:.0f} tok/s "
            f"| sync {s['sync_seconds']:.3f} s push / {s['sync_total_seconds']:.3f} s total | step "
            f"{s['step_seconds']:.2f} s | peak GPU {r['peak_gpu_mib'] or 0:.0f} MiB | sync bytes == parameter "
            f"bytes: {r['sync_bytes_equal_parameter_bytes']}")
        if "parity" in r:
            pr = r["parity"]
            log(f"  {'':<7} greedy vs built-in engine: {100 * pr['greedy_identical_frac']:.0f}% identical, "
                f"|dlogp| {pr['logprob_absdiff_mean']:.2e}")
    log(f"results: {out_dir / 'results.json'}")
    parts = {n: r for n, r in results.items() if isinstance(r, dict) and "status" in r}
    failed = [n for n, r in parts.items() if part_verdict(n, r)[0] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
