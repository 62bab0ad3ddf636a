"""Part (a) of `make gpu-check`: megarl's Megatron actor in bf16 against `transformers`, a dense Qwen2 and a
Qwen3-MoE at expert parallelism 1 (the router's path), on the GPU.

For each model: a random HF checkpoint (transformers builds and saves it), loaded into a bf16 `MegatronPolicy` with
fp32 main params; its per-token log-probs on random tokens are compared with transformers' fp32 log-probs of the
same checkpoint, against the error transformers' own bf16 forward makes (the bf16 floor). Then one GRPO update on
a synthetic batch; its exported HF weights, saved and loaded back by transformers, must again give the actor's
log-probs: the export after an update is right too. Prints one line per model and ends with `PASS: ...` or
`FAIL: ...`; exits 0 or 1. `--device cpu` runs the same on CPU (gloo), to check the script itself.

    python tools/gpu_check_actor.py [--device cuda|cpu] [--families qwen2,qwen3_moe]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import torch

# bf16 log-probs may be this much further from fp32 than transformers' own bf16 forward, plus an absolute slack
# (megatron and transformers round in different places; the same order of error, not the same bits).
FLOOR_FACTOR, SLACK = 3.0, 5e-3
SHAPE = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=512, max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.05)


def hf_checkpoint(family: str, out: Path, seed: int = 0):
    """A random HF checkpoint of `family` in `out`; returns the fp32 transformers model."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3MoeConfig

    if family == "qwen2":
        config = Qwen2Config(**SHAPE)
    elif family == "qwen3_moe":
        config = Qwen3MoeConfig(**SHAPE, head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                                norm_topk_prob=True, router_aux_loss_coef=0.0, decoder_sparse_step=1)
    else:
        raise ValueError(f"--families: unknown {family!r}; choose from qwen2, qwen3_moe")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    return model.eval()


@torch.no_grad()
def hf_logprobs(model, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' per-token log-probs [B, S - 1] of `tokens` with the model cast to `dtype` (then back)."""
    model.to(dtype)
    logits = model(input_ids=tokens, use_cache=False).logits.float()
    model.to(torch.float32)
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def synthetic_batch(tokens: torch.Tensor, seed: int = 99) -> dict[str, torch.Tensor]:
    """A GRPO batch over `tokens`: the last half of each row is the response, random advantages."""
    rows, seq = tokens.shape
    mask = torch.zeros(rows, seq - 1)
    mask[:, seq // 2:] = 1.0
    g = torch.Generator().manual_seed(seed)
    return {"tokens": tokens.cpu(), "loss_mask": mask, "rollout_logp": torch.zeros(rows, seq - 1),
            "advantages": torch.randn(rows, generator=g)}


def check_family(family: str, device: torch.device, workdir: Path) -> tuple[bool, str]:
    from megarl.config import build_config
    from megarl.mcore.actor import MegatronPolicy, OptimConfig
    from megarl.model_shape import ModelShape
    from megarl.stages.update import make_loss_fn
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    ckpt = workdir / family
    hf = hf_checkpoint(family, ckpt).to(device)
    shape = ModelShape.from_pretrained(ckpt)
    tokens = torch.randint(0, shape.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1234)).to(device)
    ref = hf_logprobs(hf, tokens, torch.float32)
    floor = (hf_logprobs(hf, tokens, torch.bfloat16) - ref).abs().mean().item()
    actor = MegatronPolicy(shape, tp=1, pp=1, trainable=True, bf16=True, optim=OptimConfig(lr=1e-4))
    actor.load_hf(ckpt)
    ours = actor.logprobs(tokens, micro_batch_size=2).float()
    before = (ours - ref).abs()
    cfg = build_config({})
    stats = actor.train_step(synthetic_batch(tokens), make_loss_fn(cfg.algorithm, 64), micro_batch_size=2)
    grad_norm = float(stats.get("grad_norm", float("nan")))
    moved = actor.logprobs(tokens, micro_batch_size=2).float()
    # transformers 5 loads per-expert names (the export's, as checkpoints have them) into its fused experts
    reloaded = ckpt.with_name(f"{family}_updated")
    reloaded.mkdir()
    shutil.copy(ckpt / "config.json", reloaded / "config.json")
    save_file({name: t.detach().float().cpu().contiguous() for name, t in actor.export_hf()},
              str(reloaded / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(str(reloaded), dtype=torch.float32).to(device).eval()
    after = (moved - hf_logprobs(hf, tokens, torch.float32)).abs()
    change = (moved - ours).abs().mean().item()
    bound = FLOOR_FACTOR * floor + SLACK
    line = (f"{family}: |dlogp| vs transformers fp32 mean {before.mean():.2e} (max {before.max():.2e}; "
            f"transformers bf16 {floor:.2e}, bound {bound:.2e}); after one update: grad norm {grad_norm:.3g}, "
            f"log-probs moved {change:.2e}, export vs transformers mean {after.mean():.2e}")
    print("   " + line, flush=True)
    ok = before.mean().item() <= bound and after.mean().item() <= bound and change > 0 and grad_norm == grad_norm
    if not ok:
        return False, line
    return True, f"{family} {before.mean():.1e}/{after.mean():.1e} (bound {bound:.1e})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--families", default="qwen2,qwen3_moe", help="comma-separated: qwen2, qwen3_moe")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("SKIP: torch sees no CUDA GPU (use --device cpu to check the script)")
        return 3
    if "MASTER_PORT" not in os.environ:  # one process: any free port
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    from megarl.mcore import parallel

    parallel.init_distributed(1, 1, timeout_s=120, seed=0)
    device = parallel.device()
    print(f"   actor on {device} ({parallel.default_backend()}), Transformer Engine "
          f"{'used' if parallel.transformer_engine_available() else 'absent: the local spec'}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="megarl_gpu_check_actor_") as tmp:
        for family in args.families.split(","):
            try:
                results.append(check_family(family, device, Path(tmp)))
            except Exception as e:  # noqa: BLE001 - report the family's failure and go on with the next
                import traceback

                traceback.print_exc()
                first = str(e).splitlines()[0][:300] if str(e) else ""
                results.append((False, f"{family}: {type(e).__name__}: {first}"))
    parallel.destroy()
    failed = [why for ok, why in results if not ok]
    if failed:
        print("FAIL: " + "; ".join(failed))
        return 1
    print("PASS: bf16 log-probs within the bound, before and after an update: " + ", ".join(w for _, w in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
