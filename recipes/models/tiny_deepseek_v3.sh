# The DeepSeek-V3 starter: `make demo-deepseek` builds it with `tools/make_starter_model.py --family deepseek_v3
# --out .cache/starter_deepseek_v3` (the demo's task and step count; DeepSeek-V3 architecture, 2 layers, hidden 256,
# multi-latent attention with a low-rank query, a dense first layer, then 4 routed experts of width 512 with 2 per
# token in 1 of 2 groups and a shared expert of width 512, ~2.8M parameters, upcycled from a dense DeepSeek-V3 whose
# MLP is one expert wide). Its shape is read from the checkpoint's config.json. DEEPSEEK_STARTER_DIR moves it.
STARTER_DIR=${DEEPSEEK_STARTER_DIR:-$REPO_ROOT/.cache/starter_deepseek_v3}
MODEL_ARGS=(
  --hf-checkpoint "$STARTER_DIR"
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 1
  --expert-model-parallel-size 2     # two routed experts on each of the 2 processes; MLA and the rest data parallel
  --moe-token-dispatcher-type alltoall  # as in tiny_qwen3_moe.sh: the allgather dispatcher needs equal widths
  --moe-aux-loss-coeff 0
  --transformer-impl local
)
