"""Everything that touches megatron-core: parallel state, the model, weights, log-probs, checkpoints."""

import warnings

# megatron-core warns at import and at model build, on every rank, that Apex and Transformer Engine are absent and
# it falls back to torch (optimizers, norms, multi-tensor ops), and that the default CUDA-graph scope is
# deprecated. megarl never uses Apex (its own kernels or Transformer Engine's spec, `parallel.layer_spec`) and
# takes no CUDA graphs, so these say nothing about a run; a run that asks for Transformer Engine without it stops
# with its own error.
for _message in (r"(Transformer Engine and )?Apex (is|are) not installed", r"full scope is deprecated"):
    warnings.filterwarnings("ignore", message=_message, category=UserWarning, module=r"megatron\.")
