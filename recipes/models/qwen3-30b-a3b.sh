# Qwen3-30B-A3B (Qwen3-MoE: 48 layers, each with 128 experts of width 768 of which every token takes 8,
# renormalised; ~30.5B parameters, ~3.3B active per token). The shape below (HF config.json keys) is for
# megarl-plan; megarl itself reads the checkpoint's config.json. Expert parallelism splits the experts over 8
# GPUs (16 per GPU, each whole: expert-TP 1), while attention runs at TP 2 with sequence parallelism (Megatron's
# MoE layer needs it at TP > 1); the world size must be a multiple of 8 (expert-TP x EP x PP) and of TP x PP.
MODEL_DIR=${MODEL_DIR:-/models/Qwen3-30B-A3B}
declare -A MODEL_SHAPE=(
  [model_type]=qwen3_moe [num_hidden_layers]=48 [hidden_size]=2048 [num_attention_heads]=32
  [num_key_value_heads]=4 [head_dim]=128 [intermediate_size]=6144 [moe_intermediate_size]=768 [num_experts]=128
  [num_experts_per_tok]=8 [norm_topk_prob]=true [decoder_sparse_step]=1 [vocab_size]=151936
  [max_position_embeddings]=40960 [rope_theta]=1000000 [rms_norm_eps]=1e-6 [tie_word_embeddings]=false
)
MODEL_ARGS=(
  --hf-checkpoint "$MODEL_DIR"
  --tensor-model-parallel-size 2
  --pipeline-model-parallel-size 1
  --expert-model-parallel-size 8
  --expert-tensor-parallel-size 1
  --moe-aux-loss-coeff 0        # keep the pretrained routing: no load-balancing loss in RL
  --transformer-impl transformer_engine
  --sequence-parallel
  --bf16
)
