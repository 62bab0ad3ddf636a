# Qwen2.5-Math-7B (Qwen2 architecture, untied embeddings). The shape below (HF config.json keys) is for
# megarl-plan; megarl itself reads the checkpoint's config.json. Its 4k context suits math RL responses of up
# to ~3.5k tokens.
MODEL_DIR=${MODEL_DIR:-/models/Qwen2.5-Math-7B}
declare -A MODEL_SHAPE=(
  [model_type]=qwen2 [num_hidden_layers]=28 [hidden_size]=3584 [num_attention_heads]=28 [num_key_value_heads]=4
  [intermediate_size]=18944 [vocab_size]=152064 [max_position_embeddings]=4096 [rope_theta]=10000
  [tie_word_embeddings]=false
)
MODEL_ARGS=(
  --hf-checkpoint "$MODEL_DIR"
  --tensor-model-parallel-size 4
  --pipeline-model-parallel-size 1
  --transformer-impl transformer_engine
  --sequence-parallel           # shard the norms' activations over TP too
  --bf16
)
