"""Prompt datasets (jsonl) and the seeded, resumable order in which prompts are drawn."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.config import ConfigError


@dataclass
class PromptRecord:
    index: int  # row number in the file (0-based)
    prompt: str
    prompt_ids: list[int]
    label: Any  # the verifier's ground truth
    verifier: str


def load_prompts(path: str, tokenizer, *, input_key: str, label_key: str, verifier_key: str,
                 default_verifier: str = "", flag: str = "--prompt-data") -> list[PromptRecord]:
    """Read and validate every row before training starts; errors name the file and line."""
    from megarl.verifiers import verifier_names

    p = Path(path)
    if not path:
        raise ConfigError(f"{flag} is required")
    if not p.is_file():
        raise ConfigError(f"{flag} {path}: no such file")
    known = set(verifier_names())
    records = []
    with p.open() as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{where}: expected a JSON object, got {type(row).__name__}")
            for key in (input_key, label_key):
                if key not in row:
                    raise ConfigError(f"{where}: missing field {key!r} (fields: {', '.join(row) or 'none'})")
            if not isinstance(row[input_key], str) or not row[input_key]:
                raise ConfigError(f"{where}: field {input_key!r} must be a non-empty string")
            verifier = row.get(verifier_key) or default_verifier
            if not verifier:
                raise ConfigError(f"{where}: no {verifier_key!r} field and no --default-verifier")
            if verifier not in known:
                raise ConfigError(f"{where}: unknown verifier {verifier!r}; registered: {', '.join(sorted(known))}")
            ids = tokenizer.encode(row[input_key])
            records.append(PromptRecord(len(records), row[input_key], ids, row[label_key], verifier))
    if not records:
        raise ConfigError(f"{flag} {path}: the file has no rows")
    return records


class PromptSampler:
    """Draws global batches of prompts epoch by epoch; `state_dict()` resumes at the exact position."""

    def __init__(self, num_prompts: int, seed: int, shuffle: bool = True):
        self.num_prompts, self.seed, self.shuffle = num_prompts, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(self.num_prompts))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_indices(self, count: int) -> list[int]:
        out = []
        while len(out) < count:
            if self.position == self.num_prompts:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._make_order()
            take = min(count - len(out), self.num_prompts - self.position)
            out.extend(self._order[self.position : self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._make_order()
