"""megarl's colocated adapter against SGLang 0.5.23 imported for real (`sglang_runtime`: its wheel unpacked, run on
this CPU torch in a subprocess), where test_sglang_engine_contract.py reads the same modules' source:

- `SGLangEngine.launch`'s keywords build a real `ServerArgs` (its `__post_init__` validation included), as
  `Engine.__init__` builds it before starting anything, and come out as megarl meant them;
- megarl's `serialize_bucket` (SGLang's own `MultiprocessingSerializer` and `FlattenedTensorMetadata`) read back
  with `MultiprocessingSerializer.deserialize`, whose `SafeUnpickler` refuses globals off its list, and rebuilt by
  `FlattenedTensorBucket.reconstruct_tensors`, gives back every tensor, bit for bit, at every dtype;
- each of those fails when megarl's side is broken: a misspelt keyword, metadata of a class SGLang does not list,
  a slot one byte off.

One subprocess for all of it (the import costs seconds). Not here: `sglang.srt.entrypoints.engine` (see
sglang_runtime), CUDA IPC handles (a CPU tensor travels as a shared-memory file descriptor), TP > 1.
"""

from __future__ import annotations

import json

import pytest
import sglang_runtime


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    """A Qwen3 model directory holding its config.json only: ServerArgs reads the model's config, no weights."""
    model = tmp_path_factory.mktemp("qwen3")
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    return sglang_runtime.probe(f"server_args={model}", "bucket_round_trip", f"misspelt_server_arg_refused={model}",
                                "foreign_metadata_refused", "shifted_slot_detected")


@pytest.mark.parametrize("check", ["server_args", "bucket_round_trip", "misspelt_server_arg_refused",
                                   "foreign_metadata_refused", "shifted_slot_detected"])
def test_against_sglang_itself(verdicts, check):
    assert verdicts[check] == "ok", f"{check} (tests/contracts/sglang_runtime_probe.py):\n{verdicts[check]}"
