"""What the verifiers tests share: where `make verifiers-env` builds the environment, the skip reason, and a
checkpoint directory whose tokenizer has the chat template the verifiers process renders with. A module of its own
so that test files import it by a name no other folder uses."""

import json
import os
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# The template renders a chat as its messages' text, one after the other: a one-turn chat `12+34=` is the prompt
# ids megarl's arithmetic data gives (`megarl.tasks.arithmetic`), which the test starter was trained on.
PLAIN_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def env_dir() -> Path:
    return Path(os.environ.get("MEGARL_VERIFIERS_ENV") or REPO / ".cache" / "verifiers-env")


def skip_reason() -> str | None:
    """Why the verifiers tests cannot run here, or None: the build writes its stamp last."""
    if (env_dir() / ".megarl-stamp").exists():
        return None
    return (f"no verifiers environment at {env_dir()}: `make verifiers-env` builds it (~3 minutes, ~600 MB; "
            "$MEGARL_VERIFIERS_ENV moves it)")


def with_chat_template(checkpoint: Path, out: Path) -> Path:
    """A copy of `checkpoint` whose tokenizer has `PLAIN_CHAT_TEMPLATE`."""
    shutil.copytree(checkpoint, out)
    config = out / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["chat_template"] = PLAIN_CHAT_TEMPLATE
    config.write_text(json.dumps(data))
    return out


def first_line_reward(response_text: str, answer: str) -> float:
    """The test taskset's reward (`megarl_sum_taskset.SumTask.correct`), written again: 1.0 when the reply's first
    line, stripped, is the answer."""
    return 1.0 if response_text.strip().split("\n")[0].strip() == str(answer) else 0.0
