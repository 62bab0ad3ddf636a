"""The PPO critic: the actor's GPTModel trunk with a scalar value head, its own optimizer and scheduler.

`MegatronCritic` is a `MegatronModel` (`megarl.mcore.base_model`), the actor's sibling: same build, optimizer,
forward schedule, offload and checkpoint state, another head.

Values are aligned with the actor's log-probs: `values[b, t]` is the value of the state `tokens[b, :t + 1]`, the
state in which `tokens[b, t + 1]` is chosen, shape `[B, S - 1]`; only the last pipeline stage holds them.

The value head replaces GPTModel's vocab-parallel output layer. GPTModel calls its output layer as
`output_layer(hidden, weight=..., runtime_gather_output=...)` and expects `(output, bias)`; `ValueHead` has that
signature. Without sequence parallelism (a GPU-only option this project does not turn on) the hidden state that
enters the output layer is complete and identical on every TP rank, so a replicated `Linear(hidden, 1)` gives
the same value on each TP rank and the trunk's gradient needs no TP reduction. The head is zero-initialised:
every TP rank starts identical without a shared RNG, and the first values are 0.

The model is always built with untied embeddings (the head has nothing to share with the input embedding), so
no embedding-gradient all-reduce across pipeline stages is set up for it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megarl.mcore.base_model import MegatronModel, OptimConfig
from megarl.model_shape import ModelShape


class ValueHead(torch.nn.Module):
    """`hidden [s, b, h] -> (values [s, b, 1], None)`, called where GPTModel calls its output layer."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        # Named `weight` and `bias` like the layer it replaces: GPTModel's sharded_state_dict expects
        # `output_layer.weight` on the last stage.
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


class MegatronCritic(MegatronModel):
    """A value model at any TP x PP x DP, trained with its own optimizer: `train_step(batch, loss_fn)` calls
    `loss_fn(values [b, S - 1], micro_batch)` (Megatron divides the summed loss by the summed denominator once,
    as for the actor). It has no HF counterpart: `load_hf` fills the trunk and leaves the value head at zero."""

    _hf_skip = ("output_layer.",)

    def __init__(self, shape: ModelShape, *, tp: int, pp: int, optim: OptimConfig | None = None,
                 use_transformer_engine: bool | None = None, bf16: bool = False, **model_options):
        """`model_options`: `MegatronModel`'s other keywords (vocabulary padding, recomputation)."""
        super().__init__(replace(shape, tie_word_embeddings=False), tp=tp, pp=pp, trainable=True, optim=optim,
                         use_transformer_engine=use_transformer_engine, bf16=bf16, **model_options)

    def _build_module(self, shape: ModelShape, use_transformer_engine: bool | None):
        module = super()._build_module(shape, use_transformer_engine)
        if module.post_process:
            device = next(module.parameters()).device
            module.output_layer = ValueHead(shape.hidden_size, self.config.params_dtype, device)
        return module

    def _per_token(self, output: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        return output[:, :-1, 0].float()  # [b, s, 1] -> [b, s - 1]: no value is needed after the last token

    def values(self, tokens: torch.Tensor, *, micro_batch_size: int, lengths: torch.Tensor | None = None,
               max_tokens_per_micro_batch: int = 0) -> torch.Tensor | None:
        """Values [B, S - 1] on the last pipeline stage, None on the others (micro-batches as for log-probs)."""
        return self._forward_only(tokens, micro_batch_size=micro_batch_size, lengths=lengths,
                                  max_tokens_per_micro_batch=max_tokens_per_micro_batch)
