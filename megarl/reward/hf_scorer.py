"""A learned reward model: an HF `AutoModelForSequenceClassification` with one label, scoring prompt + response.

    rm = HFRewardModel("path/to/rm")                    # loaded once; `megarl-serve-rm` keeps one resident
    rm.score([("2+3=", "5", None), ...])                 # one float per row, in order

What a row's score is:
- The text is the prompt and the response rendered through the reward model's *own* tokenizer: its chat template
  when it has one (a chat prompt, a list of `{"role", "content"}` messages, as it is, else the prompt as one user
  message, then the response as the assistant turn), else the plain concatenation `prompt + response`.
- The score is the model's classification head on the hidden state of the last token of that text - what
  `transformers`' own forward returns for the unpadded text. Rows are batched, right-padded (left-padded with
  `padding_side="left"`), with the attention mask and the position ids of the real tokens, and the head is read
  at each row's own last token, so a score does not depend on the batch it came in, its padding, or on a token
  that happens to equal the pad id.
- Optional normalisation (`normalize=True`): (score - mean) / std with the `reward_mean` and `reward_std` stored in
  the checkpoint's config.json (`megarl-train-reward-model` stores the training set's).
- Texts longer than the model's `max_position_embeddings` keep their last tokens (where the response is).

This module imports torch and transformers; the verifiers (`megarl.reward.models`) reach it only through
the reward server (`megarl.cli.serve_rm`), a separate process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch

Row = tuple[Any, str, Any]  # (prompt: text or chat messages, response, label)


class HFRewardModel:
    def __init__(self, path: str | Path, batch_size: int = 16, normalize: bool = False, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, padding_side: str = "right"):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"--reward-model {path}: no config.json there (an HF checkpoint directory is expected)")
        config = json.loads((path / "config.json").read_text())
        arch = config.get("architectures") or []
        if not any(a.endswith("ForSequenceClassification") for a in arch):
            raise ValueError(f"--reward-model {path}: config.json architectures {arch} has no "
                             "*ForSequenceClassification "
                             "(a causal LM has no reward head; megarl-train-reward-model makes one)")
        if config.get("num_labels", len(config.get("id2label") or {0: 0})) != 1:
            raise ValueError(f"--reward-model {path}: a reward model has one label, this classifier has "
                             f"{len(config.get('id2label') or {})} (config.json id2label)")
        self.mean, self.std = 0.0, 1.0
        if normalize:
            if "reward_mean" not in config or "reward_std" not in config:
                raise ValueError(f"--reward-model-normalize: {path / 'config.json'} has no reward_mean/reward_std "
                                 "(megarl-train-reward-model stores them); drop the flag or add them")
            self.mean, self.std = float(config["reward_mean"]), max(float(config["reward_std"]), 1e-8)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=1, dtype=dtype)
        self.model.to(device).eval()
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
        self.device, self.batch_size, self.padding_side = device, batch_size, padding_side
        self.max_len = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        self.path = str(path)

    def text(self, prompt: Any, response: str) -> str:
        """The text scored for one row (see the module docstring)."""
        if getattr(self.tokenizer, "chat_template", None):
            messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
            messages.append({"role": "assistant", "content": response})
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        if isinstance(prompt, list):
            prompt = "".join(m.get("content", "") for m in prompt)
        return str(prompt) + response

    def token_ids(self, prompt: Any, response: str) -> list[int]:
        ids = self.tokenizer(self.text(prompt, response), add_special_tokens=False)["input_ids"]
        if not ids:  # an empty text still gets a score: the model's on one pad-free token, eos (or 0)
            ids = [self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0]
        return ids[-self.max_len :] if self.max_len else ids

    @torch.no_grad()
    def score(self, rows: Sequence[Row]) -> list[float]:
        """One score per (prompt, response, label) row, in order; the label is not used."""
        ids = [self.token_ids(p, r) for p, r, _ in rows]
        out: list[float] = []
        for i in range(0, len(ids), self.batch_size):
            out.extend(self._score_ids(ids[i : i + self.batch_size]))
        return [(s - self.mean) / self.std for s in out]

    def _score_ids(self, batch: list[list[int]]) -> list[float]:
        return self.forward_ids(batch).float().view(-1).tolist()

    def forward_ids(self, batch: list[list[int]]) -> torch.Tensor:
        """[B] raw scores of token-id rows (differentiable when grad is on: `megarl-train-reward-model`)."""
        width = max(len(x) for x in batch)
        tokens = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, x in enumerate(batch):
            cols = slice(0, len(x)) if self.padding_side == "right" else slice(width - len(x), width)
            tokens[row, cols] = torch.tensor(x)
            mask[row, cols] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)  # each row's real tokens at 0, 1, ... whatever its padding
        base = getattr(self.model, self.model.base_model_prefix)
        hidden = base(input_ids=tokens.to(self.device), attention_mask=mask.to(self.device),
                      position_ids=positions.to(self.device)).last_hidden_state
        last = torch.tensor([len(x) - 1 if self.padding_side == "right" else width - 1 for x in batch],
                            device=hidden.device)
        pooled = hidden[torch.arange(len(batch), device=hidden.device), last]
        return self._head(pooled).view(-1)

    def _head(self, pooled: torch.Tensor) -> torch.Tensor:
        head = getattr(self.model, "score", None) or getattr(self.model, "classifier", None)
        if head is None:
            raise ValueError(f"--reward-model {self.path}: {type(self.model).__name__} has no `score` (or "
                             "`classifier`) head; a decoder sequence classifier (Qwen2, Llama...) is expected")
        return head(pooled)
