"""Rewards off the critical path: `megarl/train.py` with --reward-overlap off (the serial pipeline: generate the
whole batch, then score it) and on (rows scored as they finish, the last ones while the step computes log-probs),
side by side, same seed, same steps; the step times, the reward's exposed share and their ratio.

    python tools/bench/reward_overlap.py                              # 6 steps per mode, the sizes below
    python tools/bench/reward_overlap.py --steps 10 --reward-workers 4 --threads 2 --json out.json

The reward is the real one of the code demo: the `code` verifier running each response as a Python program
against its row's four asserts in the local sandbox (`megarl.tasks.code_functions`), through --reward-workers
reward processes. The model is made here: the demo starter's Qwen2 shape (2 layers, hidden 256; positions raised
to 256 for the longer prompts), pre-trained for --pretrain-steps steps on the task's canonical solutions, enough
to write function-shaped text that ends at an end-of-text token after 20-60 tokens, as a policy at the start of RL
would (a random model runs to the length limit, so no row would finish early). The batch is the CPU demo's, 8
prompts x 8 samples. Each mode runs once (--rounds: more, alternating), as one process with --threads threads.

Reported per mode: the median step time, t_reward (the scoring's own wall time) and t_reward_exposed (what the step
waited on) over the steps after the first (the first starts the sandboxes); the ratio of the serial step time to
the overlapped one; and whether the two runs produced the same set of numbers: per step, every sample's prompt,
response, reward and advantage, and the step's reward, loss, KL and gradient norm (the order rows were scored in
differs; the numbers may not).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMPARED = ("reward_mean", "accuracy", "loss", "kl", "grad_norm", "entropy", "response_len", "uniform_group_frac")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="training steps per run (the first is left out of medians)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (x --samples)")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-response-len", type=int, default=96)
    p.add_argument("--reward-workers", type=int, default=2, help="reward worker processes (each with its sandbox)")
    p.add_argument("--threads", type=int, default=1, help="the trainer's threads (--threads-per-rank)")
    p.add_argument("--pretrain-steps", type=int, default=150, help="pre-training steps of the model made here")
    p.add_argument("--model", type=Path, default=None, help="an HF checkpoint to use instead of making one")
    p.add_argument("--rounds", type=int, default=1, help="runs per mode, alternating modes")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--work", type=Path, default=None, help="where runs are written (default: a temporary dir)")
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    return p.parse_args(argv)


def make_model(out: Path, steps: int) -> Path:
    """The demo starter's shape with the code task's tokenizer, pre-trained on `prompt + solution + EOS`."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from megarl.tasks import code_functions
    from megarl.tasks.arithmetic import build_tokenizer

    tokenizer = build_tokenizer(out, chars=code_functions.CHARS)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=768, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    train, _ = code_functions.split_problems()
    rng = random.Random(0)
    optim = torch.optim.AdamW(model.parameters(), lr=2e-3)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.train()
    for step in range(steps):
        rows, labels = [], []
        for p in rng.sample(train, 16):
            prompt = tokenizer(p.prompt, add_special_tokens=False)["input_ids"]
            answer = tokenizer(p.solution, add_special_tokens=False)["input_ids"] + [eos]
            rows.append(prompt + answer)
            labels.append([-100] * len(prompt) + answer)
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
        for group in optim.param_groups:
            group["lr"] = 2e-3 * min(1.0, (step + 1) / 20)
        loss = model(input_ids=ids, attention_mask=(ids != pad).long(), labels=lab).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"  pre-training the model: step {step + 1}/{steps} loss {loss.item():.3f}", flush=True)
    model.save_pretrained(out)
    return out


def make_data(path: Path) -> Path:
    from megarl.tasks import code_functions

    train, _ = code_functions.split_problems()
    code_functions.write_jsonl(path, train[:2048])
    return path


def train(args: list, out: Path, timeout: float = 3600) -> tuple[list[dict], list[dict], str]:
    """One training run (one process): its metrics rows, its samples rows and its console output."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(port),
           "megarl/train.py", *map(str, args), "--output-dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(map(str, cmd))}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")

    def rows(name: str) -> list[dict]:
        return [json.loads(line) for line in (out / name).read_text().splitlines() if line.strip()]

    return rows("metrics.jsonl"), rows("samples.jsonl"), done.stdout


def numbers(metrics: list[dict], samples: list[dict]) -> list:
    """What a fixed seed must reproduce, per step: the step's metrics, and its samples as a set."""
    per_step = []
    for m in metrics:
        mine = sorted((s["prompt_index"], s["response"], s["reward"], s["advantage"])
                      for s in samples if s["step"] == m["step"])
        per_step.append(({k: m.get(k) for k in COMPARED}, mine))
    return per_step


def main(argv=None) -> int:
    a = parse_args(argv)
    work = a.work or Path(tempfile.mkdtemp(prefix="megarl-reward-overlap-"))
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model = a.model or make_model(work / "model", a.pretrain_steps)
    data = make_data(work / "train.jsonl")
    rows_per_step = a.prompts * a.samples
    base = ["recipes/tiny_cpu.sh", "--hf-checkpoint", model, "--prompt-data", data, "--eval-data", "",
            "--rollout-batch-size", a.prompts, "--n-samples-per-prompt", a.samples,
            "--max-response-len", a.max_response_len, "--micro-batch-size", rows_per_step,
            "--reward-workers", a.reward_workers, "--reward-timeout", 30, "--threads-per-rank", a.threads,
            "--num-steps", a.steps, "--seed", a.seed, "--max-train-minutes", 0, "--log-interval", 1,
            "--log-samples-interval", 1, "--log-samples-count", rows_per_step]
    modes = {"serial": "off", "overlapped": "on"}
    runs: dict[str, list] = {name: [] for name in modes}
    for r in range(a.rounds):
        for name, flag in (modes.items() if r % 2 == 0 else reversed(modes.items())):
            metrics, samples, _ = train(base + ["--reward-overlap", flag], work / f"{name}-r{r}")
            runs[name].append((metrics, samples))
            print(f"  {name} round {r + 1}: {len(metrics)} steps", flush=True)

    figures: dict = {"steps": a.steps, "rows_per_step": rows_per_step, "reward_workers": a.reward_workers,
                     "threads": a.threads, "rounds": a.rounds, "load_average": os.getloadavg()[0]}
    for name, results in runs.items():
        measured = [m for metrics, _ in results for m in metrics[1:]]
        step = statistics.median(m["step_seconds"] for m in measured)
        reward = statistics.median(m["t_reward"] for m in measured)
        exposed = statistics.median(m["t_reward_exposed"] for m in measured)
        share = statistics.median(m["t_reward_exposed"] / m["step_seconds"] for m in measured)
        generate = statistics.median(m["t_generate"] for m in measured)
        figures[name] = dict(step_seconds=step, t_reward=reward, t_reward_exposed=exposed, exposed_share=share,
                             t_generate=generate, response_len=statistics.mean(m["response_len"] for m in measured),
                             programs_per_s=statistics.median(m.get("reward_programs_per_s", 0.0) for m in measured))
        print(f"{name:>10}: step {step:.2f} s (generate {generate:.2f} s, reward {reward:.2f} s of which exposed "
              f"{exposed:.2f} s = {100 * share:.1f}% of the step)")
    same = all(numbers(*run) == numbers(*runs["serial"][0]) for results in runs.values() for run in results)
    figures["ratio"] = figures["serial"]["step_seconds"] / figures["overlapped"]["step_seconds"]
    figures["same_numbers"] = same
    figures["minutes"] = (time.perf_counter() - start) / 60
    if a.json:
        a.json.write_text(json.dumps(figures, indent=1) + "\n")
    print(f"serial / overlapped step time: {figures['ratio']:.2f}x; exposed reward share "
          f"{100 * figures['serial']['exposed_share']:.1f}% -> {100 * figures['overlapped']['exposed_share']:.1f}%; "
          f"same numbers for the seed: {'yes' if same else 'NO'} ({rows_per_step} rows x {a.steps} steps, "
          f"{a.reward_workers} reward workers, load average {figures['load_average']:.1f})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
