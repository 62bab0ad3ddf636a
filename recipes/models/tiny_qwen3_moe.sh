# The mixture-of-experts starter: `make demo-moe` builds it with `tools/make_starter_model.py --family qwen3_moe
# --out .cache/starter_moe` (the demo's task and step count; Qwen3-MoE architecture, 2 layers, hidden 256, 4 experts
# of width 512 with 2 per token, ~3.6M parameters, upcycled from a dense Qwen3 whose MLP is one expert wide). Its
# shape is read from the checkpoint's config.json. MOE_STARTER_DIR moves it.
STARTER_DIR=${MOE_STARTER_DIR:-$REPO_ROOT/.cache/starter_moe}
MODEL_ARGS=(
  --hf-checkpoint "$STARTER_DIR"
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 1
  --expert-model-parallel-size 2     # two experts on each of the 2 processes; attention is data parallel
  # alltoall (the default, said here because it matters): Megatron's allgather dispatcher gathers the same number
  # of tokens from every EP rank, and the two ranks' micro-batches are as wide as their own longest completion
  # (measured: the first step whose widths differed stopped with gloo's "Received data size doesn't match").
  --moe-token-dispatcher-type alltoall
  --moe-aux-loss-coeff 0
  --transformer-impl local
)
