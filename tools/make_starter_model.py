"""Build the tiny starter model of the CPU demo: a 2-layer Qwen2 that knows the arithmetic format but is only
partly right, so that GRPO has something visible to improve in minutes on 2 cores.

    python tools/make_starter_model.py --out DIR [--family qwen2|qwen3|qwen3_moe|deepseek_v3] [--steps 1760]
                                       [--seed 0]
                                       [--minutes M]

`--family` picks the architecture, the same width and depth in each: Qwen2 (the demo's), Qwen3 (per-head q/k
norms), or Qwen3-MoE (4 experts of width 512 per layer, each token through 2 of them: the dense MLP's 1,024
active width; `recipes/tiny_cpu_moe.sh` trains it with expert parallelism), or DeepSeek-V3 (multi-latent attention
with a low-rank query; a dense first layer, then 4 routed experts of width 512, 2 per token in one of 2 groups by
DeepSeek's sigmoid router, plus a shared expert of width 512; `recipes/models/tiny_deepseek_v3.sh`).

The Qwen3-MoE starter is sparsely upcycled (Komatsuzaki et al. 2022, "Sparse Upcycling"; Qwen1.5-MoE was made
from a dense Qwen the same way): a dense Qwen3 whose MLP is one expert wide (512) is pre-trained for `--steps`
steps, then every expert of every layer becomes a copy of that layer's MLP and every other weight is carried over.
With top-2 routing and `norm_topk_prob` the two routing weights of a token sum to 1, so the MoE computes exactly
the dense model's function (the build checks the logits agree within 1e-4, a test within 1e-5). The DeepSeek-V3
starter is upcycled the same way from a dense DeepSeek-V3 (MLA, both layers dense, MLP 512): the second layer's MLP
becomes the shared expert and each routed expert with its output halved (`down_proj` x 0.5), and with the routing
weights renormalised and scaled by 1 (`routed_scaling_factor`) shared + routed again give the dense output. Why:
- Speed. transformers runs a MoE's experts one after another: on 2 shared cores pre-training the MoE itself took
  ~2.8 s a step (~80 minutes for 1,760 steps); the dense model one expert wide took 0.36 s a step with one
  thread (10.5 minutes for 1,760 steps, same machine and load; `make demo-moe` builds it with OMP_NUM_THREADS=1,
  as two threads on busy cores measured 12 s a step against 1.9 s for one).
- No noise is added to the copies. The router keeps its random initialisation (std 0.02), so different tokens
  reach different experts and the experts' gradients differ from the first update of RL: that breaks the
  symmetry. Noise would only make the start differ from the measured dense function. (While the experts are
  still equal the router's gradient is zero, since the mixed output does not depend on the weights' split.)

DIR receives an HF checkpoint (config.json, model.safetensors, the tokenizer) plus `train.jsonl` (every problem
not held out) and `heldout.jsonl` (the 200 held-out problems). Everything is written to a hidden sibling
directory first and renamed to DIR at the end, so an interrupted build leaves no half-made DIR behind.

How it departs from plain supervised pre-training, and why:
- The loss covers the answer tokens and EOS only: the prompt is given at test time, so fitting it wastes steps.
- Half of the training answers are replaced by c +/- 1..3 (kept non-negative), drawn afresh every time. The
  model learns the format and the rough size of the answer but cannot become reliably right, which leaves
  headroom for RL (calibration: greedy ~57 %, sampled ~26 % held-out after 1,760 steps). The noise also keeps it
  from memorising: measured, clean answers for the first 75 % of 1,760 steps (then p = 0.75) drove the training
  loss to 4e-4 but gave only 40.5 % greedy / 16.5 % sampled on the held-out problems.
- A 50-step linear warm-up, AdamW betas (0.9, 0.98) and no weight decay: measured at 1,000 steps, these take
  greedy held-out accuracy from ~8 % (no warm-up) or ~25 % (warm-up, default betas and decay) to ~45-50 %.
- The build is bound by its step count only: the cosine schedule runs over exactly `--steps` steps, so every
  machine builds the same model, only slower or faster. A schedule over wall time would tie the model to the
  machine's load (measured with one: on 2 busy cores a 15-minute budget ended at 364 of 1,760 steps, 23.5 %
  greedy / 13.6 % sampled, where the full build reaches 64 % / 24 %). `--minutes M` is a deadline, not a
  budget: a build that passes it stops with a message and writes nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import torch

from megarl.tasks.arithmetic import Problem, build_tokenizer, split_problems, write_jsonl
from megarl.verifiers.arithmetic import ArithmeticVerifier

LR = 1.5e-3
WARMUP_STEPS = 50  # without it the model sits at a "predict the tens digit" plateau: ~8 % greedy after 1,000 steps
ADAM_BETAS = (0.9, 0.98)  # measured better than (0.9, 0.999) for this short run; see the module docstring
BATCH = 128
NOISE_P = 0.5  # share of training answers replaced by a near miss
STEPS = 1760  # ~3 minutes on 2 idle cores
MAX_NEW_TOKENS = 6  # answers have at most 3 digits, then EOS; a little slack to see rambling
VOCAB_MULTIPLE = 16
FAMILIES = ("qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
UPCYCLED = ("qwen3_moe", "deepseek_v3")  # pre-trained dense, then each MLP copied into the experts
MLP_WIDTH = 1024
EXPERTS, EXPERTS_PER_TOKEN, EXPERT_WIDTH = 4, 2, 512  # Qwen3-MoE: 2 of 4 experts per token, the MLP's active width
# DeepSeek-V3's multi-latent attention at the others' width and heads: a low-rank query (rank 128), a 64-wide key-value
# latent, per head a 48-wide key part without position and a 16-wide rotary part (64 in all, Qwen3's head_dim), values
# 64 wide; 2 expert groups of which the router keeps 1 (DeepSeek's group-limited routing).
DEEPSEEK_V3 = dict(q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=64,
                   n_routed_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN, moe_intermediate_size=EXPERT_WIDTH,
                   n_shared_experts=1, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="checkpoint directory to create")
    p.add_argument("--family", choices=FAMILIES, default="qwen2", help="the model's architecture (HF model_type)")
    p.add_argument("--steps", type=int, default=STEPS, help="pre-training steps: the learning-rate schedule's length")
    p.add_argument("--minutes", type=float, default=0.0, help="a deadline: past it the build stops and writes "
                   "nothing (0 = none); it never shortens the schedule")
    p.add_argument("--seed", type=int, default=0, help="seed for the initial weights and the noisy answers")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the held-out split")
    p.add_argument("--noise-p", type=float, default=NOISE_P, help="share of training answers replaced by a near miss")
    p.add_argument("--overwrite", action="store_true", help="replace DIR if it already exists")
    return p.parse_args(argv)


def build_model(tokenizer, family: str = "qwen2", mlp_width: int | None = None, positions: int = 64, hidden: int = 256,
                dense: bool = False):
    """A 2-layer Qwen2 (~2M parameters): on 2 cores a smaller model trains into a useful start fastest. Qwen3 and
    Qwen3-MoE keep its width, depth and heads (see the module docstring); `mlp_width` is the dense MLP's width,
    `positions` the longest prompt + response (64 covers arithmetic) and `hidden` the width: the code starter's
    sequences are ten times as long, so it is narrower to stay as cheap a step. `dense`: DeepSeek-V3 with every layer
    dense (`first_k_dense_replace` = the layers), the model its starter is upcycled from. The dense MLP is
    `MLP_WIDTH` wide by default, DeepSeek-V3's one expert wide (`EXPERT_WIDTH`), as its first layer stays dense."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if mlp_width is None:
        mlp_width = EXPERT_WIDTH if family == "deepseek_v3" else MLP_WIDTH
    vocab = len(tokenizer)
    padded = math.ceil(vocab / VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    cls, extra = Qwen2Config, {}
    if family in ("qwen3", "qwen3_moe"):
        cls, extra = Qwen3Config, dict(head_dim=64)
    if family == "qwen3_moe":
        cls = Qwen3MoeConfig
        extra.update(num_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN, moe_intermediate_size=EXPERT_WIDTH,
                     norm_topk_prob=True, router_aux_loss_coef=0.0)
    if family == "deepseek_v3":
        cls, extra = DeepseekV3Config, dict(DEEPSEEK_V3, first_k_dense_replace=2 if dense else 1)
    config = cls(
        vocab_size=padded,
        tokenizer_vocab_size=vocab,  # ids >= this are padding rows of the embedding, never produced by the tokenizer
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4 if family == "deepseek_v3" else 2,  # MLA: every head reads the shared latent
        intermediate_size=mlp_width,
        max_position_embeddings=positions,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **extra,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@torch.no_grad()
def upcycle(dense, moe) -> None:
    """Sparse upcycling, in place: every expert of `moe` (a Qwen3-MoE) becomes a copy of the same layer's MLP in
    `dense` (a Qwen3 whose MLP is one expert wide) and every other weight is `dense`'s; the routers keep their
    initialisation. With top-k renormalised (`norm_topk_prob`) the MoE then computes `dense`'s function.

    transformers (5.x) keeps a layer's experts as two tensors: `experts.gate_up_proj` [experts, 2 x width,
    hidden], the gate rows then the up rows, and `experts.down_proj` [experts, hidden, width]."""
    if not moe.config.norm_topk_prob or moe.config.moe_intermediate_size != dense.config.intermediate_size:
        raise ValueError("upcycling copies the dense MLP into each expert: it needs norm_topk_prob and experts as "
                         f"wide as the MLP ({moe.config.moe_intermediate_size} vs {dense.config.intermediate_size})")
    source, target = dense.state_dict(), moe.state_dict()
    done = set()
    for name, tensor in target.items():
        prefix, _, leaf = name.rpartition("mlp.")
        if name in source:
            tensor.copy_(source[name])
        elif leaf == "experts.gate_up_proj":
            gate_up = torch.cat([source[prefix + "mlp.gate_proj.weight"], source[prefix + "mlp.up_proj.weight"]])
            tensor.copy_(gate_up.expand_as(tensor))
        elif leaf == "experts.down_proj":
            tensor.copy_(source[prefix + "mlp.down_proj.weight"].expand_as(tensor))
        elif leaf != "gate.weight":  # the router: no dense counterpart
            raise ValueError(f"upcycling: no dense weight for {name}")
        done.add(name)
    unused = {n for n in source if not n.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight"))} - done
    if unused:
        raise ValueError(f"upcycling: dense weights left out: {sorted(unused)}")


@torch.no_grad()
def upcycle_deepseek_v3(dense, moe) -> None:
    """Sparse upcycling of a DeepSeek-V3, in place: `dense` is a DeepSeek-V3 whose layers are all dense (MLP as wide
    as an expert), `moe` the same shape with MoE layers from `first_k_dense_replace` on. In each MoE layer the shared
    expert and every routed expert become the dense MLP with its output halved (`down_proj` x 0.5); with the routing
    weights renormalised and `routed_scaling_factor` 1 the routed half sums to half the MLP, so the layer computes
    `dense`'s function. The attention (MLA), norms, embeddings and the dense layers are copied; the routers keep
    their initialisation and the expert bias its zeros (transformers 5.x keeps the routed experts fused, as in
    `upcycle`)."""
    cfg = moe.config
    if not cfg.norm_topk_prob or cfg.routed_scaling_factor != 1.0 or cfg.n_shared_experts != 1 \
            or cfg.moe_intermediate_size != dense.config.intermediate_size:
        raise ValueError("upcycling DeepSeek-V3 needs norm_topk_prob, routed_scaling_factor 1, one shared expert and "
                         f"experts as wide as the dense MLP ({cfg.moe_intermediate_size} vs "
                         f"{dense.config.intermediate_size})")
    source, target = dense.state_dict(), moe.state_dict()
    done = set()

    def mlp(prefix: str, w: str) -> torch.Tensor:  # the dense layer's MLP
        return source[f"{prefix}mlp.{w}_proj.weight"]

    for name, tensor in target.items():
        prefix, _, leaf = name.rpartition("mlp.")
        if name in source:
            tensor.copy_(source[name])
            done.add(name)
        elif leaf == "experts.gate_up_proj":
            tensor.copy_(torch.cat([mlp(prefix, "gate"), mlp(prefix, "up")]).expand_as(tensor))
        elif leaf == "experts.down_proj":
            tensor.copy_((0.5 * mlp(prefix, "down")).expand_as(tensor))
        elif leaf.startswith("shared_experts."):
            w = leaf.split(".")[1][: -len("_proj")]
            tensor.copy_(0.5 * mlp(prefix, w) if w == "down" else mlp(prefix, w))
        elif leaf not in ("gate.weight", "gate.e_score_correction_bias"):  # the router: no dense counterpart
            raise ValueError(f"upcycling: no dense weight for {name}")
        if prefix and "mlp." in name and name not in source:
            done.update(f"{prefix}mlp.{w}_proj.weight" for w in ("gate", "up", "down"))
    unused = set(source) - done
    if unused:
        raise ValueError(f"upcycling: dense weights left out: {sorted(unused)}")


def noisy_answer(problem: Problem, rng: random.Random, noise_p: float = NOISE_P) -> str:
    """The true answer, or with probability `noise_p` a non-negative near miss c +/- 1..3."""
    c = int(problem.answer)
    if rng.random() >= noise_p:
        return problem.answer
    while True:
        wrong = c + rng.choice((-3, -2, -1, 1, 2, 3))
        if wrong >= 0:
            return str(wrong)


def make_batch(problems: list[Problem], tokenizer, rng: random.Random,
               noise_p: float = NOISE_P) -> dict[str, torch.Tensor]:
    """`prompt + answer + EOS`, right-padded, no BOS; labels mask the prompt and padding with -100."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows, label_rows = [], []
    for p in problems:
        prompt_ids = tokenizer(p.prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(noisy_answer(p, rng, noise_p), add_special_tokens=False)["input_ids"] + [eos]
        rows.append(prompt_ids + answer_ids)
        label_rows.append([-100] * len(prompt_ids) + answer_ids)
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    labels = torch.tensor([r + [-100] * (width - len(r)) for r in label_rows])
    return {"input_ids": input_ids, "attention_mask": (input_ids != pad).long(), "labels": labels}


def learning_rate(step: int, progress: float) -> float:
    """Linear warm-up over WARMUP_STEPS, times cosine decay to zero over `progress` in [0, 1]."""
    return LR * min(1.0, (step + 1) / WARMUP_STEPS) * 0.5 * (1.0 + math.cos(math.pi * progress))


class OutOfTime(RuntimeError):
    """The build passed its --minutes deadline."""


def pretrain(model, tokenizer, train: list[Problem], steps: int, seed: int, noise_p: float = NOISE_P,
             minutes: float = 0.0) -> int:
    """Causal-LM pre-training for `steps` steps, the schedule over exactly those steps; returns `steps`. With
    `minutes` > 0, raises OutOfTime once that much wall time has passed (the schedule is never shortened)."""
    rng = random.Random(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=LR, betas=ADAM_BETAS, weight_decay=0.0)
    start = last_said = time.perf_counter()
    warned = False
    model.train()
    for step in range(steps):
        elapsed = time.perf_counter() - start
        if minutes and elapsed > 60 * minutes:
            raise OutOfTime(f"pre-training passed --minutes {minutes:g} at step {step} of {steps} "
                            f"({elapsed / max(step, 1):.2f} s a step); nothing was written. The build is bound by its "
                            "step count: run it without --minutes, or with a larger one")
        if minutes and step == 20 and not warned and elapsed / step * steps > 60 * minutes:
            warned = True  # say it now, not when the deadline strikes
            print(f"warning: at {elapsed / step:.2f} s a step the {steps} steps need "
                  f"~{elapsed / step * steps / 60:.1f} min, past --minutes {minutes:g}: the build will stop then and "
                  "write nothing", flush=True)
        for group in optim.param_groups:
            group["lr"] = learning_rate(step, step / steps)
        loss = model(**make_batch(rng.sample(train, BATCH), tokenizer, rng, noise_p), use_cache=False).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        now = time.perf_counter()
        # a line at the first step, every 100 steps and at least every 30 s
        if step == 0 or (step + 1) % 100 == 0 or step + 1 == steps or now - last_said > 30:
            last_said, pace = now, (now - start) / (step + 1)
            print(f"step {step + 1:5d}/{steps}  loss {loss.item():.4f}  lr {optim.param_groups[0]['lr']:.2e}  "
                  f"({pace:.2f} s a step, ~{pace * (steps - step - 1) / 60:.1f} min left)", flush=True)
    return steps


@torch.no_grad()
def evaluate(model, tokenizer, problems: list[Problem], samples: int, temperature: float, seed: int = 0):
    """Return (accuracy, clean-format rate) over `samples` generations per problem; temperature 0 = greedy.

    A plain loop without KV cache: prompts are grouped by length so no padding is needed, and the whole
    sequence is re-run for each new token, which is cheap at this size. Clean format = a bare integer then EOS.
    """
    model.eval()
    verifier, gen = ArithmeticVerifier(), torch.Generator().manual_seed(seed)
    eos, vocab = tokenizer.eos_token_id, len(tokenizer)
    correct = clean = total = 0
    by_length: dict[int, list[tuple[list[int], Problem]]] = {}
    for p in problems:
        ids = tokenizer(p.prompt, add_special_tokens=False)["input_ids"]
        by_length.setdefault(len(ids), []).extend([(ids, p)] * samples)
    for group in by_length.values():
        seqs = torch.tensor([ids for ids, _ in group])
        prompt_len = seqs.shape[1]
        for _ in range(MAX_NEW_TOKENS):
            logits = model(input_ids=seqs, use_cache=False).logits[:, -1, :vocab]  # never pick padding rows
            if temperature == 0:
                nxt = logits.argmax(-1)
            else:
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen).squeeze(-1)
            seqs = torch.cat([seqs, nxt[:, None]], dim=1)
            if (seqs[:, prompt_len:] == eos).any(-1).all():
                break
        for row, (_, p) in zip(seqs[:, prompt_len:].tolist(), group):
            ended = eos in row
            text = tokenizer.decode(row[: row.index(eos)] if ended else row)
            correct += verifier.verify(text, p.answer).score == 1.0
            clean += ended and re.fullmatch(r"-?\d+", text) is not None
            total += 1
    return correct / total, clean / total


def pretrain_steps(model, next_loss, steps: int, seed: int, minutes: float = 0.0) -> None:
    """The task starters' pre-training (tool, code, math): AdamW on the loss `next_loss(rng)` returns for a fresh
    batch (`rng` seeded by `seed`) for exactly `steps` steps of this module's schedule; with `minutes` > 0,
    OutOfTime once that much wall time has passed (the schedule is never shortened)."""
    rng = random.Random(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=learning_rate(0, 0), betas=ADAM_BETAS, weight_decay=0.0)
    start = last_said = time.perf_counter()
    model.train()
    for step in range(steps):
        if minutes and time.perf_counter() - start > 60 * minutes:
            raise OutOfTime(f"pre-training passed --minutes {minutes:g} at step {step} of {steps}; nothing was "
                            "written (the build is bound by its step count)")
        for group in optim.param_groups:
            group["lr"] = learning_rate(step, step / steps)
        loss = next_loss(rng)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        now = time.perf_counter()
        if step == 0 or (step + 1) % 100 == 0 or step + 1 == steps or now - last_said > 30:
            last_said, pace = now, (now - start) / (step + 1)
            print(f"step {step + 1:5d}/{steps}  loss {loss.item():.4f}  ({pace:.2f} s a step, "
                  f"~{pace * (steps - step - 1) / 60:.1f} min left)", flush=True)


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def build(tmp: Path, args: argparse.Namespace) -> None:
    """Write everything into `tmp`; the caller renames it to `out`."""
    torch.manual_seed(args.seed)
    # CI has 2 cores; more threads than cores only adds contention (OMP_NUM_THREADS=1 when sharing the machine)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    train, heldout = split_problems(seed=args.split_seed)
    tokenizer = build_tokenizer(tmp)
    upcycled = args.family in UPCYCLED  # pre-trained dense, one expert wide; see the module docstring
    if args.family == "deepseek_v3":
        model = build_model(tokenizer, "deepseek_v3", dense=True)
    elif upcycled:
        model = build_model(tokenizer, "qwen3", EXPERT_WIDTH)
    else:
        model = build_model(tokenizer, args.family)
    print(f"parameters: {count_parameters(model):,}  vocab: {len(tokenizer)} -> {model.config.vocab_size}", flush=True)
    print(f"problems: {len(train)} train, {len(heldout)} held out", flush=True)

    start = time.perf_counter()
    steps = pretrain(model, tokenizer, train, args.steps, args.seed, args.noise_p, minutes=args.minutes)
    seconds = time.perf_counter() - start
    print(f"pre-trained {steps} steps in {seconds:.1f} s ({seconds / max(steps, 1):.3f} s/step)")
    if upcycled:
        model = upcycle_checked(model, tokenizer, heldout, args.seed, args.family)

    model.save_pretrained(str(tmp), safe_serialization=True)
    write_jsonl(tmp / "train.jsonl", train)
    write_jsonl(tmp / "heldout.jsonl", heldout)

    print(f"evaluating on the {len(heldout)} held-out problems (greedy, then 4 samples each)", flush=True)
    greedy, greedy_clean = evaluate(model, tokenizer, heldout, samples=1, temperature=0.0)
    sampled, sampled_clean = evaluate(model, tokenizer, heldout, samples=4, temperature=1.0, seed=args.seed)
    print(f"held-out greedy accuracy {greedy:.2%} (clean format {greedy_clean:.2%})")
    print(f"held-out sampled accuracy {sampled:.2%} (T=1, 4 per prompt; clean format {sampled_clean:.2%})")


def upcycle_checked(dense, tokenizer, problems: list[Problem], seed: int, family: str = "qwen3_moe"):
    """The MoE (`family`) upcycled from `dense`, after checking that both give the same logits on `problems`."""
    torch.manual_seed(seed)  # the routers' initialisation
    moe = build_model(tokenizer, family)
    (upcycle_deepseek_v3 if family == "deepseek_v3" else upcycle)(dense, moe)
    ids = torch.tensor([tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in problems
                        if len(p.prompt) == len(problems[0].prompt)])
    dense.eval()
    moe.eval()
    with torch.no_grad():
        gap = (moe(input_ids=ids).logits - dense(input_ids=ids).logits).abs().max().item()
    print(f"upcycled to {count_parameters(moe):,} parameters ({EXPERTS} copies of each MLP, top-{EXPERTS_PER_TOKEN}); "
          f"largest logit difference to the dense model {gap:.2e}", flush=True)
    if gap > 1e-4:
        raise RuntimeError(f"the upcycled MoE differs from the dense model by {gap:.2e} in the logits")
    return moe


def write_atomically(out: Path, overwrite: bool, build, program: str) -> None:
    """Run `build(tmp)` on a partial directory beside `out` and rename it into place when complete: a failed or
    cut-short build leaves nothing, and replaces nothing. `program` names the tool in its out-of-time message."""
    out = out.resolve()
    if out.exists() and not overwrite:
        sys.exit(f"{out} already exists; pass --overwrite to replace it")
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()

    def stopped(signum, frame):  # SIGTERM (kill, make interrupted): unwind, so the partial directory goes too
        raise SystemExit(f"{program}: stopped by signal {signum}; nothing written")

    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        build(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        print(f"wrote {out}")
    except OutOfTime as e:
        sys.exit(f"{program}: {e}")
    finally:
        signal.signal(signal.SIGTERM, previous)
        if tmp.exists():
            shutil.rmtree(tmp)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    write_atomically(args.out, args.overwrite, lambda tmp: build(tmp, args), "make_starter_model")


if __name__ == "__main__":
    main()
