"""reasoning-gym's procedural tasks as megarl rows (`megarl-prepare-data reasoning-gym`), for the
`reasoning_gym` verifier.

    megarl-prepare-data reasoning-gym TASK[,TASK...] OUT.jsonl --size N --seed S [--config JSON]
        [--template "...{question}..."] [--exclude-from TRAIN.jsonl]

Each task's items 0..N-1 of `reasoning_gym.create_dataset(TASK, seed=S, size=N, **config)`, one row each:
`{"id", "prompt", "answer", "verifier": "reasoning_gym"}` whose answer is the label the verifier rescores from
(`megarl.verifiers.reasoning_gym`): task, config, seed, size, index, the oracle answer (None for tasks that score
from metadata), and the whole entry unless a JSON round trip would change how it scores (arc_agi, rearc: then
the verifier rebuilds it, checked by `question_sha256`).

`--config` is one task's settings (`{"min_terms": 2, "max_terms": 2}`), or with several tasks an object keyed by
task name. A held-out split is another seed with `--exclude-from` the training file: items whose question is in
that file are left out and counted. Most tasks make item i of seed S from `Random(S + i)`, so seed 2 is seed 1
shifted by one item: a held-out seed whose range [S, S + size) meets the training file's is refused.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

from megarl.errors import ConfigError
from megarl.verifiers.reasoning_gym import (LABEL_KEYS, check_task, question_sha256, require_reasoning_gym,
                                             keeps_entry)

VERIFIER = "reasoning_gym"
TEMPLATE = "{question}\nGive only the final answer between <answer> and </answer>."


def parse_tasks(text: str) -> list[str]:
    """`TASK[,TASK...]`, each checked against reasoning-gym's registry."""
    require_reasoning_gym()
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    if not tasks:
        raise ConfigError("TASK: name at least one reasoning-gym task (e.g. basic_arithmetic)")
    if len(set(tasks)) != len(tasks):
        raise ConfigError(f"TASK: {text!r} names a task twice")
    for t in tasks:
        check_task(t)
    return tasks


def task_configs(tasks: list[str], config: str | dict | None) -> dict[str, dict]:
    """Each task's settings from `--config`: one object for a single task, or an object keyed by task name."""
    if config is None or config == "":
        return {t: {} for t in tasks}
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--config: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"--config: expected a JSON object, got {type(config).__name__}")
    if len(tasks) > 1 or (config and set(config) <= set(tasks)):
        unknown = sorted(set(config) - set(tasks))
        if unknown:
            raise ConfigError(f"--config: with several tasks, an object keyed by task name ({', '.join(tasks)}); "
                              f"{unknown[0]!r} is none of them")
        bad = [t for t, c in config.items() if not isinstance(c, dict)]
        if bad:
            raise ConfigError(f"--config: the settings of {bad[0]!r} must be a JSON object")
        return {t: dict(config.get(t, {})) for t in tasks}
    return {tasks[0]: dict(config)}


def build_dataset(task: str, config: dict, seed: int, size: int):
    """`reasoning_gym.create_dataset`, its errors (an unknown setting, a bad value) as ConfigErrors on --config."""
    rg = require_reasoning_gym()
    for key in ("seed", "size"):
        if key in config:
            raise ConfigError(f"--config: {key!r} is set by --{key}, not in --config")
    try:
        return rg.create_dataset(task, **{**config, "seed": seed, "size": size})
    except (TypeError, ValueError, AssertionError) as e:
        raise ConfigError(f"--config: reasoning-gym refused the settings {json.dumps(config)} for {task!r}: "
                          f"{type(e).__name__}: {e}") from None


def label(task: str, config: dict, seed: int, size: int, index: int, entry: dict, score_answer) -> dict:
    """What the verifier needs to score answers to `entry` (item `index` of that dataset, whose scorer is
    `score_answer`): the dataset and index, the oracle answer, and the entry itself where JSON keeps it whole."""
    out: dict[str, Any] = dict(zip(LABEL_KEYS, (task, config, seed, size, index)))
    out["answer"] = entry.get("answer")
    out["question_sha256"] = question_sha256(entry["question"])
    if keeps_entry(task, entry, score_answer):
        out["entry"] = entry
    return out


def rows(tasks: list[str], configs: dict[str, dict], seed: int, size: int, template: str = TEMPLATE,
         exclude: set[str] = frozenset(), counts: Counter | None = None) -> Iterator[dict]:
    """One row per item of each task's dataset, in task order then index; items whose question is in `exclude`
    are skipped and counted in `counts`."""
    for task in tasks:
        dataset = build_dataset(task, configs[task], seed, size)
        for index in range(size):
            entry = dataset[index]
            if entry["question"] in exclude:
                if counts is not None:
                    counts[f"skipped: question in --exclude-from ({task})"] += 1
                continue
            yield {"id": f"{task}-s{seed}-{index}", "prompt": template.format(question=entry["question"]),
                   "answer": label(task, configs[task], seed, size, index, entry, dataset.score_answer),
                   "verifier": VERIFIER}


def questions_in(path: str | Path) -> tuple[set[str], list[dict]]:
    """The questions of a file of reasoning-gym rows, and its datasets' labels (task, config, seed, size)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--exclude-from {path}: no such file")
    questions, datasets = set(), {}
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                answer = json.loads(line)["answer"]
                spec = {k: answer[k] for k in LABEL_KEYS[:4]}
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(f"--exclude-from {path}:{lineno}: not a reasoning-gym row "
                                  "(megarl-prepare-data reasoning-gym writes them)") from None
            datasets[json.dumps(spec, sort_keys=True)] = spec
            entry = answer.get("entry") or _rebuilt(answer)
            questions.add(entry["question"])
    return questions, list(datasets.values())


def check_seeds_apart(task: str, config: dict, seed: int, size: int, others: list[dict], where: str) -> None:
    """Most reasoning-gym tasks seed item i with `seed + i`, so datasets of the same task and settings whose seed
    ranges [seed, seed + size) meet share those items: seed 2 is seed 1 shifted by one. Refused for a held-out split."""
    for o in others:
        if o["task"] == task and o["config"] == config and seed < o["seed"] + o["size"] and o["seed"] < seed + size:
            first, last = o["seed"], o["seed"] + o["size"] - 1
            raise ConfigError(f"--seed {seed}: {where} holds {task!r} items of seeds {first}..{last} with these "
                              "settings, and reasoning-gym makes item i of seed S from S + i, so seeds "
                              f"{seed}..{seed + size - 1} repeat them; a held-out split needs --seed >= {last + 1} "
                              f"(or <= {first - size})")


def _rebuilt(label: dict) -> dict:
    return build_dataset(label["task"], label["config"], label["seed"], label["size"])[label["index"]]


def write(tasks_text: str, out: str | Path, *, size: int, seed: int, config: str | dict | None = None,
          template: str = TEMPLATE, exclude_from: str | Path | None = None) -> Counter:
    """Write the rows to `out` (renamed into place when complete); returns counts ("written", skips by reason)."""
    if size < 1:
        raise ConfigError(f"--size must be at least 1, got {size}")
    if "{question}" not in template:
        raise ConfigError("--template must contain {question}")
    tasks = parse_tasks(tasks_text)
    configs = task_configs(tasks, config)
    exclude: set[str] = set()
    if exclude_from:
        exclude, datasets = questions_in(exclude_from)
        for t in tasks:
            check_seeds_apart(t, configs[t], seed, size, datasets, str(exclude_from))
    counts: Counter = Counter()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(out).with_name(Path(out).name + ".partial")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows(tasks, configs, seed, size, template, exclude, counts):
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                counts["written"] += 1
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return counts
