"""A scripted rollout backend for `test_tool_use_train.py`: no model, a fixed policy that calls the python tool
for even-numbered samples (`a*b=` -> a python block, then the product copied from the output) and answers `0`
for odd ones. `--rollout-backend scripted_tool_engine`."""

from __future__ import annotations

from megarl.rollout import Completion
from megarl.rollout.backends import register_backend


class ScriptedToolEngine:
    shares_actor_weights = True  # nothing to push: a sync only stamps the version
    dtype = None

    def __init__(self, tokenizer):
        self.tok, self.weight_version = tokenizer, 0

    def _turn(self, text: str, sample: int) -> tuple[str, bool]:
        if "```output\n" in text:
            return text.rsplit("```output\n", 1)[1].split("\n", 1)[0], True  # copy the output: the answer
        if sample % 2:
            return "0", True
        return f"```python\n{text.split('=', 1)[0]}\n```\n", False

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            group = []
            for j in range(params.n):
                text, final = self._turn(self.tok.decode(p), j)
                ids = self.tok.encode(text, add_special_tokens=False) + ([self.tok.eos_token_id] if final else [])
                ids = ids[: params.max_new_tokens]
                group.append(Completion(ids, [-0.5] * len(ids), "stop", self.weight_version))
            out.append(group)
        return out

    def update_weights(self, named_tensors, version=None):
        self.weight_version = version if version is not None else self.weight_version + 1

    def load_weight_buckets(self, buckets, version):
        self.weight_version = version

    def score(self, sequences, prompt_lens, temperature=1.0):
        return [[-0.5] * (len(s) - p) for s, p in zip(sequences, prompt_lens)]

    def release_memory(self):
        pass

    def resume_memory(self):
        pass

    def shutdown(self):
        pass


@register_backend("scripted_tool_engine")
def build(cfg, actor=None):
    from transformers import AutoTokenizer

    return ScriptedToolEngine(AutoTokenizer.from_pretrained(cfg.model.hf_checkpoint))
