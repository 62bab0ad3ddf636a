"""`--plugins` for the OpenEnv training test: a `guess` tool parser, by which the tiny starter's answer (its turn's
leading number) is a call of the environment's tool, and the `recorded_tool_use` rollout function: `tool_use` built
from the run's flags, with every completion the engine returns and every sample it makes written to
$MEGARL_OPENENV_RECORD.rank<RANK> (one JSON line per rollout call), for the test to compare token by token."""

from __future__ import annotations

import json
import os
import re

from megarl.rollout import ROLLOUTS, register_rollout
from megarl.rollout.functions import Rollout
from megarl.rollout.tool_use import ToolUse
from megarl.tool_calls import ToolCall, register_parser


@register_parser("guess")
class GuessParser:
    name = "guess"
    stop = ()  # a turn ends where the model ends it

    def parse(self, text: str) -> list:
        m = re.match(r"\s*(\d+)", text)
        return [ToolCall("env", {"guess": int(m.group(1))})] if m else []

    def wrap(self, output: str) -> str:
        return f" {output} "


class _Recording:
    def __init__(self, engine, sampled: list):
        self.engine, self.sampled = engine, sampled

    def generate(self, prompts, params):
        out = self.engine.generate(prompts, params)
        self.sampled.append([[list(c.token_ids) for c in group] for group in out])
        return out


class Recorded(Rollout):
    def __init__(self, inner: ToolUse, path: str):
        self.inner, self.path = inner, path

    def __call__(self, engine, prompts, params, reward, tokenizer):
        sampled: list = []
        samples = self.inner(_Recording(engine, sampled), prompts, params, reward, tokenizer)
        row = {"n": params.n, "sampled": sampled, "labels": [p.label for p in prompts],
               "samples": [{"group": s.group, "response_ids": s.response_ids, "loss_mask": s.loss_mask,
                            "reward": s.reward, "status": s.status.value, "metadata": s.metadata} for s in samples]}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        return samples

    def step_metrics(self):
        return self.inner.step_metrics()

    def close(self):
        self.inner.close()


def _configure(cfg):
    return Recorded(ToolUse(ROLLOUTS.settings(cfg, "tool_use"), cfg.sandbox),
                    f"{os.environ['MEGARL_OPENENV_RECORD']}.rank{os.environ.get('RANK', '0')}")


@register_rollout("recorded_tool_use", configure=_configure)
def recorded_tool_use(engine, prompts, params, reward, tokenizer):
    raise RuntimeError("recorded_tool_use is built from the run's flags (configure)")
