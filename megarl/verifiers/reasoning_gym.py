"""The `reasoning_gym` verifier: reasoning-gym's procedural tasks, scored by each task's own scorer.

A row's ground truth is the label `megarl-prepare-data reasoning-gym` writes (`megarl.tasks.reasoning_gym`):

    {"task": "basic_arithmetic", "config": {...}, "seed": 1, "size": 1000, "index": 17,
     "answer": "12" | None, "question_sha256": "...", "entry": {"question", "answer", "metadata"} (or none, below)}

The verifier reads the answer between the response's last `<answer>...</answer>` tags
(`reasoning_gym.utils.extract_answer`, reasoning-gym's own reader), then calls the task's
`score_answer(extracted, entry)` on the dataset the label describes (its config, seed and size), and the score is
the reward: `correct` when it is 1, `no_answer` when there were no tags (scored as None: most tasks give 0,
countdown 0.01), else `incorrect`. A task's partial credit stays what reasoning-gym says it is.

Pitfalls it handles, each tested:
- The default `score_answer` gives `len(oracle) / len(answer)` when the oracle is a substring of the answer, so a
  whole completion that mentions the answer earns credit: only the extracted answer is ever scored.
- Some tasks have no `answer` (graph_color, rush_hour, boxnet, propositional_logic, rubiks_cube): they score
  from `metadata`, so the label carries the whole entry.
- A JSON round trip changes some entries (arc_agi and rearc keep grids as tuples; after JSON they are lists and
  a right answer scores 0.05): their labels carry no entry, nor does any whose oracle answer scores otherwise
  after a round trip, or that is no JSON at all (`keeps_entry`), and the verifier rebuilds it from (task, config,
  seed, size, index), in which reasoning-gym's generation is deterministic. The label's `question_sha256` is
  checked against the rebuilt question, so a reasoning-gym release that generates other items is an error
  (`parse_error`), never a silent mis-score.

reasoning-gym is the `rg` extra (`pip install megarl[rg]`); this module imports it only when a verifier is built,
so the registry lists the verifier without it. No torch.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from typing import Any

from megarl.errors import ConfigError
from megarl.verifiers.base import VerifierCapabilities, VerifyResult, register_verifier

INSTALL_HINT = "reasoning-gym is not installed: pip install megarl[rg] (or pip install reasoning-gym==0.1.25)"
LABEL_KEYS = ("task", "config", "seed", "size", "index")
# Their grids are tuples of tuples; after JSON they are lists, and a right answer scores 0.05
REBUILT_TASKS = frozenset({"arc_agi", "rearc"})
_CACHE_DATASETS = 64  # datasets kept built, by (task, config, seed, size)
_CACHE_ENTRIES = 4096  # rebuilt entries kept, by dataset and index


def require_reasoning_gym():
    """The `reasoning_gym` module, or a ConfigError that says how to install it."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise ConfigError(f"{INSTALL_HINT} ({e})") from None
    return reasoning_gym


def task_names() -> list[str]:
    """Every task reasoning-gym registers, but `composite` (a mixture: list the tasks instead)."""
    require_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return sorted(n for n in DATASETS if n != "composite")


def check_task(name: str, flag: str = "TASK") -> None:
    """A ConfigError naming `flag` and a few valid names when `name` is no reasoning-gym task."""
    names = task_names()
    if name not in names:
        import difflib

        near = difflib.get_close_matches(name, names, n=5, cutoff=0.5) or names[:8]
        raise ConfigError(f"{flag}: unknown reasoning-gym task {name!r}; valid names include {', '.join(near)} "
                          f"({len(names)} in all: python -c 'from megarl.verifiers.reasoning_gym import task_names; "
                          "print(task_names())')")


def question_sha256(question: str) -> str:
    return hashlib.sha256(question.encode("utf-8")).hexdigest()[:16]


def keeps_entry(task: str, entry: dict, score_answer) -> bool:
    """Whether a label may carry `entry` as JSON: it is JSON (no objects, no sets), the task is not one whose
    entries JSON is known to change (arc_agi, rearc), and the oracle answer, where there is one, scores the same
    on the entry after a JSON round trip as before (`score_answer`: the task's scorer). Else the verifier rebuilds
    the entry from the dataset."""
    if task in REBUILT_TASKS:
        return False
    try:
        back = json.loads(json.dumps(entry))
    except (TypeError, ValueError):
        return False
    answer = entry.get("answer")
    return answer is None or score_answer(answer, back) == score_answer(answer, entry)


class Datasets:
    """reasoning-gym datasets built from labels, and their rebuilt entries, both kept in bounded caches."""

    def __init__(self) -> None:
        self._rg = require_reasoning_gym()
        self._datasets: OrderedDict[str, Any] = OrderedDict()
        self._entries: OrderedDict[tuple[str, int], dict] = OrderedDict()

    def dataset(self, task: str, config: dict, seed: int, size: int):
        key = json.dumps([task, config, seed, size], sort_keys=True)
        if key not in self._datasets:
            self._datasets[key] = self._rg.create_dataset(task, **{**config, "seed": seed, "size": size})
            if len(self._datasets) > _CACHE_DATASETS:
                self._datasets.popitem(last=False)
        self._datasets.move_to_end(key)
        return self._datasets[key]

    def entry(self, task: str, config: dict, seed: int, size: int, index: int) -> dict:
        key = (json.dumps([task, config, seed, size], sort_keys=True), index)
        if key not in self._entries:
            self._entries[key] = self.dataset(task, config, seed, size)[index]
            if len(self._entries) > _CACHE_ENTRIES:
                self._entries.popitem(last=False)
        self._entries.move_to_end(key)
        return self._entries[key]


def _label_error(label: Any) -> str | None:
    if not isinstance(label, dict):
        return f"the label is {type(label).__name__}, not a reasoning-gym label object (megarl-prepare-data)"
    missing = [k for k in LABEL_KEYS if k not in label]
    if missing:
        return f"the label has no {', '.join(missing)} (a reasoning-gym label needs {', '.join(LABEL_KEYS)})"
    return None


@register_verifier("reasoning_gym")
class ReasoningGymVerifier(VerifierCapabilities):
    name = "reasoning_gym"

    def __init__(self) -> None:
        self._datasets = Datasets()  # raises ConfigError naming the extra when reasoning-gym is missing
        from reasoning_gym.utils import extract_answer

        self._extract = extract_answer

    def verify(self, response: str, ground_truth: Any) -> VerifyResult:
        start = time.perf_counter()
        result = self._judge(str(response), ground_truth)
        result.seconds = time.perf_counter() - start
        return result

    def entry(self, label: dict) -> dict:
        """The entry `label` stands for: its own, or rebuilt from (task, config, seed, size, index) and checked."""
        if label.get("entry") is not None:
            return label["entry"]
        entry = self._datasets.entry(*(label[k] for k in LABEL_KEYS))
        expected = label.get("question_sha256")
        if expected is not None and question_sha256(entry["question"]) != expected:
            raise ValueError(f"item {label['index']} of {label['task']} rebuilt with another question than the row "
                             "was written with (another reasoning-gym release?)")
        return entry

    def _judge(self, response: str, label: Any) -> VerifyResult:
        if (error := _label_error(label)) is not None:
            return VerifyResult(0.0, "parse_error", normalized=error)
        extracted = self._extract(response)
        try:
            entry = self.entry(label)
            dataset = self._datasets.dataset(*(label[k] for k in LABEL_KEYS[:4]))
        except Exception as e:  # noqa: BLE001 - a label reasoning-gym cannot build: the row, not the response
            return VerifyResult(0.0, "parse_error", extracted=extracted,
                                normalized=f"{label['task']}: {type(e).__name__}: {e}")
        try:
            # None too, when there are no tags: the task decides what that earns (countdown: 0.01)
            score = float(dataset.score_answer(extracted, entry))
        except Exception as e:  # noqa: BLE001 - the task's scorer choked on this answer: it earns nothing
            return VerifyResult(0.0, "no_answer" if extracted is None else "incorrect", extracted=extracted,
                                normalized=f"the scorer raised {type(e).__name__}: {e}")
        outcome = "no_answer" if extracted is None else "correct" if score >= 1.0 else "incorrect"
        return VerifyResult(score, outcome, extracted=extracted, normalized=extracted)
