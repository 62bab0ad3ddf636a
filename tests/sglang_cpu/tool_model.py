"""A tiny model that has learned by heart to answer four `a*b=` problems by calling the python tool (the tool-use
demo's exchange, `megarl.tasks.multiplication`): made in seconds, so that a test can watch a real engine emit a
tool call, the real tool run, and the engine continue after the tool's output."""

import importlib.util
import random
from pathlib import Path

import torch
from helpers import REPO, make_tiny_hf_model

from megarl.tasks.arithmetic import Problem, build_tokenizer, write_jsonl
from megarl.tasks.multiplication import CHARS

PROBLEMS = [Problem(f"mul-{a}-{b}", f"{a}*{b}=", str(a * b)) for a, b in ((123, 45), (678, 12), (905, 37), (214, 88))]


def _starter_tool():
    spec = importlib.util.spec_from_file_location("make_tool_starter_model", REPO / "tools/make_tool_starter_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_tool_model(out: Path, steps: int = 300, lr: float = 3e-3) -> Path:
    """`out`: an HF checkpoint with its tokenizer and `train.jsonl` (the four problems); every row a demonstration,
    learned for `steps` full-batch Adam steps (a fixed count, so the same model everywhere)."""
    from transformers import AutoTokenizer

    make_tiny_hf_model(out, vocab=len(CHARS) + 2, max_position_embeddings=128)
    build_tokenizer(out, chars=CHARS)
    write_jsonl(out / "train.jsonl", PROBLEMS)
    tool = _starter_tool()
    tokenizer = AutoTokenizer.from_pretrained(out)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    batches = tool.make_batches(PROBLEMS, tokenizer, random.Random(0), tool_share=1.0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        loss = tool.batch_loss(model, batches)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out)
    return out, float(loss)
