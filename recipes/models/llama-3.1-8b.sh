# Llama-3.1-8B / -Instruct (Llama architecture, GQA with 8 KV heads, untied embeddings). The shape below (HF
# config.json keys) is for megarl-plan. The real checkpoint's "llama3" RoPE scaling is read from its config.json
# (megarl/model_shape.py; the same frequencies in Megatron and the built-in engine).
MODEL_DIR=${MODEL_DIR:-/models/Llama-3.1-8B-Instruct}
declare -A MODEL_SHAPE=(
  [model_type]=llama [num_hidden_layers]=32 [hidden_size]=4096 [num_attention_heads]=32 [num_key_value_heads]=8
  [intermediate_size]=14336 [vocab_size]=128256 [max_position_embeddings]=131072 [rope_theta]=500000
  [rms_norm_eps]=1e-5 [tie_word_embeddings]=false
)
MODEL_ARGS=(
  --hf-checkpoint "$MODEL_DIR"
  --tensor-model-parallel-size 4
  --pipeline-model-parallel-size 1
  --transformer-impl transformer_engine
  --sequence-parallel           # shard the norms' activations over TP too
  --bf16
)
