"""A Megatron GPTModel shard that megarl trains or runs: the machinery the actor and the critic share.

`MegatronModel` builds the model at any TP x PP x CP x DP (wrapped in Megatron's DDP when trainable), its optimizer
and scheduler, runs Megatron's forward(-backward) schedule over micro-batches, offloads for a colocated engine and
exposes what checkpoints need (`model`, `optimizer`, `scheduler`). What the model outputs per position is its
head's business: a subclass builds its head (`_build_module`) and turns the model's output into one number per
position (`_per_token`): the actor's next-token log-probs (`megarl.mcore.actor`), the critic's values
(`megarl.mcore.critic`).

Batches are right-padded token matrices `tokens [B, S]`. Per-token outputs are aligned with targets: column t is
about predicting `tokens[b, t + 1]` from `tokens[b, :t + 1]`, shape `[B, S - 1]`. Only the last pipeline stage
holds them and the losses; the other stages get `None`.

The loss is supplied by the caller as `loss_fn(per_token, micro_batch) -> (loss_sum, denominator, metrics)`:
Megatron sums `loss_sum` and `denominator` over micro-batches and DP ranks and divides once
(`calculate_per_token_loss`), so the update does not depend on how the global batch is split.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from megarl.mcore import context_parallel, convert, cpu_compat, parallel, routing
from megarl.mcore import lora as lora_adapters
from megarl.mcore.lora import LoRAOptions
from megarl.mcore.model import MoEOptions, build_gpt_model, in_model_precision, recompute_options, transformer_config
from megarl.model_shape import ModelShape

LossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class OptimConfig:
    lr: float = 1e-5
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    lr_decay_steps: int = 1
    lr_decay_style: str = "constant"
    use_distributed_optimizer: bool = False


def _pad_rows(t: torch.Tensor, rows: int, value=0) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = t.new_full((rows - t.shape[0], *t.shape[1:]), value)
    return torch.cat([t, pad], dim=0)


def _micro_batches(batch: dict[str, torch.Tensor], micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Split along rows; the last micro-batch is padded with all-masked rows so pipeline shapes match."""
    rows = batch["tokens"].shape[0]
    count = -(-rows // micro_batch_size)
    out = []
    for i in range(count):
        mb = {k: v[i * micro_batch_size : (i + 1) * micro_batch_size] for k, v in batch.items()}
        n = mb["tokens"].shape[0]
        mb = {k: _pad_rows(v, micro_batch_size, -1 if k == "routing" else 0) for k, v in mb.items()}
        mb["_real_rows"] = n
        out.append(mb)
    return out


def _budget_micro_batches(batch: dict[str, torch.Tensor], max_tokens: int) -> list[dict[str, torch.Tensor]]:
    """Dynamic batching: micro-batches of whole rows holding at most `max_tokens` tokens each, padding included.

    Rows are taken longest first (so rows of similar length share a micro-batch: balanced padding) and each
    micro-batch is cut to its own longest row, so a few long responses do not pad every short one. Row lengths
    come from `batch["lengths"]` (the full row width when absent). Each micro-batch records the batch rows it
    holds in `_rows`, so per-row outputs can be put back in order. Per-token tensors are [B, S] or [B, S - 1].
    """
    tokens = batch["tokens"]
    rows, width = tokens.shape
    lengths = batch["lengths"].tolist() if "lengths" in batch else [width] * rows
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in sorted(range(rows), key=lambda r: (-lengths[r], r)):
        if lengths[i] > max_tokens:
            raise ValueError(f"a sequence of {lengths[i]} tokens does not fit in --max-tokens-per-micro-batch "
                             f"{max_tokens}; raise it to at least the longest prompt + response")
        if current and max(longest, lengths[i]) * (len(current) + 1) > max_tokens:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, lengths[i])
    if current:
        groups.append(current)
    out = []
    for idx in groups:
        w = max(2, max(lengths[i] for i in idx))
        index = torch.tensor(idx, device=tokens.device)
        mb = {}
        for k, v in batch.items():
            v = v.index_select(0, index)
            if v.dim() >= 2 and v.shape[1] == width:
                v = v[:, :w]
            elif v.dim() >= 2 and v.shape[1] == width - 1:
                v = v[:, : w - 1]
            mb[k] = v
        mb["_real_rows"] = len(idx)
        mb["_rows"] = index
        out.append(mb)
    return out


def _experts_apart(module: torch.nn.Module) -> None:
    """Expert weights reduce their gradients over the expert-data-parallel group and get an optimizer of their own,
    at every EP size (megatron-core does so only at EP > 1): the optimizer state then has the same structure
    whatever the EP size, so a checkpoint saved at EP = 2 resumes at EP = 1. At EP = 1 the expert-data-parallel
    group is the data-parallel group, so the update is the same."""
    for name, param in module.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


class MegatronModel:
    """A GPTModel shard, its optimizer and scheduler (none when frozen); subclasses give it a head."""

    def __init__(self, shape: ModelShape, *, tp: int, pp: int, trainable: bool, optim: OptimConfig | None = None,
                 use_transformer_engine: bool | None = None, bf16: bool = False, sequence_parallel: bool = False,
                 cp: int = 1, local_kernels: bool = True, padded_vocab_size: int = 0,
                 recompute_granularity: str = "none", moe: MoEOptions | None = None, routing_replay: bool = False,
                 lora: LoRAOptions | None = None):
        """`padded_vocab_size`: rows of the embedding and output layer (`megarl.preflight.padded_vocab_size`;
        0 = the HF vocabulary padded only as TP needs). `recompute_granularity`: none, selective or full
        (`--recompute-granularity`). `moe`: expert parallelism and routing of a mixture-of-experts model (EP and
        expert-TP must be those the process groups were made with, `parallel.init_distributed`). `routing_replay`:
        a batch's `routing` (the engine's experts) is replayed by the routers, not only compared
        (`megarl.mcore.routing`). `lora`: adapters on the linear layers, everything else frozen (`megarl.mcore.lora`;
        rank 0 or None: none)."""
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        self.shape = shape
        self.trainable = trainable
        if cp != parallel_state.get_context_parallel_world_size():
            raise ValueError(f"{type(self).__name__} built with context-parallel size {cp}, but the process groups "
                             f"have {parallel_state.get_context_parallel_world_size()} (--context-parallel-size)")
        if cp > 1 and not (use_transformer_engine is not False and parallel.transformer_engine_available()):
            raise ValueError(f"--context-parallel-size {cp} needs the Transformer Engine layer spec (a CUDA GPU with "
                             "transformer_engine importable): Megatron's local attention cannot split a sequence "
                             "over ranks")
        # Without TE, Megatron's local spec with megarl's fused kernels (local_kernels=False: the stock local spec).
        self.local_kernels = local_kernels and not parallel.uses_transformer_engine(use_transformer_engine)
        self.padded_vocab_size = padded_vocab_size or -(-shape.vocab_size // tp) * tp
        if self.padded_vocab_size % tp or self.padded_vocab_size < shape.vocab_size:
            raise ValueError(f"a padded vocabulary of {self.padded_vocab_size} rows does not hold the model's "
                             f"{shape.vocab_size} in equal shards over TP {tp}")
        self.config = transformer_config(shape, tp=tp, pp=pp, bf16=bf16, sequence_parallel=sequence_parallel,
                                         params_dtype=torch.bfloat16 if bf16 else torch.float32,
                                         context_parallel_size=cp, local_kernels=self.local_kernels, moe=moe,
                                         **recompute_options(recompute_granularity))
        module = self._build_module(shape, use_transformer_engine)
        self.lora = lora if lora is not None and lora.rank > 0 else None
        if self.lora is not None:
            if not trainable:
                raise ValueError("LoRA adapters are for a trainable model; a frozen one is the actor's base")
            lora_adapters.attach(module, shape, self.lora)  # before DDP: it buckets the adapters only
        module = in_model_precision(module, self.config)
        self.routing_replay = routing_replay
        self._taps = []
        if shape.is_moe:
            _experts_apart(module)
            self._taps = routing.install_taps(module, shape, self.config.moe_router_pre_softmax)
        self.optimizer = self.scheduler = None
        if not trainable:
            module.eval()
            for p in module.parameters():
                p.requires_grad_(False)
            self.model = module
            return
        optim = optim or OptimConfig()
        with cpu_compat.megatron_scope():
            self.model = DistributedDataParallel(
                config=self.config,
                ddp_config=DistributedDataParallelConfig(
                    grad_reduce_in_fp32=True, use_distributed_optimizer=optim.use_distributed_optimizer
                ),
                module=module,
            )
        # Without this Megatron's DDP never all-reduces gradients: DP ranks silently diverge.
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.model.no_sync
        self._build_optimizer(optim)

    def _build_module(self, shape: ModelShape, use_transformer_engine: bool | None):
        """The GPTModel with its output layer; a subclass with another head replaces that layer."""
        return build_gpt_model(shape, self.config, use_transformer_engine=use_transformer_engine,
                               local_kernels=self.local_kernels, vocab_size=self.padded_vocab_size)

    def _per_token(self, output: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        """The head's number for each position but the last, [b, s - 1], from the model's output."""
        raise NotImplementedError

    def _per_position(self, output: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
        """`_per_token` for positions that come with their next token as `labels` [b, s] (context parallelism)."""
        raise NotImplementedError

    def _loss_inputs(self, output: torch.Tensor, mb: dict, loss_fn: LossFn, temperature: float,
                     whole: Callable[[torch.Tensor], torch.Tensor]) -> dict:
        """The micro-batch the loss sees; a head may add what it computes from the output (`whole` gathers a
        per-position tensor over context-parallel ranks)."""
        return mb

    def _head(self, output: torch.Tensor, mb: dict, labels: torch.Tensor | None, temperature: float,
              loss_fn: LossFn | None, whole: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """The per-token output [b, S - 1] and the micro-batch the loss sees (`loss_fn` None: `mb`): `_per_token`,
        or with context parallelism (`labels`: this rank's next tokens) `_per_position` gathered by `whole`, then
        `_loss_inputs`. A head that computes both in one pass replaces this."""
        if labels is not None:
            per_token = whole(self._per_position(output, labels, temperature))
        else:
            per_token = self._per_token(output, mb["tokens"], temperature)
        if loss_fn is None:
            return per_token, mb
        return per_token, self._loss_inputs(output, mb, loss_fn, temperature, whole)

    def _output_scope(self):
        """A context the forward(-backward) schedule runs in; a head may change what the model outputs there."""
        return contextlib.nullcontext()

    # -- weights -------------------------------------------------------------------------------------------

    _hf_skip: tuple[str, ...] = ()  # parameters (name prefixes) a head has no HF tensor for: left as initialised

    base_checkpoint: str = ""  # the HF directory `load_hf` read: a LoRA checkpoint records its base's fingerprint

    def load_hf(self, hf_dir) -> None:
        """This rank's shard from an HF checkpoint directory."""
        convert.load_hf_weights(self.model, hf_dir, self.shape, skip=self._hf_skip)
        self.base_checkpoint = str(hf_dir)
        if self.optimizer is not None:
            # Megatron's optimizer may keep fp32 main copies of the params; refresh them from the model.
            reload = getattr(self.optimizer, "reload_model_params", None)  # not every Megatron optimizer has one
            if reload is not None:
                with cpu_compat.megatron_scope():
                    reload()

    @cpu_compat.in_megatron_scope
    def _build_optimizer(self, optim: OptimConfig) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
                adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                clip_grad=optim.clip_grad, bf16=self.config.bf16, params_dtype=self.config.params_dtype,
                use_distributed_optimizer=optim.use_distributed_optimizer,
            ),
            [self.model],
        )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if optim.lr_warmup_steps else optim.lr, max_lr=optim.lr,
            min_lr=optim.min_lr, lr_warmup_steps=optim.lr_warmup_steps,
            lr_decay_steps=max(optim.lr_decay_steps, optim.lr_warmup_steps + 1), lr_decay_style=optim.lr_decay_style,
            start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=1, wd_incr_style="constant",
        )

    _offloader = None

    def offload(self, *, params: bool = True, optimizer: bool = True) -> int:
        """Free GPU memory for the colocated rollout engine: gradients, and optimizer states and/or weights
        (moved to CPU); returns the bytes freed. `onload` brings everything back."""
        from megarl.mcore.offload import Offloader

        if self._offloader is None:
            self._offloader = Offloader(self.model, self.optimizer)
        return self._offloader.offload(params=params, grads=self.trainable, optimizer=optimizer)

    def onload(self) -> int:
        return self._offloader.onload() if self._offloader is not None else 0

    # -- compute -------------------------------------------------------------------------------------------

    def _run(self, batch: dict[str, torch.Tensor], loss_fn: LossFn | None, micro_batch_size: int,
             temperature: float, forward_only: bool, max_tokens: int = 0, head=None) -> list[dict]:
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        device = parallel.device()
        batch = {k: v.to(device) for k, v in batch.items()}
        routing.take_metrics(self._taps)  # this run's counts only
        if max_tokens > 0:  # PP = 1 only (`megarl.config`): pipeline stages exchange fixed-shape micro-batches
            micro = _budget_micro_batches(batch, max_tokens)
        else:
            # A batch smaller than a micro-batch (a PPO mini-batch, a short last batch) is one micro-batch of its
            # own size: padding it to --micro-batch-size rows would compute the empty rows too.
            micro_batch_size = max(1, min(micro_batch_size, batch["tokens"].shape[0]))
            micro = _micro_batches(batch, micro_batch_size)
        # Sequence parallelism splits the sequence over TP ranks: widths are padded to a multiple of TP (on the
        # right, so causal attention keeps the real positions unchanged) and the padding's logits cut off.
        pad_to = self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1
        seq_len = -(-batch["tokens"].shape[1] // pad_to) * pad_to
        # Context parallelism: each CP rank runs its 2 of 2 x CP chunks of every sequence (megarl/mcore/
        # context_parallel.py); per-token results are gathered back into whole sequences before the loss.
        cp, cp_rank, group = self.config.context_parallel_size, 0, None
        if cp > 1:
            cp_rank, group = parallel_state.get_context_parallel_rank(), parallel.cp_group()
            seq_len = context_parallel.padded_width(batch["tokens"].shape[1], cp, pad_to)

        def whole(local: torch.Tensor, width: int) -> torch.Tensor:
            return context_parallel.gather_from_cp_ranks(local, group)[:, : width - 1]

        def loss_func(mb, labels, output):
            width = mb["tokens"].shape[1]
            if head is not None:  # another per-token output than the model's own (`_forward_only`), from logits
                logp, inputs = head(output, mb["tokens"], temperature), mb
            else:
                logp, inputs = self._head(output, mb, labels, temperature, loss_fn,
                                          (lambda x: whole(x, width)) if cp > 1 else (lambda x: x))
            if loss_fn is None:
                zero = logp.sum() * 0.0
                out = {"logprobs": logp.detach()[: mb["_real_rows"]]}
                if "_rows" in mb:
                    out["_rows"] = mb["_rows"]
                return zero, torch.tensor(1, dtype=torch.int), out
            loss_sum, denom, metrics = loss_fn(logp, inputs)
            # With CP every CP rank returns the whole sequences' loss and count, and Megatron sums gradients and
            # counts over DP x CP ranks while each rank's gradient covers only its own positions: scaling the
            # loss by CP makes the summed gradient over the summed count the per-token mean.
            return loss_sum * cp if cp > 1 else loss_sum, denom.to(torch.int), metrics

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            tokens = mb["tokens"]
            width = tokens.shape[1]
            padded = context_parallel.padded_width(width, cp, pad_to)
            if padded != width:
                tokens = torch.nn.functional.pad(tokens, (0, padded - width))
            positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
            if self._taps:
                experts = mb.get("routing")
                if experts is not None and experts.shape[1] != tokens.shape[1]:
                    experts = torch.nn.functional.pad(experts, (0, 0, 0, 0, 0, tokens.shape[1] - experts.shape[1]),
                                                      value=-1)
                sp = self.config.sequence_parallel
                routing.set_routing(self._taps, experts, self.routing_replay,
                                    parallel_state.get_tensor_model_parallel_rank() if sp else 0,
                                    self.config.tensor_model_parallel_size if sp else 1)
            labels = None
            if cp > 1:  # this rank's chunks of the inputs, and of the next-token labels (0 after the last token)
                labels = torch.nn.functional.pad(tokens[:, 1:], (0, 1))
                tokens, positions, labels = (context_parallel.split_for_cp_rank(t, cp_rank, cp)
                                             for t in (tokens, positions, labels))
            output = model(tokens, positions, None)
            if cp == 1 and tokens.shape[1] != width and convert.unwrap(model).post_process:
                output = output[:, :width]
            return output, partial(loss_func, mb, labels)

        with cpu_compat.megatron_scope(), (self._output_scope() if head is None else contextlib.nullcontext()):
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro),
                model=[self.model],
                num_microbatches=len(micro),
                seq_length=seq_len,
                micro_batch_size=micro_batch_size,
                forward_only=forward_only,
            )

    @torch.no_grad()
    def _forward_only(self, tokens: torch.Tensor, *, micro_batch_size: int, temperature: float = 1.0,
                      lengths: torch.Tensor | None = None, max_tokens_per_micro_batch: int = 0,
                      routing: torch.Tensor | None = None, head=None) -> torch.Tensor | None:
        """The head's per-token output [B, S - 1] (`_per_token`) on the last pipeline stage, None on the others.
        With a token budget, micro-batches follow `_budget_micro_batches` (positions past a row's length come back
        as 0). `routing`: the engine's experts per token (replayed with `routing_replay`). `head(output, tokens,
        temperature)`: another output per micro-batch than `_per_token` (context parallelism 1 only)."""
        if head is not None and (self.config.context_parallel_size > 1 or max_tokens_per_micro_batch):
            raise ValueError("a forward with another head needs --context-parallel-size 1 and fixed micro-batches")
        self.model.eval()
        batch = {"tokens": tokens} if lengths is None else {"tokens": tokens, "lengths": lengths}
        if routing is not None:
            batch["routing"] = routing
        outputs = self._run(batch, None, micro_batch_size, temperature, forward_only=True,
                            max_tokens=max_tokens_per_micro_batch, head=head)
        if not outputs:
            return None
        if "_rows" not in outputs[0]:
            return torch.cat([o["logprobs"] for o in outputs], dim=0)
        first = outputs[0]["logprobs"]  # same device as the fixed-micro-batch path returns
        full = torch.zeros(tokens.shape[0], tokens.shape[1] - 1, dtype=first.dtype, device=first.device)
        for o in outputs:
            full[o["_rows"], : o["logprobs"].shape[1]] = o["logprobs"]
        return full

    def _routing_sums(self) -> dict[str, float]:
        """The routers' counts of the last run (`routing.take_metrics`), summed over pipeline stages so that the
        last stage, which reports, holds every layer's; {} for a dense model."""
        if not self._taps and not self.shape.is_moe:
            return {}
        from megatron.core import parallel_state

        sums = routing.take_metrics(self._taps)
        if self.config.pipeline_model_parallel_size > 1:
            t = torch.tensor(list(sums.values()), dtype=torch.float64)
            t = parallel.all_reduce_host(t, group=parallel_state.get_pipeline_model_parallel_group())
            sums = dict(zip(sums, t.tolist()))
        return sums

    def train_step(self, batch: dict[str, torch.Tensor], loss_fn: LossFn, *, micro_batch_size: int,
                   temperature: float = 1.0, max_tokens_per_micro_batch: int = 0) -> dict[str, float]:
        """One optimizer step over `batch` (this DP rank's share of the global batch)."""
        assert self.trainable, "the reference model is frozen"
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run(batch, loss_fn, micro_batch_size, temperature, forward_only=False,
                            max_tokens=max_tokens_per_micro_batch)
        moe = self._routing_sums()
        with cpu_compat.megatron_scope():
            ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        # Metrics live on the last stage; sum them there and let the caller reduce over ranks.
        sums: dict[str, float] = {}
        for o in outputs:
            for k, v in o.items():
                v = float(v)
                sums[k] = max(sums.get(k, v), v) if k.endswith("_max") else sums.get(k, 0.0) + v
        sums.update(moe)
        sums["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        sums["update_skipped"] = 0.0 if ok else 1.0
        sums["lr"] = self.optimizer.param_groups[0]["lr"]
        return sums
