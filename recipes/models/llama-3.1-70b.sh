# Llama-3.1-70B / -Instruct (Llama architecture, 80 layers, GQA with 8 KV heads). TP=8 within a node and PP=4
# across nodes: 32 GPUs per model replica, so 64 GPUs give DP=2 (see megarl-plan for whether a setting fits).
# The shape below (HF config.json keys) is for megarl-plan. The real checkpoint's "llama3" RoPE scaling is read
# from its config.json.
MODEL_DIR=${MODEL_DIR:-/models/Llama-3.1-70B-Instruct}
declare -A MODEL_SHAPE=(
  [model_type]=llama [num_hidden_layers]=80 [hidden_size]=8192 [num_attention_heads]=64 [num_key_value_heads]=8
  [intermediate_size]=28672 [vocab_size]=128256 [max_position_embeddings]=131072 [rope_theta]=500000
  [rms_norm_eps]=1e-5 [tie_word_embeddings]=false
)
MODEL_ARGS=(
  --hf-checkpoint "$MODEL_DIR"
  --tensor-model-parallel-size 8
  --pipeline-model-parallel-size 4
  --transformer-impl transformer_engine
  --sequence-parallel           # shard the norms' activations over TP too
  --bf16
  --use-distributed-optimizer
)
