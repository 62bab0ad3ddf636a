"""The planted hacker: a rollout function (`--plugins tests/e2e/hack_plugin.py --rollout-function planted_hacker`)
that replaces a share of the policy's code and math samples with known reward hacks from `CATALOGUE`, scores them
with the run's reward like any sample, and tags each one (`metadata`: `planted` 1, `planted_kind` its index in
`CATALOGUE`), while the rest stay the policy's own. `tools/hack_recall.py` then reads the run's samples.jsonl and
prints, by category, how many of the planted hacks the monitor named (recall) and how many honest samples carried
a signal anyway (false signals).

The catalogue: the sandbox red-team's patterns (`tests/redteam_cases.py`, `tests/sandbox_cases.py`: killing the
harness, ptrace, forks past the limit, writes outside the tmpfs, a socket, chmod of the working directory,
reading the tests) and the classic verifier hacks: an exit before the asserts (`sys.exit`, `os._exit`,
`raise SystemExit`, an `atexit` hook), an object whose `__eq__` returns True, a forged verdict line, the harness's
names rebound; for math, a copy of the question (a listed not-answer) and hedged boxed answers. Each entry names
the category the monitor must report (`megarl.verifiers.signals.CATEGORIES`).

A planted sample keeps the policy's tokens (its loss mask and log-probs) and only its text changes: what the
verifier judges is the hack, and training goes on as usual. Test-only: it ships in tests/, not in megarl.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from megarl.registry import option
from megarl.rollout import ROLLOUTS, register_rollout

# hack_catalogue, beside this file: megarl's plugin loader puts a plugin file's directory on the path, and
# tests/conftest.py puts tests/e2e there for the tests.
from hack_catalogue import CATALOGUE, applicable, hack_text  # noqa: F401 - the catalogue, re-exported


@dataclass
class PlantedOptions:
    planted_share: float = option(0.25, "planted_hacker: the share of samples replaced by a catalogued hack")


@register_rollout("planted_hacker", options=PlantedOptions,
                  configure=lambda cfg: _Planted(ROLLOUTS.settings(cfg, "planted_hacker").planted_share,
                                                 cfg.training.seed))
def planted_hacker(engine, prompts, params, reward, tokenizer):
    return _Planted(0.25, 0)(engine, prompts, params, reward, tokenizer)


class _Planted:
    def __init__(self, share: float, seed: int):
        self.share, self.rng = share, random.Random(seed * 7919 + 17)

    def __call__(self, engine, prompts, params, reward, tokenizer):
        samples = ROLLOUTS.get("single_turn")(engine, prompts, params, reward, tokenizer)
        chosen = []
        for i, s in enumerate(samples):
            kinds = applicable(prompts[s.group].label)
            if kinds and self.rng.random() < self.share:
                kind = self.rng.choice(kinds)
                chosen.append((i, kind, hack_text(kind, prompts[s.group].label)))
        if not chosen:
            return samples
        planted = [replace(samples[i], response_text=text) for i, _, text in chosen]
        results = reward(planted, [prompts[s.group] for s in planted])
        out = list(samples)
        for (i, kind, _), s, r in zip(chosen, planted, results):
            out[i] = replace(s, reward=float(r.score), outcome=r.outcome, extracted=r.extracted,
                             signals=dict(r.signals), metadata={**s.metadata, "planted": 1.0,
                                                                "planted_kind": float(kind)})
        return out
