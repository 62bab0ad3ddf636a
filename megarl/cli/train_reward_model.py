"""Train a small sequence-classification reward model (one label) and save it as an ordinary HF checkpoint.

    megarl-train-reward-model --init DIR --out RM_DIR --data rows.jsonl [--steps 600] [--lr 3e-4]
    megarl-train-reward-model --init STARTER --out RM_DIR --arithmetic STARTER \
        --policy-samples 8 --calibrate --steps 1000                                      # the CPU demo's RM

`--init` is an HF causal LM (or a sequence classifier) whose trunk the reward model starts from; its head is new.
The rows, jsonl, are either preference pairs `{"prompt", "chosen", "rejected"}`, trained with the Bradley-Terry
loss -log sigmoid(s_chosen - s_rejected), or labelled responses `{"prompt", "response", "label"}` (label 0/1),
trained with binary cross-entropy on the score as a logit (`--calibrate` adds that to pairs too, so that a score's
sign says right or wrong, not only its order). `--arithmetic DIR` makes the demo's pairs instead: for
each problem of DIR/train.jsonl, the answer the arithmetic verifier calls correct against answers it calls wrong
(off by 1-3, a digit too many, none at all) - the verifier's labels, so the reward model learns to stand in for
it. `--policy-samples K` adds the mistakes the policy actually makes: K responses per problem sampled from
`--policy` (the starter RL begins from; default `--init`), each one the verifier calls wrong paired against the
right answer. `--far-negatives` adds wrong answers unlike the starter's (digits dropped, random numbers, stray
characters), the drift a policy exploits otherwise; `--listwise K` trains each prompt's right answer against K of
its wrong ones at once (softmax cross-entropy: the hard negatives weigh most) instead of pair by pair. Texts
are what `megarl.reward.hf_scorer.HFRewardModel` scores (prompt + response through the tokenizer's chat
template when it has one), so training and scoring read the same tokens.

Reported at the end, on DIR/heldout.jsonl's problems when given (problems never trained on; their sampled pairs
too, drawn with seed + 1), else on the last
10% of the rows: pairwise accuracy (the chosen response scores higher) and accuracy of the score's sign against
the labels. config.json also gets `reward_mean` / `reward_std` (the scores of the training responses) for
`--reward-model-normalize`. Bound by `--steps` only, so every machine trains the same model.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch

from megarl.verifiers.arithmetic import ArithmeticVerifier


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megarl-train-reward-model", description=__doc__.split("\n\n")[0])
    p.add_argument("--init", required=True, type=Path, help="HF checkpoint the reward model's trunk starts from")
    p.add_argument("--out", required=True, type=Path, help="directory to write the reward model to")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", type=Path, help="jsonl of pairs {prompt, chosen, rejected} or {prompt, response, label}")
    src.add_argument("--arithmetic", type=Path, help="the demo task's directory (train.jsonl, heldout.jsonl): pairs "
                     "labelled by the arithmetic verifier")
    p.add_argument("--policy-samples", type=int, default=0, help="with --arithmetic: also sample this many responses "
                   "per problem from --policy (a causal LM: the policy RL starts from) and pair the right answer with "
                   "each sample the verifier calls wrong")
    p.add_argument("--policy", type=Path, help="with --policy-samples: the causal LM to sample from (the policy RL "
                   "starts from), when the reward model's trunk (--init) is another model; default --init")
    p.add_argument("--far-negatives", action="store_true", help="with --arithmetic: also pair the right answer with "
                   "wrong responses unlike the starter's (a digit dropped, reversed, random numbers, stray "
                   "characters: far_misses), which a policy otherwise finds and exploits")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps (the schedule's length)")
    p.add_argument("--batch-size", type=int, default=64, help="pairs (or labelled rows) per step")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (AdamW, cosine to 10%%)")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear learning-rate warm-up over this many steps "
                   "(0 = none), as tools/make_starter_model.py's")
    p.add_argument("--adam-beta2", type=float, default=0.999, help="AdamW's beta2 (make_starter_model.py uses 0.98)")
    p.add_argument("--eval-train-problems", type=int, default=0, help="with --arithmetic and --policy-samples: also "
                   "report the accuracies on this many training problems (fresh samples, drawn with seed + 2), the "
                   "prompts RL trains on")
    p.add_argument("--add-layers", type=int, default=0, help="new decoder layers on top of --init's (a Qwen2/Llama-"
                   "style decoder), their attention and MLP output projections zero, so that the model starts as "
                   "--init's trunk and the new layers can compare the response with what the lower ones predict")
    p.add_argument("--freeze-init", action="store_true", help="with --add-layers: keep --init's embeddings and "
                   "layers as they are and train only the added layers, the final norm and the head")
    p.add_argument("--listwise", type=int, default=0, metavar="K", help="pairs: train each step on --batch-size / "
                   "(K + 1) prompts, each prompt's right answer against K of its wrong ones (drawn from its pairs), "
                   "with the softmax cross-entropy of the right one among the K + 1 (a ranking loss: the hard "
                   "negatives weigh most) instead of one Bradley-Terry term per pair; 0 = pairs")
    p.add_argument("--calibrate", action="store_true", help="pairs also train the chosen score towards positive and "
                   "the rejected towards negative (binary cross-entropy), so that the sign of a score says right or "
                   "wrong (what --reward-model-threshold 0 and rm_agreement read)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def near_misses(answer: str, rng: random.Random) -> list[str]:
    """Responses the arithmetic verifier calls wrong: off by 1-3, a digit too many, no answer."""
    c = int(answer)
    off = [str(c + d) for d in (-3, -2, -1, 1, 2, 3) if c + d >= 0]
    return off + [answer + str(rng.randrange(10)), ""]


_JUNK = "abcxyz+-=.?"


def far_misses(answer: str, rng: random.Random) -> list[str]:
    """Wrong responses further from the answer than `near_misses`, the kinds a policy drifts to once it exploits
    a reward model: each digit dropped, the digits reversed, two random numbers 0-100 and a random single digit
    (none equal to the answer), a leading zero, a minus sign, a character after the answer, no digit at all."""
    c = int(answer)
    out = [answer[:i] + answer[i + 1 :] for i in range(len(answer))] if len(answer) > 1 else []
    out += [answer[::-1]] if answer[::-1] != answer else []
    out += [str(x) for x in rng.sample([x for x in range(101) if x != c], 2)]
    out += [str(rng.choice([x for x in range(10) if x != c]))]
    out += ["0" + answer, "-" + answer, answer + rng.choice(_JUNK), "".join(rng.choices(_JUNK, k=rng.randint(1, 3)))]
    return out


def arithmetic_pairs(path: Path, rng: random.Random, far: bool = False) -> list[dict]:
    """One pair per wrong response of every problem in `path` (`near_misses`, and `far_misses` when `far`), each
    side labelled by the verifier."""
    verifier, pairs = ArithmeticVerifier(), []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        good = row["answer"]
        assert verifier.verify(good, row["answer"]).outcome == "correct"
        for bad in near_misses(good, rng) + (far_misses(good, rng) if far else []):
            if verifier.verify(bad, row["answer"]).outcome != "correct":
                pairs.append({"prompt": row["prompt"], "chosen": good, "rejected": bad})
    return pairs


@torch.no_grad()
def sample_responses(lm, tokenizer, prompts: list[str], n: int, seed: int, max_new_tokens: int = 8,
                     temperature: float = 1.0) -> list[list[str]]:
    """`n` responses per prompt from the causal LM `lm` (what the actor samples before RL), text up to the first
    eos. Prompts are grouped by length so no padding is needed; seeded, so every machine samples the same."""
    lm.eval()
    gen, eos, vocab = torch.Generator().manual_seed(seed), tokenizer.eos_token_id, len(tokenizer)
    by_length: dict[int, list[int]] = {}
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    for i, x in enumerate(ids):
        by_length.setdefault(len(x), []).append(i)
    out: list[list[str]] = [[] for _ in prompts]
    for length, members in sorted(by_length.items()):
        seqs = torch.tensor([ids[i] for i in members for _ in range(n)])
        for _ in range(max_new_tokens):
            logits = lm(input_ids=seqs, use_cache=False).logits[:, -1, :vocab]  # never a padding-only id
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)
            seqs = torch.cat([seqs, nxt], dim=1)
            if (seqs[:, length:] == eos).any(-1).all():
                break
        for row, tokens in enumerate(seqs[:, length:].tolist()):
            tokens = tokens[: tokens.index(eos)] if eos in tokens else tokens
            out[members[row // n]].append(tokenizer.decode(tokens, skip_special_tokens=True))
    return out


def policy_pairs(problems: list[dict], samples: list[list[str]]) -> list[dict]:
    """The right answer against each sample the arithmetic verifier calls wrong, duplicates kept: the mistakes the
    policy makes, as often as it makes them."""
    verifier = ArithmeticVerifier()
    return [{"prompt": row["prompt"], "chosen": row["answer"], "rejected": s}
            for row, ss in zip(problems, samples) for s in ss
            if verifier.verify(s, row["answer"]).outcome != "correct"]


def sampled_pairs(init: Path, path: Path, n: int, seed: int, subset: int = 0) -> list[dict]:
    """policy_pairs of `n` samples per problem of `path` (of `subset` of them, drawn with `seed`, when > 0)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    problems = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if subset:
        problems = random.Random(seed).sample(problems, min(subset, len(problems)))
    lm = AutoModelForCausalLM.from_pretrained(str(init), dtype=torch.float32)
    samples = sample_responses(lm, AutoTokenizer.from_pretrained(str(init)), [r["prompt"] for r in problems], n, seed)
    return policy_pairs(problems, samples)


def read_rows(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}:{n}: not valid JSON ({e.msg})") from None
        pair = isinstance(row, dict) and {"prompt", "chosen", "rejected"} <= set(row)
        labelled = isinstance(row, dict) and {"prompt", "response", "label"} <= set(row)
        if not pair and not labelled:
            raise SystemExit(f"{path}:{n}: expected {{prompt, chosen, rejected}} or {{prompt, response, label}}")
        rows.append(row)
    if not rows:
        raise SystemExit(f"{path}: no rows")
    return rows


def init_model(src: Path, out: Path, add_layers: int = 0) -> None:
    """`src`'s trunk with a new one-label head (and `add_layers` new decoder layers on top, their output
    projections zero), saved to `out` with its tokenizer (pad id set)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    model = AutoModelForSequenceClassification.from_pretrained(str(src), num_labels=1, dtype=torch.float32)
    if add_layers:
        config = AutoConfig.from_pretrained(str(src), num_labels=1)
        n = config.num_hidden_layers
        config.num_hidden_layers = n + add_layers
        if getattr(config, "layer_types", None):
            config.layer_types = list(config.layer_types) + [config.layer_types[-1]] * add_layers
        deeper = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        missing = deeper.load_state_dict(model.state_dict(), strict=False).missing_keys
        assert all(".layers." in k and int(k.split(".layers.")[1].split(".")[0]) >= n for k in missing), missing
        with torch.no_grad():
            for layer in getattr(deeper, deeper.base_model_prefix).layers[n:]:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
        model = deeper
    model.config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    torch.nn.init.normal_(model.score.weight, std=1.0 / math.sqrt(model.config.hidden_size))
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))


def learning_rate_factor(step: int, steps: int, warmup: int = 0) -> float:
    """The schedule's factor on --lr at `step`: linear warm-up over `warmup` steps, times cosine to 10%."""
    return min(1.0, (step + 1) / warmup if warmup else 1.0) * \
        (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps)))


def loss_of(rm, batch: list[dict], calibrate: bool = False) -> torch.Tensor:
    pairs = [r for r in batch if "chosen" in r]
    labelled = [r for r in batch if "chosen" not in r]
    loss = torch.zeros(())
    if pairs:
        ids = [rm.token_ids(r["prompt"], r["chosen"]) for r in pairs] + \
            [rm.token_ids(r["prompt"], r["rejected"]) for r in pairs]
        s = rm.forward_ids(ids)
        loss = loss - torch.nn.functional.logsigmoid(s[: len(pairs)] - s[len(pairs) :]).sum()
        if calibrate:  # -log sigmoid(s_chosen) - log sigmoid(-s_rejected), averaged over the two
            loss = loss - 0.5 * (torch.nn.functional.logsigmoid(s[: len(pairs)]) +
                                 torch.nn.functional.logsigmoid(-s[len(pairs) :])).sum()
    if labelled:
        s = rm.forward_ids([rm.token_ids(r["prompt"], r["response"]) for r in labelled])
        y = torch.tensor([float(r["label"]) for r in labelled])
        loss = loss + torch.nn.functional.binary_cross_entropy_with_logits(s, y, reduction="sum")
    return loss / len(batch)


def listwise_loss_of(rm, groups: list[tuple[str, str, list[str]]], calibrate: bool = False) -> torch.Tensor:
    """Each group (prompt, right answer, K wrong answers): -log softmax(scores)[right], averaged over the groups;
    `calibrate` adds the binary cross-entropy of every score's sign, as for pairs."""
    k = len(groups[0][2])
    ids = [rm.token_ids(prompt, r) for prompt, right, wrong in groups for r in [right, *wrong]]
    s = rm.forward_ids(ids).view(len(groups), k + 1)
    loss = -torch.log_softmax(s, dim=1)[:, 0].mean()
    if calibrate:
        labels = torch.zeros_like(s)
        labels[:, 0] = 1.0
        bce = torch.nn.functional.binary_cross_entropy_with_logits(s, labels, reduction="none")
        loss = loss + bce.sum(1).mean() / 2
    return loss


def listwise_groups(pairs: list[dict]) -> list[tuple[str, str, list[str]]]:
    """Pairs grouped by prompt: (prompt, right answer, every wrong answer paired with it), in first-seen order."""
    by_prompt: dict[str, tuple[str, list[str]]] = {}
    for r in pairs:
        by_prompt.setdefault(r["prompt"], (r["chosen"], []))[1].append(r["rejected"])
    return [(prompt, right, wrong) for prompt, (right, wrong) in by_prompt.items()]


def sample_groups(groups, n: int, k: int, rng: random.Random) -> list[tuple[str, str, list[str]]]:
    """`n` groups, each with `k` of its wrong answers (drawn without replacement while there are enough)."""
    out = []
    for prompt, right, wrong in rng.sample(groups, min(n, len(groups))):
        picked = rng.sample(wrong, k) if len(wrong) >= k else [rng.choice(wrong) for _ in range(k)]
        out.append((prompt, right, picked))
    return out


@torch.no_grad()
def evaluate(rm, rows: list[dict]) -> dict:
    pairs = [r for r in rows if "chosen" in r]
    labelled = [r for r in rows if "chosen" not in r]
    out = {}
    if pairs:
        c = rm.score([(r["prompt"], r["chosen"], None) for r in pairs])
        j = rm.score([(r["prompt"], r["rejected"], None) for r in pairs])
        out["pairwise_accuracy"] = sum(a > b for a, b in zip(c, j)) / len(pairs)
        out["sign_accuracy"] = (sum(a > 0 for a in c) + sum(b <= 0 for b in j)) / (2 * len(pairs))
    if labelled:
        s = rm.score([(r["prompt"], r["response"], None) for r in labelled])
        out["label_accuracy"] = sum((x > 0) == bool(r["label"]) for x, r in zip(s, labelled)) / len(labelled)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.freeze_init and not args.add_layers:  # before any sampling or model loading
        raise SystemExit("--freeze-init needs --add-layers (else nothing but the head would train)")
    from megarl.reward.hf_scorer import HFRewardModel

    train_problems: list[dict] = []
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    if args.arithmetic:
        train = arithmetic_pairs(args.arithmetic / "train.jsonl", rng, args.far_negatives)
        held = args.arithmetic / "heldout.jsonl"
        test = arithmetic_pairs(held, rng, args.far_negatives) if held.is_file() else []
        if args.policy_samples:
            policy = args.policy or args.init
            train += sampled_pairs(policy, args.arithmetic / "train.jsonl", args.policy_samples, args.seed)
            if held.is_file():
                test += sampled_pairs(policy, held, args.policy_samples, args.seed + 1)
            if args.eval_train_problems:
                train_problems = sampled_pairs(policy, args.arithmetic / "train.jsonl", args.policy_samples,
                                               args.seed + 2, subset=args.eval_train_problems)
    else:
        rows = read_rows(args.data)
        rng.shuffle(rows)
        cut = max(1, len(rows) // 10) if len(rows) >= 10 else 0
        train, test = rows[cut:], rows[:cut]
    groups = listwise_groups([r for r in train if "chosen" in r]) if args.listwise else []
    if args.listwise and not groups:
        raise SystemExit("--listwise needs preference pairs {prompt, chosen, rejected}")
    tmp = args.out.with_name("." + args.out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    init_model(args.init, tmp, args.add_layers)
    rm = HFRewardModel(tmp, batch_size=256)
    if args.freeze_init:
        base = getattr(rm.model, rm.model.base_model_prefix)
        n = len(base.layers) - args.add_layers
        for p in [*base.embed_tokens.parameters(), *(q for layer in base.layers[:n] for q in layer.parameters())]:
            p.requires_grad_(False)
    trained = [p for p in rm.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=args.lr, betas=(0.9, args.adam_beta2), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: learning_rate_factor(s, args.steps, args.warmup_steps))
    print(f"train_reward_model: {len(train)} training rows, {len(test)} held-out rows, {args.steps} steps", flush=True)
    start, losses = time.time(), []
    rm.model.train()
    for step in range(1, args.steps + 1):
        if groups:
            loss = listwise_loss_of(rm, sample_groups(groups, max(1, args.batch_size // (args.listwise + 1)),
                                                      args.listwise, rng), args.calibrate)
        else:
            loss = loss_of(rm, rng.sample(train, min(args.batch_size, len(train))), args.calibrate)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == args.steps:
            print(f"step {step}: loss {sum(losses[-100:]) / len(losses[-100:]):.4f} ({time.time() - start:.0f} s)",
                  flush=True)
    rm.model.eval()
    responses = [(r["prompt"], r.get("chosen", r.get("response")), None) for r in train[:2000]]
    scores = rm.score(responses) + rm.score([(r["prompt"], r["rejected"], None) for r in train[:2000]
                                             if "rejected" in r])
    mean = sum(scores) / len(scores)
    std = math.sqrt(sum((x - mean) ** 2 for x in scores) / len(scores))
    rm.model.config.reward_mean, rm.model.config.reward_std = mean, std
    rm.model.save_pretrained(str(tmp))
    metrics = {"train": evaluate(rm, train[:2000]), "heldout": evaluate(rm, test) if test else {},
               **({"train_problems_policy_pairs": evaluate(rm, train_problems)} if train_problems else {}),
               "steps": args.steps, "seconds": round(time.time() - start, 1), "reward_mean": mean, "reward_std": std}
    (tmp / "reward_model_eval.json").write_text(json.dumps(metrics, indent=2))
    shutil.rmtree(args.out, ignore_errors=True)
    tmp.rename(args.out)
    print(f"train_reward_model: saved {args.out}; {json.dumps(metrics)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
