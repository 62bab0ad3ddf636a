"""`--rollout-function verifiers_recorded` for `test_verifiers_train.py`: the `verifiers` rollout function with the
run's engine behind a recorder, writing per rank to $MEGARL_VERIFIERS_RECORD/rank<r>.jsonl what the engine
generated, what the verifiers process answered and which samples the function returned, so the test can hold the
samples against the engine's own tokens and the traces' rewards."""

from __future__ import annotations

import json
import os

from megarl.rollout.functions import register_rollout
from megarl.rollout.slots import ROLLOUTS
from megarl.rollout.verifiers_env import VerifiersRollout


class RecordingEngine:
    """The token endpoint's view of an engine (generate, weight_version), recording every generate call."""

    def __init__(self, inner, log: list):
        self.inner, self.log = inner, log

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def generate(self, prompts, params):
        groups = self.inner.generate(prompts, params)
        for prompt, group in zip(prompts, groups):
            for c in group:
                self.log.append({"kind": "engine", "prompt": list(prompt), "tokens": list(c.token_ids),
                                 "logprobs": list(c.logprobs), "version": c.weight_version})
        return groups


class RecordedVerifiers(VerifiersRollout):
    def __call__(self, engine, prompts, params, reward, tokenizer):
        log: list[dict] = []
        self._log = log
        samples = super().__call__(RecordingEngine(engine, log), prompts, params, reward, tokenizer)
        log += [{"kind": "sample", "prompt": s.prompt_ids, "response": s.response_ids, "mask": s.loss_mask,
                 "logprobs": s.rollout_logprobs, "reward": s.reward, "status": s.status.value,
                 "text": s.response_text, "prompt_index": s.prompt_index, "group": s.group} for s in samples]
        rank = os.environ.get("RANK", "0")
        with open(os.path.join(os.environ["MEGARL_VERIFIERS_RECORD"], f"rank{rank}.jsonl"), "a") as f:
            f.write("".join(json.dumps(row) + "\n" for row in log))
        return samples

    def _run_worker(self, request, home):
        answer = super()._run_worker(request, home)
        self._log.append({"kind": "episodes", "episodes": answer["episodes"]})
        return answer


@register_rollout("verifiers_recorded", configure=lambda cfg: RecordedVerifiers(
    ROLLOUTS.settings(cfg, "verifiers"), cfg.model.hf_checkpoint))
def verifiers_recorded(engine, prompts, params, reward, tokenizer):
    raise RuntimeError("built from the run's flags")
