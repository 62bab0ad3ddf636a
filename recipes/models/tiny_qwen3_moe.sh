# The mixture-of-experts starter: `python tools/make_starter_model.py --family qwen3_moe --out .cache/starter_moe`
# builds it (the demo's task and schedule; Qwen3-MoE architecture, 2 layers, hidden 256, 4 experts of width 512
# with 2 per token, ~3.6M parameters). Its shape is read from the checkpoint's config.json. MOE_STARTER_DIR moves it.
STARTER_DIR=${MOE_STARTER_DIR:-$REPO_ROOT/.cache/starter_moe}
MODEL_ARGS=(
  --hf-checkpoint "$STARTER_DIR"
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 1
  --expert-model-parallel-size 2     # two experts on each of the 2 processes; attention is data parallel
  --moe-aux-loss-coeff 0
  --transformer-impl local
)
