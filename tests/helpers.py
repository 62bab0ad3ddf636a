"""Shared test helpers: tiny models made locally, and a bounded torchrun launcher."""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def fixed_batch(vocab: int, seed: int) -> dict:
    """A fixed training batch of 8 sequences of 12 tokens (loss on the last 9) with random advantages, for the
    resume tests' updates."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (8, 12), generator=g)
    mask = torch.zeros(8, 11)
    mask[:, 2:] = 1.0
    return {"tokens": tokens, "loss_mask": mask, "rollout_logp": torch.zeros(8, 11),
            "advantages": torch.randn(8, generator=g)}


def make_tiny_hf_model(out: Path, family: str = "qwen2", tie: bool = False, seed: int = 0, layers: int = 2,
                       vocab: int = 96, with_tokenizer: bool = False, rope: dict | None = None, **config) -> Path:
    """A random Llama/Qwen2/Qwen3/Qwen3-MoE/DeepSeek-V3 created with `transformers` (no hub) and saved as an HF
    checkpoint directory; `config`: other config.json fields (heads, widths, experts...). Qwen3 gets an explicit
    head_dim that is not hidden / heads, Qwen3-MoE 4 experts (top-2) of width 32, DeepSeek-V3 MLA and 4 experts in
    2 groups with a shared one, unless `config` says otherwise (`ModelFamily.tiny_config`)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from megarl.models import get_family

    torch.manual_seed(seed)
    spec = get_family(family)  # megarl/models/<family>/: its transformers config class and tiny settings
    cls = getattr(transformers, spec.hf_config_class)
    shape = {**dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=64, **({"rope_parameters": rope} if rope else {})), **spec.tiny_config}
    cfg = cls(vocab_size=vocab, num_hidden_layers=layers, tie_word_embeddings=tie, **{**shape, **config})
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    if spec.qk_norm or spec.moe or spec.mla:
        randomize_qwen3_norms_and_router(model)
    model.save_pretrained(out)
    if with_tokenizer:
        from megarl.tasks.arithmetic import build_tokenizer

        build_tokenizer(out)
    return out


def build_test_starter() -> Path:
    """A briefly pre-trained starter model and its data, built by the real tool (300 steps).

    Built once per checkout under `.cache/test-starter-<hash of the tool and the task>` and reused by later
    sessions: the build is deterministic (a fixed step count) and atomic (the tool renames a finished directory
    into place), so a cached copy is exactly what a fresh build would give. A change to the tool or the task
    changes the hash and triggers a rebuild."""
    import hashlib

    sources = [REPO / "tools/make_starter_model.py", REPO / "megarl/tasks/arithmetic.py"]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:12]
    out = REPO / ".cache" / f"test-starter-{digest}"
    out.parent.mkdir(exist_ok=True)
    with open(out.parent / f"test-starter-{digest}.lock", "w") as lock:  # xdist workers: one builds, the other waits
        fcntl.flock(lock, fcntl.LOCK_EX)
        _build_test_starter(out)
    return out


def _build_test_starter(out: Path) -> None:
    if not (out / "model.safetensors").exists():
        proc = subprocess.run([sys.executable, str(REPO / "tools/make_starter_model.py"), "--out", str(out),
                               "--steps", "300", "--overwrite"],
                              env=env(), cwd=REPO, timeout=600, capture_output=True, text=True)
        if proc.returncode != 0 and not (out / "model.safetensors").exists():  # a concurrent session may have won
            raise AssertionError(f"building the test starter failed:\n{proc.stderr[-3000:]}")


def env(root: Path = REPO) -> dict:
    """The environment tests give their subprocesses: `root`'s megarl first on the path, one OpenMP thread."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(root) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    e["PYTHONWARNINGS"] = "ignore"
    return e


def torchrun(nproc: int, script: str, *args: str, timeout: float = 300, check: bool = True,
             port: int | None = None, extra_env: dict | None = None,
             root: Path = REPO, fork: bool = True) -> subprocess.CompletedProcess:
    """Run `script` under torchrun on `nproc` CPU processes; a hang fails after `timeout` seconds. `root`: the
    checkout it runs in (cwd and the first entry of PYTHONPATH), this one unless a test runs another commit.
    `fork`: torchrun's workers forked from a process that imported torch, megatron-core and transformers once
    (tests/forkrun.py says how and what stays the same); False, another checkout or MEGARL_TESTS_REAL_TORCHRUN=1
    run the real `python -m torch.distributed.run`, each worker a fresh interpreter."""
    import tempfile

    import forkrun

    fork = fork and root == REPO and os.environ.get("MEGARL_TESTS_REAL_TORCHRUN", "") in ("", "0")
    for _ in range(3):  # a free port can be taken by another job before torchrun binds it: then try another
        master = str(port or free_port())
        argv = ["--nproc-per-node", str(nproc), "--master-port", master, script, *map(str, args)]
        cmd = [sys.executable, "-m", "torch.distributed.run", *argv]
        run_env = {**env(root), **(extra_env or {})}
        proc = forkrun.torchrun(argv, run_env, str(root), timeout, tempfile.gettempdir(), env(root)) if fork else None
        if proc is None:
            proc = subprocess.run(cmd, cwd=root, env=run_env, capture_output=True, text=True, timeout=timeout)
        if port or not (proc.returncode and f"port: {master}" in proc.stderr and "EADDRINUSE" in proc.stderr):
            break
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed with {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a torchrun rendezvous or a process group's store)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def latest_step(ckpt: Path) -> int:
    """The step of the checkpoint `ckpt/latest` names (0: none yet)."""
    try:
        return int((Path(ckpt) / "latest").read_text().strip().removeprefix("iter_"))
    except (FileNotFoundError, ValueError):
        return 0


def metrics_by_step(out: Path) -> dict[int, dict]:
    """A run's metrics.jsonl records (`--output-dir out`), by step."""
    import json

    return {row["step"]: row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def train_two_steps_through_the_pool(starter: Path, data: Path, out: Path, reward_timeout: float) -> list[dict]:
    """`train.py` for 2 steps on DP=2 over `data` (rows naming their verifier), rewards from a pool of 2 reward
    workers; the steps' metrics.jsonl records."""
    import json

    torchrun(2, "megarl/train.py", "recipes/tiny_cpu.sh", "--hf-checkpoint", starter, "--prompt-data", data,
             "--eval-data", "", "--max-train-minutes", "0", "--num-steps", 2, "--rollout-batch-size", 8,
             "--n-samples-per-prompt", 4, "--micro-batch-size", 16, "--reward-workers", 2,
             "--reward-timeout", reward_timeout, "--output-dir", out, "--log-interval", 1, timeout=400)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def hf_reference(hf, temperature=0.7):
    """`transformers`' own fp32 logits for a fixed batch of random tokens (4 x 12, seed 1234), and the
    log-probs of each next token at `temperature`: the reference the Megatron workers' outputs are held to."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf).float().eval()
    tokens = torch.randint(0, model.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1234))
    with torch.no_grad():
        logits = model(tokens).logits
    logp = torch.log_softmax(logits[:, :-1] / temperature, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    return logits, logp


def make_tiny_reward_model(out, seed: int):
    """A random 2-layer Qwen2ForSequenceClassification (1 label) with the arithmetic task's tokenizer, at `out`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from megarl.tasks.arithmetic import build_tokenizer

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=64, num_labels=1,
                      pad_token_id=1)
    Qwen2ForSequenceClassification(cfg).float().eval().save_pretrained(out)
    build_tokenizer(out)
    return out


# `make test` runs the suite on two xdist workers (`-n 2 --dist loadgroup`): a 2-core machine is half idle while a
# test waits on its subprocesses' start-up. Each test file stays on one worker (its module fixtures are built once),
# and every file that runs sandboxes, code harnesses or Docker containers (all of tests/sandbox and tests/docker, and
# any other file naming them) goes to one worker in turn: those tests count host-wide processes, uids and
# containers, which another file's sandbox running beside them would change.
_HOST_STATE = re.compile(r"sandbox|harness|docker|pgrep|/proc/")
HOST_GROUP = "host-sandboxes"
# The folders whose tests need an environment of their own (`make sglang-env` ...), by environment name: `.ci/run`
# builds the environments while the rest of the suite runs, and these tests run last (tests/conftest.py).
ENV_FOLDERS = {"sglang": "sglang_cpu", "vllm": "vllm_cpu", "verifiers": "verifiers_env", "openenv": "openenv_cpu"}
ENV_BUILDS = "MEGARL_ENV_BUILDS"


def wait_for_env_build(name: str, timeout_s: float = 1800.0) -> None:
    """Wait for `.ci/run`'s build of environment `name` to end, when one is under way: $MEGARL_ENV_BUILDS names a
    folder with a `<name>.status` per build (`building`, then `ready` or `failed`; its log beside it). Without the
    variable, or once the build has ended, return at once: the caller then finds the environment or skips saying
    why, as before. A build still running after `timeout_s` fails the test naming it, rather than hang."""
    folder = os.environ.get(ENV_BUILDS)
    if not folder:
        return
    status = Path(folder) / f"{name}.status"
    deadline = time.monotonic() + timeout_s
    while status.exists() and status.read_text().strip() == "building":
        if time.monotonic() > deadline:
            raise AssertionError(f"the {name} environment's build has not ended in {timeout_s:.0f} s "
                                 f"({status}; its log: {status.with_suffix('.log')})")
        time.sleep(2)



def group_of(path: Path) -> str:
    """The xdist group of a test file: "host-sandboxes" or the file's name."""
    host = path.parent.name in ("sandbox", "docker") or _HOST_STATE.search(path.read_text())
    return HOST_GROUP if host else path.name


def randomize_qwen3_norms_and_router(model) -> None:
    """transformers initialises Qwen3's q/k norms and DeepSeek-V3's latent norms to ones (Qwen3-MoE's router to
    zeros, DeepSeek-V3's router bias too): random values make a weight-table or routing mistake show in the
    logits."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight", "q_a_layernorm.weight", "kv_a_layernorm.weight")):
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("mlp.gate.e_score_correction_bias"):
                b.normal_(0.0, 0.2)
