# The starter model built by tools/make_starter_model.py: Qwen2 architecture, 2 layers, hidden 256, ~2M params.
# Its shape is read from the checkpoint's config.json; this file only says where the checkpoint is.
STARTER_DIR=${STARTER_DIR:-$REPO_ROOT/.cache/starter}
MODEL_ARGS=(
  --hf-checkpoint "$STARTER_DIR"
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 1
  --transformer-impl local
)
