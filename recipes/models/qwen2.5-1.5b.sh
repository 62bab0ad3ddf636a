# Qwen2.5-Math-1.5B-class model. The architecture (28 layers, hidden 1536, 12 heads, 2 KV heads, MLP 8960,
# vocab 151936, tied embeddings) is read from the checkpoint's config.json; this file says where it is and how
# to split it.
MODEL_DIR=${MODEL_DIR:-/models/Qwen2.5-Math-1.5B}
MODEL_ARGS=(
  --hf-checkpoint "$MODEL_DIR"
  --tensor-model-parallel-size 2
  --pipeline-model-parallel-size 1
  --transformer-impl transformer_engine
  --bf16
)
