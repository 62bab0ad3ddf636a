# Qwen3-8B (Qwen3 architecture: per-head q/k RMSNorm, no q/k/v bias, head_dim 128, untied embeddings). The shape
# below (HF config.json keys) is for megarl-plan; megarl itself reads the checkpoint's config.json.
MODEL_DIR=${MODEL_DIR:-/models/Qwen3-8B}
declare -A MODEL_SHAPE=(
  [model_type]=qwen3 [num_hidden_layers]=36 [hidden_size]=4096 [num_attention_heads]=32 [num_key_value_heads]=8
  [head_dim]=128 [intermediate_size]=12288 [vocab_size]=151936 [max_position_embeddings]=40960
  [rope_theta]=1000000 [rms_norm_eps]=1e-6 [tie_word_embeddings]=false
)
MODEL_ARGS=(
  --hf-checkpoint "$MODEL_DIR"
  --tensor-model-parallel-size 4
  --pipeline-model-parallel-size 1
  --transformer-impl transformer_engine
  --sequence-parallel           # shard the norms' activations over TP too
  --bf16
)
