"""One GRPO step, megarl against TRL's `GRPOTrainer`: same HF model, prompts, group size and lengths, on CPU, in one
process, side by side; per-phase seconds (median over the measured steps, after warm-up) and the ratio.

    python tools/bench/step.py                          # both sizes: tiny (the demo model) and 30m
    python tools/bench/step.py --sizes 30m --steps 3 --threads 2 --json out.json
    python tools/bench/step.py --precision fp32        # both frameworks in fp32

The two sizes:
- `tiny`: the CPU demo's model (`tools/make_starter_model.py`'s 2-layer Qwen2, ~2M parameters, random weights
  unless --tiny-model names a built starter) and the demo's batch: 8 prompts x 8 samples, 8-token responses,
  micro-batches of 32. Fixed per-step overheads dominate here.
- `30m`: a ~30M-parameter Qwen2 made locally (8 layers, hidden 512, MLP 2048, 8 heads / 2 KV heads), 4 prompts x
  8 samples, 128-token responses, micro-batches of 8. Compute dominates here.
Both use the arithmetic task's character-level tokenizer and `a+b=` / `a-b=` prompts.

How the two are matched (TRL 1.16 defaults differ from megarl's in several places; see docs/trl-grpo.md):
- responses have exactly `max_new_tokens` tokens on both sides: megarl samples with no stop token, TRL gets
  `min_new_tokens` = `max_completion_length` (EOS suppressed), so both train on the same number of tokens;
- sampling at temperature 1, no top-p / top-k, on both;
- loss: megarl `--loss-aggregation token-mean` = TRL `loss_type="dapo"` (token mean over the whole generation
  batch); advantages: megarl `grpo` = TRL `scale_rewards="group"`; clip 0.2 both sides; KL k3 with coefficient
  `--kl-coef` against a frozen reference on both (so both compute reference log-probs); one optimizer step per
  rollout batch (TRL `num_iterations=1`, `steps_per_generation` = `gradient_accumulation_steps`: neither computes
  "old" log-probs);
- precision (`--precision`, default bf16), the same class on both sides: megarl `--bf16` is Megatron's mixed
  precision (bf16 weights and activations, fp32 main params in the optimizer, fp32 gradient buffers, log-probs
  and loss in fp32) and its built-in engine generates with bf16 weights; TRL gets `bf16=True`, its own default,
  which on CPU is accelerate's bf16 autocast around every forward of the policy (generation included) and of the
  reference, with fp32 weights and optimizer. `--precision fp32` turns both off;
- TRL: `gradient_checkpointing=False`, `use_cpu=True`, `per_device_train_batch_size` = megarl's
  micro-batch, `gradient_accumulation_steps` = prompts x group / micro-batch, constant learning rate, same lr,
  Adam betas, weight decay 0, grad clip 1.0;
- the reward is the same plain function on both sides (share of digit characters in the decoded response), so
  the reward phase measures the frameworks' plumbing, not a verifier.

Timing. The frameworks alternate step by step (each TRL optimizer step is followed, outside TRL's timed window, by
one megarl step), so load from other processes on a shared machine hits both alike; the first `--warmup` steps
of each are dropped and the median of the rest reported, as wall seconds and as CPU seconds of the process. One
torch thread by default: on an oversubscribed machine several threads spin against each other and the wall
times stop meaning anything.

Kernels. Without Transformer Engine megarl runs Megatron's local layer spec with its own fused attention, RoPE and
RMSNorm (`megarl/mcore/local_kernels.py`); `--megarl-kernels stock` runs the spec as Megatron ships it.

Phases. megarl: the named steps of `megarl/train.py`'s loop, with its real components (BuiltinEngine generate,
the `single_turn` rollout function, whose reward calls (the verifier) are the reward phase and whose decoding
is part of generation, `MegatronPolicy` log-probs and train step through `megarl/stages/`, weight sync to the
engine) on a world of one process (gloo). TRL: `_generate` (tokenize, `model.generate`, decode),
`_calculate_rewards`, reference/old log-probs (`_get_per_token_logps_and_entropies` under no_grad), update
(forward + backward of every micro-batch, clipping, optimizer step), from the trainer's own step callbacks.
`other` is the rest of the step (advantages, batching, ...). TRL has no weight sync: it generates with the
training model itself.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from digits_reward import digit_share_reward  # beside this file; registers the bench_digits verifier

from megarl.tasks.arithmetic import build_tokenizer

REPO = Path(__file__).resolve().parents[2]

PHASES = ("generation", "reward", "log-probs", "update", "sync", "other", "total")


@dataclass(frozen=True)
class Size:
    name: str
    prompts: int  # per step
    group: int  # samples per prompt
    response_len: int  # tokens, exactly
    micro_batch: int


@dataclass
class Clock:
    """Wall seconds, and CPU seconds of this process (all its threads). On a shared machine the CPU time is the
    steadier measure of the work done; wall time is what a user waits."""

    wall: float = 0.0
    cpu: float = 0.0

    def __add__(self, other: Clock) -> Clock:
        return Clock(self.wall + other.wall, self.cpu + other.cpu)

    def __sub__(self, other: Clock) -> Clock:
        return Clock(self.wall - other.wall, self.cpu - other.cpu)


def now() -> Clock:
    return Clock(time.perf_counter(), time.process_time())


class PhaseTimer:
    """`with timer("update"): ...` adds the block's time to the phase; `result()` fills in `other`."""

    def __init__(self):
        self.phases: dict[str, Clock] = defaultdict(Clock)

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = now()
        try:
            yield
        finally:
            self.phases[name] += now() - start

    def result(self) -> dict[str, Clock]:
        out = {p: self.phases.get(p, Clock()) for p in PHASES}
        out["other"] = out["total"] - sum((v for k, v in out.items() if k not in ("other", "total")), Clock())
        return out


# The 30m size's architecture (Qwen2): tools/bench/local_kernels.py times one of its layers.
QWEN2_30M = dict(vocab_size=112, hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)

SIZES = {
    "tiny": Size("tiny", prompts=8, group=8, response_len=8, micro_batch=32),
    "30m": Size("30m", prompts=4, group=8, response_len=128, micro_batch=8),
}


# -- the shared reward: `digits_reward.py` (bench_digits) -------------------------------------------------------


# -- models and data -------------------------------------------------------------------------------------------


def make_model(size: str, out: Path, tiny_model: str | None) -> Path:
    """An HF checkpoint directory (weights + the arithmetic tokenizer) for `size`."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    if size == "tiny" and tiny_model:
        return Path(tiny_model)
    tokenizer = build_tokenizer(out)
    torch.manual_seed(0)
    if size == "tiny":
        # The demo starter's architecture, from its script by path (tools/ is a folder of scripts, not a package).
        spec = importlib.util.spec_from_file_location("make_starter_model", REPO / "tools" / "make_starter_model.py")
        starter = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(starter)
        model = starter.build_model(tokenizer)
    else:
        config = Qwen2Config(**QWEN2_30M, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    return out


def make_prompts(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b, op = rng.randint(0, 50), rng.randint(0, 50), rng.choice("+-")
        rows.append({"prompt": f"{a}{op}{b}=", "answer": str(a + b if op == "+" else a - b),
                     "verifier": "bench_digits"})
    return rows


# -- megarl ----------------------------------------------------------------------------------------------------


_WORLD = None  # megarl's ParallelInfo, set up by the first size and reused by the next


class MegarlStep:
    """train.py's loop body on a world of one process."""

    def __init__(self, model_dir: Path, data_path: Path, size: Size, args):
        from transformers import AutoTokenizer

        from megarl.arguments import parse_args
        from megarl.data import PromptSampler, load_prompts
        from megarl.mcore import parallel
        from megarl.mcore.actor import MegatronPolicy
        from megarl.model_shape import ModelShape
        from megarl.reward import InProcessReward
        from megarl.rollout.backends import build_engine
        from megarl.stages.algorithm import Algorithm
        from megarl.stages.colocation import WeightSync
        from megarl.stages.setup import optim_config

        self.size = size
        self.cfg = parse_args([
            "--hf-checkpoint", str(model_dir), "--prompt-data", str(data_path),
            "--n-samples-per-prompt", str(size.group), "--max-response-len", str(size.response_len),
            "--rollout-batch-size", str(size.prompts), "--micro-batch-size", str(size.micro_batch),
            "--rollout-temperature", "1.0", "--advantage-estimator", "grpo", "--loss-aggregation", "token-mean",
            "--eps-clip", "0.2", "--eps-clip-high", "0.2", "--kl-coef", str(args.kl_coef), "--kl-estimator", "k3",
            "--lr", str(args.lr), "--lr-decay-style", "constant", "--weight-decay", "0", "--clip-grad", "1.0",
            "--seed", str(args.seed), "--transformer-impl", "local", "--rollout-device", "cpu",
            *(["--bf16"] if args.precision == "bf16" else []),
        ])
        global _WORLD
        _WORLD = _WORLD or parallel.init_distributed(1, 1, seed=args.seed)  # gloo, world size 1, once per process
        self.info = _WORLD
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        d = self.cfg.data
        self.prompts = load_prompts(d.prompt_data, self.tokenizer, input_key=d.input_key, label_key=d.label_key,
                                    verifier_key=d.verifier_key)
        shape = ModelShape.from_pretrained(str(model_dir))
        bf16 = self.cfg.model.bf16
        fused = args.megarl_kernels == "fused"
        self.actor = MegatronPolicy(shape, tp=1, pp=1, trainable=True, bf16=bf16, local_kernels=fused,
                                    optim=optim_config(self.cfg.training), use_transformer_engine=False)
        self.actor.load_hf(str(model_dir))
        self.reference = MegatronPolicy(shape, tp=1, pp=1, trainable=False, bf16=bf16, use_transformer_engine=False,
                                        local_kernels=fused)
        self.reference.load_hf(str(model_dir))
        self.engine = build_engine(self.cfg)
        self.sync = WeightSync(self.actor, self.engine, self.cfg.rollout, self.info,
                               training=self.cfg.training)
        self.sync(version=0)
        self.algorithm = Algorithm(self.cfg, self.info, self.reference, None)
        self.reward = InProcessReward()
        self.sampler = PromptSampler(len(self.prompts), seed=args.seed)
        self.version = 0

    def step(self) -> dict[str, Clock]:
        from megarl.rollout import SamplingParams, single_turn
        from megarl.stages.algorithm import pack
        from megarl.stages.colocation import enter_rollout, enter_training
        from megarl.stages.update import update
        from megarl.samples import RolloutBatch

        cfg, size, t = self.cfg, self.size, PhaseTimer()
        with t("total"):
            enter_rollout(self.actor, self.engine, cfg.training)
            batch_prompts = [self.prompts[i] for i in self.sampler.next_indices(size.prompts)]
            # As the trainer's sampling params, but with no stop token: every response has exactly response_len tokens.
            params = SamplingParams(n=size.group, temperature=1.0, top_p=1.0, top_k=-1,
                                    max_new_tokens=size.response_len, stop_token_ids=(), seed=1000 + self.version)
            with t("rollout"):
                samples = single_turn(self.engine, batch_prompts, params, _TimedReward(self.reward, t), self.tokenizer)
            t.phases["generation"] += t.phases.pop("rollout") - t.phases["reward"]
            rollout = RolloutBatch(samples, params.n)
            enter_training(self.actor, self.engine)
            with t("log-probs"):
                packed = pack(rollout.samples, self.tokenizer.pad_token_id or 0)
                logp = self.algorithm.logprobs(self.actor, packed)
            batch, _ = self.algorithm.train_batch(rollout, packed, logp)
            with t("update"):
                update(self.actor, batch, cfg.algorithm, cfg.training, cfg.rollout)
            self.version += 1
            with t("sync"):
                self.sync(version=self.version)
        assert all(len(s.response_ids) == size.response_len for s in rollout.samples)
        return t.result()

    def close(self) -> None:
        self.engine.shutdown()


class _TimedReward:
    """A reward function whose calls count as the step's reward phase."""

    def __init__(self, inner, timer: PhaseTimer):
        self.inner, self.timer, self.restarts = inner, timer, 0

    def __call__(self, samples, records):
        with self.timer("reward"):
            return self.inner(samples, records)


# -- TRL ----------------------------------------------------------------------------------------------------


def race_with_trl(model_dir: Path, rows: list[dict], size: Size, args, ours: MegarlStep) -> tuple[list, list]:
    """`warmup + steps` optimizer steps of GRPOTrainer, each followed (outside TRL's timed step) by one megarl
    step, so that the two alternate under the same machine load. Per-phase times of each step of each."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    timer = PhaseTimer()
    trl_runs: list[dict[str, Clock]] = []
    megarl_runs: list[dict[str, Clock]] = []
    marks: dict[str, Clock] = {}

    def timed(name, fn, *a, **k):
        with timer(name):
            return fn(*a, **k)

    class Timed(GRPOTrainer):
        def _generate(self, prompts):
            return timed("generation", super()._generate, prompts)

        def _calculate_rewards(self, *a, **k):
            return timed("reward", super()._calculate_rewards, *a, **k)

        def _get_per_token_logps_and_entropies(self, *a, **k):
            if torch.is_grad_enabled():  # the policy's forward inside the loss: part of the update
                return super()._get_per_token_logps_and_entropies(*a, **k)
            return timed("log-probs", super()._get_per_token_logps_and_entropies, *a, **k)

        def _prepare_inputs(self, *a, **k):
            return timed("prepare", super()._prepare_inputs, *a, **k)

        def training_step(self, *a, **k):
            out = timed("training_step", super().training_step, *a, **k)
            marks["last_training_step_end"] = now()
            return out

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *a, **k):
            timer.phases.clear()
            marks["begin"] = now()

        def on_step_end(self, *a, **k):
            end = now()
            ph = timer.phases
            ph["total"] = end - marks["begin"]
            # forward/backward of the micro-batches, then clipping, optimizer and scheduler steps, zero_grad
            ph["update"] = ph["training_step"] - ph["prepare"] + (end - marks["last_training_step_end"])
            trl_runs.append(timer.result())
            megarl_runs.append(ours.step())  # megarl's turn, outside TRL's step

    samples = size.prompts * size.group
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="megarl-bench-trl-"), use_cpu=True, fp16=False,
        bf16=args.precision == "bf16", gradient_checkpointing=False, per_device_train_batch_size=size.micro_batch,
        gradient_accumulation_steps=samples // size.micro_batch, num_generations=size.group,
        max_completion_length=size.response_len, generation_kwargs={"min_new_tokens": size.response_len},
        temperature=1.0, top_p=1.0, top_k=0, loss_type="dapo", scale_rewards="group", beta=args.kl_coef,
        epsilon=0.2, num_iterations=1, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, max_steps=args.warmup + args.steps,
        seed=args.seed, logging_strategy="no", save_strategy="no", report_to=[], disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    trainer = Timed(model=model, reward_funcs=digit_share_reward, args=config, train_dataset=dataset,
                    processing_class=tokenizer, callbacks=[StepTimes()])
    # The settings that TRL 1.16 would otherwise default differently, checked on the trainer itself.
    checkpointing = getattr(trainer.model, "is_activation_checkpointing", None)
    assert not (checkpointing if checkpointing is not None else trainer.model.is_gradient_checkpointing)
    assert trainer.args.bf16 == (args.precision == "bf16") and next(trainer.model.parameters()).dtype == torch.float32
    assert trainer.loss_type == "dapo" and trainer.beta == args.kl_coef and (trainer.ref_model is not None) == (
        args.kl_coef > 0)
    assert trainer.args.steps_per_generation == trainer.args.gradient_accumulation_steps and trainer.num_iterations == 1
    assert trainer.accelerator.device.type == "cpu"
    assert trainer.accelerator.native_amp == (args.precision == "bf16")  # autocast wraps the model's forward
    trainer.train()
    return megarl_runs, trl_runs


# -- the race --------------------------------------------------------------------------------------------------


def median_phases(runs: list[dict[str, Clock]]) -> dict[str, dict[str, float]]:
    return {p: {"wall": statistics.median(r[p].wall for r in runs), "cpu": statistics.median(r[p].cpu for r in runs)}
            for p in PHASES}


def bench_size(size: Size, args, work: Path) -> dict:
    from safetensors.torch import load_file

    model_dir = make_model(size.name, work / size.name, args.tiny_model)
    rows = make_prompts(256, seed=args.seed)
    data_path = work / f"{size.name}.jsonl"
    data_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ours = MegarlStep(model_dir, data_path, size, args)
    megarl_runs, trl_runs = race_with_trl(model_dir, rows, size, args, ours)
    ours.close()
    params = sum(t.numel() for t in load_file(str(model_dir / "model.safetensors")).values())
    megarl_runs, trl_runs = megarl_runs[args.warmup :], trl_runs[args.warmup :]
    as_dicts = lambda runs: [{p: c.__dict__ for p, c in r.items()} for r in runs]
    return {"size": size.__dict__, "parameters": params, "threads": args.threads, "precision": args.precision,
            "megarl_kernels": args.megarl_kernels,
            "megarl": median_phases(megarl_runs), "trl": median_phases(trl_runs),
            "megarl_runs": as_dicts(megarl_runs), "trl_runs": as_dicts(trl_runs)}


def print_table(result: dict) -> None:
    s = result["size"]
    print(f"\n{s['name']}: {result['parameters'] / 1e6:.1f}M parameters, "
          f"{s['prompts']} prompts x {s['group']} samples, "
          f"{s['response_len']}-token responses, micro-batch {s['micro_batch']}, {result['precision']}, "
          f"megarl kernels {result['megarl_kernels']}, "
          f"{result['threads']} thread(s); "
          f"median of {len(result['megarl_runs'])} steps after warm-up, the two alternating step by step")
    print(f"  {'phase':<11}{'megarl wall':>12}{'TRL wall':>10}{'TRL/megarl':>11}  |{'megarl cpu':>11}{'TRL cpu':>9}"
          f"{'TRL/megarl':>11}")
    for p in PHASES:
        cells = []
        for kind in ("wall", "cpu"):
            ours, theirs = result["megarl"][p][kind], result["trl"][p][kind]
            ratio = f"{theirs / ours:.2f}x" if ours > 1e-3 and theirs > 1e-3 else "-"
            cells.append((ours, theirs, ratio))
        (ow, tw, rw), (oc, tc, rc) = cells
        print(f"  {p:<11}{ow:>12.3f}{tw:>10.3f}{rw:>11}  |{oc:>11.3f}{tc:>9.3f}{rc:>11}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,30m", help="comma-separated: tiny, 30m")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per framework (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="steps run first and not measured")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (both frameworks)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                        help="bf16: megarl --bf16, TRL bf16=True (its default); fp32: both off")
    parser.add_argument("--megarl-kernels", choices=("fused", "stock"), default="fused",
                        help="fused: Megatron's local spec with megarl's kernels (megarl/mcore/local_kernels.py, the "
                             "default without TE); stock: Megatron's local spec as shipped")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--kl-coef", type=float, default=0.001,
                        help="KL coefficient (the demo's); > 0 runs a reference")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--tiny-model", help="a built starter model directory for the tiny size (default: random "
                                             "weights of the same architecture)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results = []
    with tempfile.TemporaryDirectory(prefix="megarl-bench-") as tmp:
        for name in args.sizes.split(","):
            results.append(bench_size(SIZES[name], args, Path(tmp)))
            print_table(results[-1])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
