"""Prompt datasets (jsonl or parquet) and the seeded, resumable order in which prompts are drawn.

A row holds the prompt, the verifier's ground truth and (optionally) the verifier's name. The prompt field is
either a string, tokenized as it is, or a chat: a list of `{"role", "content"}` messages rendered through the
tokenizer's chat template with the assistant turn opened (`add_generation_prompt=True`), as the model will see
it at generation time. With `--apply-chat-template` a string prompt becomes a one-message user chat.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from megarl.errors import ConfigError


@dataclass
class PromptRecord:
    index: int  # position in the loaded dataset (0-based; what samples' `prompt_index` refers to)
    prompt: str  # the text the model sees: a chat is stored rendered through the chat template
    prompt_ids: list[int]
    label: Any  # the verifier's ground truth
    verifier: str
    source: str = field(default="", compare=False)  # where the row came from: `file:line` or `file: row N`
    raw_prompt: Any = field(default=None, compare=False)  # the row's prompt field as given (text or chat), which a
    # reward model renders through its own tokenizer's template
    row_source: str = field(default="", compare=False)  # the row's own `source` field ("humaneval:12"), "" when it
    # has none: `megarl-eval` reports figures by it (`megarl.evaluation.subset`)
    teacher: str = field(default="", compare=False)  # the row's `teacher` field: which --teacher scores its samples
    # (on-policy distillation with several teachers); "" = the first


def load_prompts(path: str, tokenizer, *, input_key: str, label_key: str, verifier_key: str,
                 default_verifier: str = "", apply_chat_template: bool = False,
                 flag: str = "--prompt-data",
                 spec_error: Callable[[str], str | None] | None = None) -> list[PromptRecord]:
    """Read and validate every row before training starts; errors name the file and line (jsonl) or row
    (parquet). A `.parquet` path is read as parquet, any other as jsonl. `spec_error(verifier)`: why a row's
    verifier field is no valid reward spec, or None (the trainer passes `megarl.reward.compose.spec_error`; data
    knows nothing of rewards, so without it the field is only checked to be text)."""
    p = Path(path)
    if not path:
        raise ConfigError(f"{flag} is required")
    if not p.is_file():
        raise ConfigError(f"{flag} {path}: no such file")
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("--apply-chat-template: the --hf-checkpoint's tokenizer has no chat template (neither its "
                          "tokenizer_config.json nor a chat_template.jinja defines one); drop --apply-chat-template "
                          f"to give the {flag} prompts to the model as the plain text they are, or use a checkpoint "
                          "whose tokenizer has a chat template")
    records = []
    rows = _parquet_rows(p, flag) if p.suffix == ".parquet" else _jsonl_rows(p)
    for where, row in rows:
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for key in (input_key, label_key):
            if key not in row:
                hint = "; for chat data pass --input-key messages" if key == input_key and "messages" in row else ""
                raise ConfigError(f"{where}: missing field {key!r} (fields: {', '.join(row) or 'none'}){hint}")
        verifier = row.get(verifier_key) or default_verifier
        if not verifier:
            raise ConfigError(f"{where}: no {verifier_key!r} field and no --default-verifier")
        if not isinstance(verifier, str):
            raise ConfigError(f"{where}: field {verifier_key!r} must be text (a verifier name or a reward spec)")
        if spec_error is not None and (error := spec_error(verifier)):
            raise ConfigError(f"{where}: {error}")
        text, ids = _render_prompt(row[input_key], tokenizer, apply_chat_template, f"{where}: field {input_key!r}")
        tag = row.get("source")
        teacher = row.get("teacher") or ""
        if not isinstance(teacher, str):
            raise ConfigError(f"{where}: field 'teacher' must be text (the name of one of --teacher's teachers)")
        records.append(PromptRecord(len(records), text, ids, row[label_key], verifier, where, row[input_key],
                                    tag if isinstance(tag, str) else "", teacher))
    if not records:
        raise ConfigError(f"{flag} {path}: the file has no rows")
    return records


def split_by_length(records: list[PromptRecord], limit: int) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(the prompts of at most `limit` tokens, renumbered in order; the longer ones), as peers filter over-long
    prompts rather than truncate them: a cut prompt would ask a different question."""
    kept = [r for r in records if len(r.prompt_ids) <= limit]
    long = [r for r in records if len(r.prompt_ids) > limit]
    return [replace(r, index=i) for i, r in enumerate(kept)], long


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open() as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not valid JSON ({e.msg})") from None


def _parquet_rows(path: Path, flag: str) -> Iterator[tuple[str, Any]]:
    """Rows as plain Python values (a list<struct> column of messages becomes a list of dicts), in batches so a
    large file is never held as Python objects all at once."""
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{flag} {path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
        reader = pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as e:  # ArrowInvalid, OSError ("Couldn't deserialize thrift"),
        # FileNotFoundError: a file that is not parquet, or not there
        raise ConfigError(f"{flag} {path}: not a readable parquet file ({e})") from None
    index = 0
    for batch in reader.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            yield f"{path}: row {index}", row
            index += 1


def _render_prompt(value: Any, tokenizer, apply_chat_template: bool, where: str) -> tuple[str, list[int]]:
    """(text, token ids) of a prompt field: a string, or a chat rendered with the opened assistant turn."""
    if isinstance(value, str) and value and not apply_chat_template:
        return value, tokenizer.encode(value)
    if isinstance(value, str) and value:
        value = [{"role": "user", "content": value}]
    elif not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"{where} must be a non-empty string or a list of chat messages ({{role, content}})")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ConfigError(f"{where}: message {i} must be an object with string 'role' and 'content', got {m!r}")
        messages.append({k: v for k, v in m.items() if v is not None})  # parquet fills absent struct fields with None
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{where} is a chat (a list of messages), but the --hf-checkpoint's tokenizer has no chat "
                          "template: give plain-text prompts, or a checkpoint whose tokenizer_config.json (or "
                          "chat_template.jinja) defines one")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template already wrote any BOS / special tokens it wants: adding them again would double them.
    return text, tokenizer.encode(text, add_special_tokens=False)


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
