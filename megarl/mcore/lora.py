"""LoRA adapters on the Megatron actor's linear layers, sharded with tensor parallelism (`--lora-rank`, ...).

An adapter adds `scale * B A x` to a frozen linear layer's output, `scale = alpha / rank` (PEFT's `LoraLayer`
without rsLoRA: dropout on the adapter's input, A Kaiming-uniform, B zero, so a new adapter changes nothing).
Targets are named as in Hugging Face / PEFT (`q_proj` ... `down_proj`) so an adapter converts to a PEFT directory
one tensor to one tensor. Megatron fuses some of them: `linear_qkv` holds q, k and v (rows grouped by KV head,
`megarl.mcore.convert`), `linear_fc1` holds [gate ; up]; each fused part keeps an A and a B of its own, as PEFT's
separate projections do, and the parts' outputs are put in the fused layout.

Tensor parallelism, as the base layer is split:
- column-parallel (qkv, fc1; output rows split): A replicated, B split by output rows. `h = A x` is computed on
  every TP rank, and its gradient all-reduced over TP before A's (each rank's B sees its own output rows); with
  sequence parallelism `h` is gathered over the sequence instead, and A's gradient all-reduced over TP by
  Megatron (`sequence_parallel` set on it, as on its norms).
- row-parallel (proj, fc2; input columns split): A split by input columns, B replicated. `A x` is a partial sum,
  all-reduced (sequence parallelism: reduce-scattered over the sequence, and B's gradient all-reduced by Megatron).
Every piece is a local shard of the full (TP 1) adapter, so the merged weight `W + scale B A` is merged shard by
shard with no communication (`merged`), and A is initialised as a whole and sliced, so TP 1 and TP 2 build the
same adapter from the same seed.

Adapters hang off their layer as a child module `lora` (parameter names `...linear_qkv.lora.A.q`), run in a
forward hook, and leave the base layer's parameters, names and checkpoint entries as they are. The base weights are
frozen (`requires_grad` False): Megatron's DDP, optimizer and gradient clipping then see the adapters only.
Exports merge them into their layer's weight (`convert.iter_hf_weights`); `peft_tensors` gives them in PEFT's form.
`adapters_disabled` turns them off for a forward: the reference log-probs come from the actor itself.

Mixture-of-experts experts (`experts.gate_up_proj`, `experts.down_proj`): transformers holds a Qwen3-MoE layer's
experts as two fused parameters, [experts, 2 x moe_ffn, hidden] and [experts, hidden, moe_ffn], and PEFT adapts them
through `target_parameters` (its `ParamWrapper`): one A and one B per expert over the fused [gate ; up], the experts'
A stacked by rows, their B interleaved by columns (`_expert_layout`). Megatron's experts (SequentialMLP, the layout
megarl builds) are one MLP per expert, `local_experts.<j>.linear_fc1` = [gate ; up] (the same order), so each local
expert's fc1 and fc2 get an adapter of one part, and `peft_tensors` / `load_peft_tensors` stack and unstack them.
Expert parallelism needs nothing more: an EP rank holds its experts' adapters, gathered over EP for a PEFT export,
their gradients reduced over the expert-data-parallel group with the experts' own. Expert-tensor parallelism > 1 is
refused: Megatron's experts leave the TP reduction of fc2 to the token dispatcher, so a replicated B of fc2 would get
a partial gradient that nothing sums. Dense MLP targets stay refused on a mixture-of-experts model: PEFT 0.21 reads a
`down_proj` module target next to `target_parameters` as a parameter name, so there is no reference to match.
"""

from __future__ import annotations

import contextlib
import math
import re
import types
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megarl.mcore.convert import global_param_names, is_adapter_param, unwrap

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS

# Megatron layer (under a transformer layer) -> (parallel mode, the HF projections it fuses, in order).
_LAYERS = {
    "self_attention.linear_qkv": ("column", ("q_proj", "k_proj", "v_proj")),
    "self_attention.linear_proj": ("row", ("o_proj",)),
    "mlp.linear_fc1": ("column", ("gate_proj", "up_proj")),
    "mlp.linear_fc2": ("row", ("down_proj",)),
}
# A local expert's Megatron layer -> the same, for the expert targets.
_EXPERT_LAYERS = {
    "linear_fc1": ("column", ("experts.gate_up_proj",)),
    "linear_fc2": ("row", ("experts.down_proj",)),
}
# HF module of each projection, under model.layers.L (PEFT's names follow it).
HF_MODULE = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
             "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
             "down_proj": "mlp.down_proj"}


@dataclass(frozen=True)
class LoRAOptions:
    """`--lora-rank`, `--lora-alpha`, `--lora-dropout`, `--lora-target-modules`; rank 0 = no adapters."""

    rank: int = 0
    alpha: float = 0.0  # 0 = the rank (scale 1)
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS
    seed: int = 0

    @property
    def scale(self) -> float:
        return (self.alpha or self.rank) / self.rank

    @classmethod
    def from_config(cls, m, seed: int = 0) -> "LoRAOptions":
        """From `megarl.config.ModelConfig`'s flags."""
        return cls(rank=m.lora_rank, alpha=m.lora_alpha, dropout=m.lora_dropout, targets=m.lora_targets, seed=seed)


class LoRAAdapter(torch.nn.Module):
    """The adapter of one Megatron linear layer: an A [rank, in(/tp)] and a B [out(/tp), rank] per fused part
    (`A.q`, `B.q`, ...), keyed by the part's HF projection name without `_proj`."""

    def __init__(self, base: torch.nn.Module, mode: str, parts: tuple[str, ...], targets: tuple[str, ...],
                 opts: LoRAOptions, layout: dict, name: str, expert: bool = False):
        super().__init__()
        from megatron.core import parallel_state as ps

        self.mode, self.parts, self.scale, self.enabled = mode, parts, opts.scale, True
        self.layout = layout  # how the parts sit in the fused output: {"kind": "qkv"|"concat", ...}
        if expert:  # an expert's input is this rank's dispatched tokens, whole: no sequence parallelism
            self.tp_rank, self.tp_group = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_group()
            self.tp_size, self.sequence_parallel = ps.get_expert_tensor_parallel_world_size(), False
        else:
            self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
            self.tp_group = ps.get_tensor_model_parallel_group()
            self.sequence_parallel = bool(getattr(base.config, "sequence_parallel", False))
        self.dropout = torch.nn.Dropout(opts.dropout) if opts.dropout > 0 else torch.nn.Identity()
        weight = base.weight
        out_local, in_local = weight.shape
        self.targets = tuple(p for p in parts if p in targets)
        self.A, self.B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for p in self.targets:
            key = _key(p)
            in_full = in_local * (self.tp_size if mode == "row" else 1)
            a = _kaiming_uniform(opts.rank, in_full, seed=opts.seed, name=f"{name}.{key}")
            if mode == "row":
                a = torch.chunk(a, self.tp_size, dim=1)[self.tp_rank]
            rows = self.part_rows(p, out_local) if mode == "column" else out_local
            self.A[key] = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
            self.B[key] = torch.nn.Parameter(torch.zeros(rows, opts.rank, device=weight.device, dtype=weight.dtype))
            sharded, replicated = (self.B[key], self.A[key]) if mode == "column" else (self.A[key], self.B[key])
            _mark(sharded, tensor_parallel=True, partition_dim=0 if mode == "column" else 1)
            _mark(replicated, tensor_parallel=False, partition_dim=-1)
            # Megatron all-reduces over TP the gradients of replicated parameters that see only this rank's
            # sequence chunk: A of a column-parallel layer, B of a row-parallel one.
            replicated.sequence_parallel = self.sequence_parallel

    def part_rows(self, part: str, out_local: int) -> int:
        """Rows of this TP rank's share of `part` in the fused output."""
        if self.layout["kind"] == "qkv":
            g, d, per = self.layout["groups"] // self.tp_size, self.layout["head_dim"], self.layout["per_group"]
            return g * d * (per if part == "q_proj" else 1)
        return out_local // len(self.parts)

    def _fuse(self, pieces: dict[str, torch.Tensor], out_local: int, like: torch.Tensor) -> torch.Tensor:
        """The parts' outputs [..., rows_p] (missing parts: zeros) in the fused layer's output layout [..., out]."""
        full = [pieces.get(_key(p)) for p in self.parts]
        full = [t if t is not None else like.new_zeros(*like.shape[:-1], self.part_rows(p, out_local))
                for t, p in zip(full, self.parts)]
        if self.layout["kind"] != "qkv":
            return torch.cat(full, dim=-1)
        g = self.layout["groups"] // self.tp_size
        lead = full[0].shape[:-1]
        return torch.cat([t.reshape(*lead, g, -1) for t in full], dim=-1).reshape(*lead, out_local)

    def delta(self, out_local: int) -> torch.Tensor:
        """`scale * B A` as this rank's shard of the layer's weight, [out(/tp), in(/tp)] (fp32)."""
        pieces = {k: (self.B[k].float() @ self.A[k].float()).t() for k in self.A}  # [in, rows_p]
        like = next(iter(pieces.values()))
        return (self._fuse(pieces, out_local, like) * self.scale).t()

    def forward(self, x: torch.Tensor, out_local: int) -> torch.Tensor:
        """The adapter's share of the layer's output for input `x` (already normalised)."""
        from megatron.core.tensor_parallel import mappings

        x = self.dropout(x)
        keys = list(self.A)
        h = F.linear(x, torch.cat([self.A[k] for k in keys], dim=0))  # [..., rank * parts]
        group = self.tp_group
        if self.mode == "column":
            h = (mappings.gather_from_sequence_parallel_region(h, group=group) if self.sequence_parallel
                 else mappings.copy_to_tensor_model_parallel_region(h, group=group))
        else:
            h = (mappings.reduce_scatter_to_sequence_parallel_region(h, group=group) if self.sequence_parallel
                 else mappings.reduce_from_tensor_model_parallel_region(h, group=group))
        hs = torch.chunk(h, len(keys), dim=-1)
        pieces = {k: F.linear(hk, self.B[k]) for k, hk in zip(keys, hs)}
        return self._fuse(pieces, out_local, hs[0]) * self.scale


def _key(part: str) -> str:
    """A part's key in the adapter's `A` and `B`: `q_proj` -> `q`, `experts.gate_up_proj` -> `gate_up`."""
    return part.rpartition(".")[2].removesuffix("_proj")


def _mark(p: torch.nn.Parameter, *, tensor_parallel: bool, partition_dim: int) -> None:
    """Megatron's TP attributes: grad-norm clipping counts a replicated parameter once, checkpoints shard the rest."""
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = tensor_parallel, partition_dim, 1


def _kaiming_uniform(rows: int, cols: int, *, seed: int, name: str) -> torch.Tensor:
    """PEFT's (and torch.nn.Linear's) initialisation of A, kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in)),
    drawn from a generator seeded by the run's seed and the layer's global name, so a layout change (TP, PP) does
    not change the adapter."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(cols)
    return torch.rand(rows, cols, generator=g, dtype=torch.float32) * (2 * bound) - bound


def _hook(module: torch.nn.Module, args: tuple, output):
    adapter = module.lora
    if not adapter.enabled:
        return output
    out, bias = output if isinstance(output, tuple) else (output, None)
    x = args[0]
    norm = getattr(module, "layer_norm_weight", None)  # Transformer Engine fuses the norm into the layer
    if norm is not None:
        gamma = norm + 1 if getattr(module.config, "layernorm_zero_centered_gamma", False) else norm
        x = F.rms_norm(x, (x.shape[-1],), gamma, module.config.layernorm_epsilon)
    out = out + adapter(x, out.shape[-1]).to(out.dtype)
    return (out, bias) if isinstance(output, tuple) else out


def _sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
    """The layer's own checkpoint entries, then the adapter's with its TP split (the layer's own method would save
    every adapter tensor as replicated)."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    out = {k: v for k, v in self._base_sharded_state_dict(prefix, sharded_offsets, metadata).items()
           if not k.startswith(f"{prefix}lora.")}
    state = {f"lora.{k}": v for k, v in self.lora.state_dict(prefix="", keep_vars=True).items()}
    axes = {k: v.partition_dim for k, v in state.items() if v.tensor_model_parallel}
    out.update(make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets,
                                                   tp_group=getattr(self, "tp_group", None),
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group")))
    return out


def attach(model: torch.nn.Module, shape, opts: LoRAOptions) -> list[LoRAAdapter]:
    """Adapters on `model`'s (a GPTModel stage, unwrapped) targeted layers, and every other parameter frozen.
    Call before Megatron's DDP wraps the model."""
    if shape.is_moe and set(opts.targets) & set(MLP_TARGETS):
        raise ValueError(f"--lora-target-modules {','.join(opts.targets)}: a mixture-of-experts model's MLP "
                         f"targets are its experts; choose among {','.join(ATTENTION_TARGETS + EXPERT_TARGETS)}")
    if getattr(shape, "is_mla", False) and set(opts.targets) & {"q_proj", "k_proj", "v_proj"}:
        raise ValueError(f"--lora-target-modules {','.join(opts.targets)}: multi-latent attention ({shape.family}) "
                         "has no q/k/v projections (its own, q_a/q_b/kv_a/kv_b, are not adapted by megarl); "
                         f"choose among o_proj,{','.join(EXPERT_TARGETS)}")
    if not shape.is_moe and set(opts.targets) & set(EXPERT_TARGETS):
        raise ValueError(f"--lora-target-modules {','.join(opts.targets)}: the {shape.family} model has no experts; "
                         f"choose among {','.join(TARGETS)}")
    if set(opts.targets) & set(EXPERT_TARGETS):
        from megatron.core import parallel_state as ps

        if ps.get_expert_tensor_parallel_world_size() > 1:
            raise ValueError(f"--lora-target-modules {','.join(opts.targets)}: expert adapters need "
                             f"--expert-tensor-parallel-size 1 (got {ps.get_expert_tensor_parallel_world_size()}): "
                             "Megatron's experts leave fc2's TP reduction to the token dispatcher, so a replicated "
                             "B would get a partial gradient")
    if set(opts.targets) & set(EXPERT_TARGETS):  # else the grouped experts would be left out in silence
        grouped = [type(m).__name__ for n, m in model.named_modules()
                   if n.endswith("mlp.experts") and not hasattr(m, "local_experts")]
        if grouped:
            raise ValueError(f"--lora-target-modules {','.join(opts.targets)}: expert adapters need Megatron's "
                             f"SequentialMLP experts (the local spec); this model's experts are {grouped[0]} "
                             "(Transformer Engine's spec, grouped GEMM), which megarl does not adapt: drop the "
                             "experts.* targets, or build the actor with the local spec")
    for name, module in model.named_modules():
        if hasattr(module, "layer_norm_weight") and getattr(module.config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError(f"LoRA on {name}: Transformer Engine fuses a {module.config.normalization} into this "
                             "layer, and the adapter's input is normalised as RMSNorm (the norm of every model "
                             "family megarl reads)")
    for p in model.parameters():
        p.requires_grad_(False)
    names = global_param_names(model)
    adapters = []
    for local_name, module in model.named_modules():
        expert = ".mlp.experts.local_experts." in local_name
        for suffix, (mode, parts) in (_EXPERT_LAYERS if expert else _LAYERS).items():
            if not local_name.endswith(suffix) or (".experts." in local_name and not expert):
                continue
            if not set(parts) & set(opts.targets):
                continue
            global_name = names[f"{local_name}.weight"].removesuffix(".weight")
            layout = ({"kind": "qkv", "groups": shape.num_kv_heads, "head_dim": shape.head_dim,
                       "per_group": shape.num_attention_heads // shape.num_kv_heads}
                      if suffix.endswith("linear_qkv") else {"kind": "concat"})
            adapter = LoRAAdapter(module, mode, parts, opts.targets, opts, layout, global_name, expert=expert)
            module.lora = adapter
            module.register_forward_hook(_hook)
            module._base_sharded_state_dict = module.sharded_state_dict
            module.sharded_state_dict = types.MethodType(_sharded_state_dict, module)
            adapters.append(adapter)
    if not adapters:
        raise ValueError(f"--lora-target-modules {','.join(opts.targets)} matched no layer of this model")
    return adapters


def adapters(model: torch.nn.Module) -> list[LoRAAdapter]:
    return [m for m in model.modules() if isinstance(m, LoRAAdapter)]


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Forwards inside run the base model alone: the reference policy, bitwise the model before any update."""
    found = adapters(model)
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a in found:
            a.enabled = True


def _peft_names(model: torch.nn.Module) -> dict[str, tuple[str, int | None]]:
    """Local adapter parameter name -> (PEFT's name in `adapter_model.safetensors`, the global expert index or None).
    PEFT nests the wrappers of an MoE layer's two expert parameters: with both adapted, gate_up's sit under
    `base_layer.`."""
    names = {k: v for k, v in global_param_names(model).items() if is_adapter_param(v)}
    expert_keys = {g.rpartition(".")[2] for g in names.values() if ".mlp.experts." in g}
    nested = expert_keys >= {"gate_up", "down"}
    out = {}
    for local_name, global_name in names.items():
        layer, rest = global_name.removeprefix("decoder.layers.").split(".", 1)
        which, part = rest.rsplit(".", 2)[-2:]  # "A", "q"
        prefix = f"base_model.model.model.layers.{layer}."
        expert = re.match(r"mlp\.experts\.local_experts\.(\d+)\.", rest)
        if expert:
            inner = "base_layer." if nested and part == "gate_up" else ""
            out[local_name] = (f"{prefix}mlp.experts.{inner}lora_{which}.weight", int(expert[1]))
        else:
            out[local_name] = (f"{prefix}{HF_MODULE[part + '_proj']}.lora_{which}.weight", None)
    return out


def _stack_experts(which: str, per_expert: list[torch.Tensor]) -> torch.Tensor:
    """The experts' A [rank, in] or B [out, rank], in global expert order, as PEFT's `ParamWrapper` holds them
    fused: A stacked by rows [experts x rank, in]; B [out, rank x experts], expert e's column k at k x experts + e
    (PEFT reads B as [out, rank, experts])."""
    if which == "A":
        return torch.cat(per_expert, dim=0)
    return torch.stack(per_expert, dim=-1).reshape(per_expert[0].shape[0], -1)


def _unstack_expert(which: str, fused: torch.Tensor, expert: int, num_experts: int) -> torch.Tensor:
    """Expert `expert`'s A or B out of PEFT's fused tensor (`_stack_experts`' inverse)."""
    if which == "A":
        rank = fused.shape[0] // num_experts
        return fused[expert * rank:(expert + 1) * rank]
    return fused.reshape(fused.shape[0], -1, num_experts)[:, :, expert]


def load_peft_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy whole PEFT-named adapter tensors (`peft_tensors`' form) into this rank's shards; every adapter of the
    stage must be there."""
    model = unwrap(model)
    params = dict(model.named_parameters())
    for local_name, (peft_name, expert) in _peft_names(model).items():
        p = params[local_name]
        if peft_name not in tensors:
            raise KeyError(f"adapter tensor {peft_name} missing (the adapters' ranks and targets must match)")
        full = tensors[peft_name]
        if expert is not None:
            full = _unstack_expert(peft_name.rsplit(".", 2)[-2][-1], full, expert, model.config.num_moe_experts)
        elif p.tensor_model_parallel and p.shape != full.shape:
            from megatron.core import parallel_state as ps

            full = torch.chunk(full, ps.get_tensor_model_parallel_world_size(), dim=p.partition_dim)[
                ps.get_tensor_model_parallel_rank()]
        with torch.no_grad():
            p.copy_(full)


def peft_tensors(model: torch.nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """This pipeline stage's adapters as PEFT names them in `adapter_model.safetensors`
    (`base_model.model.model.layers.L.self_attn.q_proj.lora_A.weight`), whole: the TP-split halves gathered over
    the tensor-parallel group, experts over the expert-parallel group and fused as PEFT holds them (every TP and
    EP rank gets them, every one must call this). `grads`: their gradients (Megatron DDP's `main_grad`) instead."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    model = unwrap(model)
    params = dict(model.named_parameters())
    tp, group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
    out, experts = {}, {}
    for local_name, (peft_name, expert) in _peft_names(model).items():
        param = params[local_name]
        p = (param.main_grad if grads else param).detach()
        if expert is not None:  # expert-TP is 1 (`attach`)
            experts.setdefault(peft_name, {})[expert] = p
            continue
        if tp > 1 and param.tensor_model_parallel:
            pieces = [torch.empty_like(p) for _ in range(tp)]
            dist.all_gather(pieces, p.contiguous(), group=group)
            p = torch.cat(pieces, dim=param.partition_dim)
        out[peft_name] = p.clone()
    ep = ps.get_expert_model_parallel_world_size()
    for peft_name in sorted(experts):  # the same names, in the same order, on every EP rank
        local = torch.stack([experts[peft_name][e] for e in sorted(experts[peft_name])])
        if ep > 1:  # EP rank r holds experts r x E / EP ... in order
            pieces = [torch.empty_like(local) for _ in range(ep)]
            dist.all_gather(pieces, local.contiguous(), group=ps.get_expert_model_parallel_group())
            local = torch.cat(pieces)
        out[peft_name] = _stack_experts(peft_name.rsplit(".", 2)[-2][-1], list(local))
    return out


def peft_target_parameters(targets: tuple[str, ...]) -> list[str]:
    """PEFT's `target_parameters` for the expert targets among `targets` (transformers' fused expert parameters)."""
    return [f"mlp.{t}" for t in EXPERT_TARGETS if t in targets]


def peft_config(opts: LoRAOptions, base: str) -> dict:
    """`adapter_config.json` for `peft.PeftModel.from_pretrained`: the adapters' rank, alpha, dropout and targets
    on the HF model at `base` (PEFT's defaults for the rest)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base), "r": opts.rank,
            "lora_alpha": opts.alpha or opts.rank, "lora_dropout": opts.dropout,
            "target_modules": [t for t in opts.targets if t not in EXPERT_TARGETS],
            "target_parameters": peft_target_parameters(opts.targets),
            "bias": "none", "use_rslora": False, "fan_in_fan_out": False, "inference_mode": True}


def all_peft_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every pipeline stage's adapters (`peft_tensors`), whole and on the CPU, on every rank of the model-parallel
    group, which all call it: what a PEFT directory or SGLang's LoRA API (`--lora-weight-sync adapter`) takes."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tensors = {k: v.cpu() for k, v in peft_tensors(model).items()}
    if ps.get_pipeline_model_parallel_world_size() > 1:
        stages = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(stages, tensors, group=ps.get_pipeline_model_parallel_group())
        tensors = {k: v for stage in stages for k, v in stage.items()}
    return tensors


def save_peft(model: torch.nn.Module, opts: LoRAOptions, base: str, out_dir: str) -> None:
    """`--save-peft`: the adapters as a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`)
    that `peft.PeftModel.from_pretrained(<HF model at base>, out_dir)` loads. Every rank calls it: TP shards are
    gathered, pipeline stages' adapters sent to the first stage, and global rank 0 writes."""
    import json
    from pathlib import Path

    import torch.distributed as dist
    from safetensors.torch import save_file

    tensors = {k: v.float() for k, v in all_peft_tensors(model).items()}
    if dist.get_rank() == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
        (out / "adapter_config.json").write_text(json.dumps(peft_config(opts, base), indent=2) + "\n")
    dist.barrier()
