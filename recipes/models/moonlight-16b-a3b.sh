# Moonlight-16B-A3B (DeepSeek-V3 architecture, HF DeepseekV3ForCausalLM): 27 layers, the first dense, then 64
# routed experts of width 1408 (6 per token, sigmoid router with its bias, one group) and 2 shared ones; multi-latent
# attention with a full-rank query (q_lora_rank null: omitted here), a 512-wide KV latent, 128 + 64 (RoPE) query/key
# and 128 value dims per head; ~16B parameters, ~3B active. The shape (HF config.json keys; values as Moonshot
# published them) is for megarl-plan; megarl itself reads the checkpoint's config.json. EP 8 over the experts, the
# attention at TP 2 with sequence parallelism (Megatron's MoE layer needs it at TP > 1).
MODEL_DIR=${MODEL_DIR:-/models/Moonlight-16B-A3B}
declare -A MODEL_SHAPE=(
  [model_type]=deepseek_v3 [num_hidden_layers]=27 [hidden_size]=2048 [num_attention_heads]=16
  [num_key_value_heads]=16 [kv_lora_rank]=512 [qk_nope_head_dim]=128 [qk_rope_head_dim]=64 [v_head_dim]=128
  [intermediate_size]=11264 [moe_intermediate_size]=1408 [n_routed_experts]=64 [n_shared_experts]=2
  [num_experts_per_tok]=6 [n_group]=1 [topk_group]=1 [first_k_dense_replace]=1 [norm_topk_prob]=true
  [routed_scaling_factor]=2.446 [vocab_size]=163840 [max_position_embeddings]=8192 [rope_theta]=50000
  [rms_norm_eps]=1e-5 [tie_word_embeddings]=false
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
  --use-distributed-optimizer   # Adam state split over DP: colocated does not fit without it (megarl-plan)
)
