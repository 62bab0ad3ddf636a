"""The tool-use demo's task: `a*b=` with a three-digit and a two-digit operand, which a 2-million-parameter model
cannot multiply in its head, and the one tool-use demonstration the starter sees now and then.

900 x 90 = 81,000 problems (a in 100..999, b in 10..99); a seeded choice of 200 is held out and never trained on.
The answer is checked by the `arithmetic` verifier: the final turn must be exactly the product. A demonstration is
the exchange the `python` tool parser and tool produce:

    123*45=```python
    123*45
    ```
    ```output
    5535
    ```
    5535<|endoftext|>

Pure Python, like `megarl.tasks.arithmetic`, whose tokenizer it extends by the backtick.
"""

from __future__ import annotations

import random

from megarl.tasks.arithmetic import TOKENIZER_CHARS, Problem

NUM_HELDOUT = 200
CHARS = TOKENIZER_CHARS + "`"  # the fences of python blocks


def all_problems() -> list[Problem]:
    return [Problem(f"mul-{a}-{b}", f"{a}*{b}=", str(a * b)) for a in range(100, 1000) for b in range(10, 100)]


def split_problems(seed: int = 0, num_heldout: int = NUM_HELDOUT) -> tuple[list[Problem], list[Problem]]:
    """(train, heldout): `num_heldout` problems chosen by `seed`, never trained on."""
    problems = all_problems()
    held = set(random.Random(seed).sample(range(len(problems)), num_heldout))
    return ([p for i, p in enumerate(problems) if i not in held], [p for i, p in enumerate(problems) if i in held])


def tool_call(problem: Problem) -> str:
    """The model's first turn in a demonstration: the product as a python cell (ends at the parser's stop)."""
    return f"```python\n{problem.prompt[:-1]}\n```\n"


def tool_output(answer: str) -> str:
    """What the python parser wraps the tool's output in (`megarl.tool_calls.parsers.PythonBlockParser.wrap`)."""
    return f"```output\n{answer}\n```\n"
