# Qwen2.5-Math-1.5B (Qwen2 architecture, tied embeddings). megarl reads the architecture from the checkpoint's
# config.json; MODEL_SHAPE repeats it (HF config.json keys) so that megarl-plan can size a run before the
# checkpoint is downloaded.
MODEL_DIR=${MODEL_DIR:-/models/Qwen2.5-Math-1.5B}
declare -A MODEL_SHAPE=(
  [model_type]=qwen2 [num_hidden_layers]=28 [hidden_size]=1536 [num_attention_heads]=12 [num_key_value_heads]=2
  [intermediate_size]=8960 [vocab_size]=151936 [max_position_embeddings]=4096 [rope_theta]=10000
  [tie_word_embeddings]=true
)
MODEL_ARGS=(
  --hf-checkpoint "$MODEL_DIR"
  --tensor-model-parallel-size 2
  --pipeline-model-parallel-size 1
  --transformer-impl transformer_engine
  --sequence-parallel           # shard the norms' activations over TP too
  --bf16
)
