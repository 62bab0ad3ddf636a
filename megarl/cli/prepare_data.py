"""Convert public math and code datasets, as downloaded (parquet, jsonl, json), to megarl's prompt jsonl.

    megarl-prepare-data <layout> <input.parquet|.jsonl|.json[.gz]> <output.jsonl> [--limit N]
        [--template "...{problem}..."] [--max-tests N]

Each output row is `{"prompt", "answer", "verifier", "source"}` (`source` = layout:row, for tracing a sample
back; megarl ignores it). Layouts, by the columns they read:

  gsm8k          question, answer ("... #### 72")                       -> math, answer "72"
  math           problem, answer | solution's last \\boxed{}   (MATH, MATH-500, AIME sets)   -> math
  dapo-math      prompt [chat messages] | prompt text, reward_model.ground_truth (DAPO-Math-17k)  -> math
  code-contests  description, public/private/generated_tests {input, output}   (deepmind/code_contests)
                 -> code, {"inputs": [...], "outputs": [...]}
  apps           question, input_output (JSON: inputs, outputs[, fn_name])    -> code, the same layout
  humaneval      prompt, test, entry_point   (HumanEval, MBPP-style with a check())
                 -> code, {"prompt", "test", "entry_point"}: the row's prompt is the code its tests may call
                 (helpers such as HumanEval/38's encode_cyclic), which the harness runs itself

Rows that cannot be converted (no answer, no tests) are skipped and counted by reason; nothing is guessed.
Prompts are plain text; a chat template is not applied.

    megarl-prepare-data reasoning-gym TASK[,TASK...] <output.jsonl> --size N --seed S [--config JSON]
        [--template "...{question}..."] [--exclude-from train.jsonl]

generates reasoning-gym's procedural tasks instead (the `rg` extra: pip install megarl[rg]), rows for the
`reasoning_gym` verifier, which scores them with each task's own scorer (`megarl.tasks.reasoning_gym`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

BOXED_MATH = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
STDIO_CODE = ("{problem}\n\nWrite a complete Python 3 program that reads the input from standard input and writes "
              "the answer to standard output. Give the whole program in one ```python code block.")
CALL_CODE = ("{problem}\n\nWrite the Python 3 function `{fn_name}` that solves this. Give the whole program "
             "(imports included) in one ```python code block.")
FUNCTION_CODE = ("Complete the following Python function. Give the whole program (imports and the function) in "
                 "one ```python code block.\n\n```python\n{problem}```")


class Skip(Exception):
    """This row cannot be converted; the message is the reason counted in the summary."""


class InputError(Exception):
    """The input cannot be read; the message names the file (and line)."""


# ------------------------------------------------------------------------------------------------ reading

def read_rows(path: str | Path) -> Iterator[dict]:
    p = Path(path)
    name = p.name.lower()
    if name.endswith(".parquet"):
        try:
            import pyarrow
            import pyarrow.parquet as pq
        except ImportError:
            raise SystemExit("reading parquet needs pyarrow: pip install pyarrow") from None
        try:
            reader = pq.ParquetFile(p)
        except (pyarrow.ArrowException, OSError) as e:  # ArrowInvalid, OSError ("Couldn't deserialize thrift"),
            # FileNotFoundError: a file that is not parquet, or not there
            raise InputError(f"{p}: not a readable parquet file ({e})") from None
        for batch in reader.iter_batches(batch_size=1024):
            yield from batch.to_pylist()
        return
    opener = gzip.open if name.endswith(".gz") else open
    with opener(p, "rt", encoding="utf-8") as fh:
        if name.removesuffix(".gz").endswith(".json"):
            try:
                data = json.load(fh)
            except json.JSONDecodeError as e:
                raise InputError(f"{p}: not valid JSON ({e})") from None
            yield from (data if isinstance(data, list) else data.get("data", []))
            return
        for lineno, line in enumerate(fh, start=1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None


# ------------------------------------------------------------------------------------------------ answers

def last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} (or \\fbox{...}), braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i:j - 1].strip() if depth == 0 else None


def _need(row: dict, *keys: str) -> list[Any]:
    missing = [k for k in keys if row.get(k) in (None, "")]
    if missing:
        raise Skip(f"no {'/'.join(missing)}")
    return [row[k] for k in keys]


def gsm8k(row: dict, template: str | None) -> tuple[str, Any, str]:
    question, answer = _need(row, "question", "answer")
    if "####" not in answer:
        raise Skip("answer has no '####' line")
    final = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return (template or BOXED_MATH).format(problem=question.strip()), final, "math"


def math_layout(row: dict, template: str | None) -> tuple[str, Any, str]:
    [problem] = _need(row, "problem")
    answer = row.get("answer")
    if answer in (None, ""):
        answer = last_boxed(row.get("solution") or "")
    if answer in (None, ""):
        raise Skip("no answer and no \\boxed{} in the solution")
    return (template or BOXED_MATH).format(problem=problem.strip()), str(answer).strip(), "math"


def dapo_math(row: dict, template: str | None) -> tuple[str, Any, str]:
    prompt, reward_model = _need(row, "prompt", "reward_model")
    if isinstance(prompt, list):  # chat messages: the user's turn is the problem, instructions included
        prompt = next((m["content"] for m in prompt if m.get("role") == "user"), None)
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if not prompt or truth in (None, ""):
        raise Skip("no user prompt or no reward_model.ground_truth")
    return (template or "{problem}").format(problem=prompt.strip()), str(truth).strip(), "math"


def _tests(row: dict, max_tests: int) -> tuple[list[str], list[str]]:
    inputs, outputs = [], []
    for key in ("public_tests", "private_tests", "generated_tests"):
        t = row.get(key) or {}
        inputs += list(t.get("input") or [])
        outputs += list(t.get("output") or [])
    if not inputs or len(inputs) != len(outputs):
        raise Skip("no tests" if not inputs else "tests with unequal inputs and outputs")
    return inputs[:max_tests], outputs[:max_tests]


def code_contests(row: dict, template: str | None, max_tests: int = 32) -> tuple[str, Any, str]:
    [description] = _need(row, "description")
    inputs, outputs = _tests(row, max_tests)
    return (template or STDIO_CODE).format(problem=description.strip()), {"inputs": inputs, "outputs": outputs}, "code"


def apps(row: dict, template: str | None, max_tests: int = 32) -> tuple[str, Any, str]:
    question, io = _need(row, "question", "input_output")
    try:
        io = json.loads(io) if isinstance(io, str) else io
    except json.JSONDecodeError:
        raise Skip("input_output is not JSON") from None
    inputs, outputs = list(io.get("inputs") or []), list(io.get("outputs") or [])
    if not inputs or len(inputs) != len(outputs):
        raise Skip("no tests" if not inputs else "tests with unequal inputs and outputs")
    gold: dict[str, Any] = {"inputs": inputs[:max_tests], "outputs": outputs[:max_tests]}
    if io.get("fn_name"):
        gold["fn_name"] = io["fn_name"]
        prompt = (template or CALL_CODE).format(problem=question.strip(), fn_name=io["fn_name"])
    else:
        prompt = (template or STDIO_CODE).format(problem=question.strip())
    return prompt, gold, "code"


def humaneval(row: dict, template: str | None) -> tuple[str, Any, str]:
    prompt, test, entry_point = _need(row, "prompt", "test", "entry_point")
    gold = {"prompt": prompt, "test": test, "entry_point": entry_point}
    return (template or FUNCTION_CODE).format(problem=prompt), gold, "code"


LAYOUTS: dict[str, Callable[..., tuple[str, Any, str]]] = {
    "gsm8k": gsm8k, "math": math_layout, "dapo-math": dapo_math, "code-contests": code_contests, "apps": apps,
    "humaneval": humaneval}


# ------------------------------------------------------------------------------------------------ driver

def convert(layout: str, src: str | Path, dst: str | Path, *, template: str | None = None, limit: int = 0,
            max_tests: int = 32) -> Counter:
    """Write megarl rows to `dst`; returns counts: "written" and one "skipped: <reason>" per reason."""
    if layout not in LAYOUTS:
        raise SystemExit(f"unknown layout {layout!r}; choose one of: {', '.join(LAYOUTS)}")
    fn = LAYOUTS[layout]
    kw = {"max_tests": max_tests} if layout in ("code-contests", "apps") else {}
    counts: Counter = Counter()
    if not Path(src).is_file():
        raise InputError(f"{src}: no such file")
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(dst).with_name(Path(dst).name + ".partial")  # renamed when complete: a failure leaves no half file
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            for i, row in enumerate(read_rows(src)):
                if limit and counts["written"] >= limit:
                    break
                try:
                    prompt, answer, verifier = fn(row, template, **kw)
                except Skip as e:
                    counts[f"skipped: {e}"] += 1
                    continue
                out.write(json.dumps({"prompt": prompt, "answer": answer, "verifier": verifier,
                                      "source": f"{layout}:{i}"}, ensure_ascii=False) + "\n")
                counts["written"] += 1
        tmp.replace(dst)
    finally:
        tmp.unlink(missing_ok=True)
    return counts


def reasoning_gym_main(argv: list[str]) -> int:
    """`megarl-prepare-data reasoning-gym ...`: see `megarl.tasks.reasoning_gym`."""
    from megarl.errors import ConfigError

    ap = argparse.ArgumentParser(prog="megarl-prepare-data reasoning-gym",
                                 description="Write rows of reasoning-gym tasks for the reasoning_gym verifier.")
    ap.add_argument("tasks", metavar="TASK[,TASK...]", help="reasoning-gym task names, comma-separated")
    ap.add_argument("output", help="megarl jsonl to write")
    ap.add_argument("--size", type=int, required=True, help="items of each task: its dataset's size")
    ap.add_argument("--seed", type=int, required=True, help="the datasets' seed: a held-out split takes another")
    ap.add_argument("--config", help="JSON: the task's settings, or with several tasks an object keyed by task")
    ap.add_argument("--template", help="prompt template with {question} (default: the question, then a line asking "
                    "for the answer between <answer> tags)")
    ap.add_argument("--exclude-from", help="a file of reasoning-gym rows (the training split): leave out the items "
                    "whose question is in it")
    args = ap.parse_args(argv)
    from megarl.tasks import reasoning_gym as rg_task

    try:
        counts = rg_task.write(args.tasks, args.output, size=args.size, seed=args.seed, config=args.config,
                               template=args.template or rg_task.TEMPLATE, exclude_from=args.exclude_from)
    except ConfigError as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 2
    print(f"{args.output}: {counts.pop('written', 0)} rows written", file=sys.stderr)
    for reason, n in counts.most_common():
        print(f"  {n} {reason}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["reasoning-gym"]:
        return reasoning_gym_main(argv[1:])
    summary, _usage, notes = __doc__.split("\n\n", 2)  # notes: the output rows, the layouts, what is skipped
    ap = argparse.ArgumentParser(prog="megarl-prepare-data", description=summary, epilog=notes,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("layout", choices=sorted(LAYOUTS), help="the input's layout (or reasoning-gym: see below)")
    ap.add_argument("input", help="a downloaded file: .parquet, .jsonl, .json (optionally .gz)")
    ap.add_argument("output", help="megarl jsonl to write")
    ap.add_argument("--template", help="prompt template with {problem} (and {fn_name} for apps call-based rows)")
    ap.add_argument("--limit", type=int, default=0, help="write at most this many rows (0 = all)")
    ap.add_argument("--max-tests", type=int, default=32, help="code: keep at most this many test cases a problem")
    args = ap.parse_args(argv)
    try:
        counts = convert(args.layout, args.input, args.output, template=args.template, limit=args.limit,
                         max_tests=args.max_tests)
    except InputError as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 2
    print(f"{args.output}: {counts.pop('written', 0)} rows written", file=sys.stderr)
    for reason, n in counts.most_common():
        print(f"  {n} {reason}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
