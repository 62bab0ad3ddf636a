"""Hugging Face <-> Megatron weights: one name/reshape table per model family.

Megatron names here are those of the local layer spec, with the global layer index and, for experts, the global
expert index; Transformer Engine folds the norms into the following linear layer (`layer_norm_weight`) and names
its grouped experts `mlp.experts.linear_fc1.weight<j>`, both mapped by `global_param_names`.

Mixture of experts (qwen3_moe): each rank of expert-parallel rank r holds experts r * E / EP .. (r + 1) * E / EP - 1
as `mlp.experts.local_experts.<j>`, each sharded over the expert-tensor-parallel group (not the attention's TP).
Loading picks the rank's experts by their global index; exporting gathers each over expert-TP, then over EP.
On disk (and in every rollout engine) the experts are HF's per-expert tensors
`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`, the router `model.layers.L.mlp.gate.weight`.

Reshapes:
- `qkv`: HF's separate q/k/v projections -> Megatron's fused `linear_qkv`, grouped by KV head:
  for each KV group g, [q heads of g ; k_g ; v_g] rows. Because the grouping is by KV head, TP shards of the
  fused tensor are plain row chunks.
- `gate_up`: HF's gate/up -> Megatron's fused `linear_fc1` = [gate ; up]. Each TP rank holds
  [gate shard ; up shard], so sharding and gathering split the two halves separately.
- `vocab`: the embedding and the output layer. Megatron's may have more rows than the HF vocabulary
  (`--make-vocab-size-divisible-by`, `megarl.preflight.padded_vocab_size`): loading appends zero rows, exporting
  drops them, so a checkpoint converts back exactly.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

from megarl.mcore import cpu_compat
from megarl.model_shape import ModelShape
from megarl.models import FAMILIES
from megarl.models.weights import Rule  # also `megarl.mcore.convert.Rule`, the name importers use


class _FamilyRules(Mapping):
    """Each registered family's weight table by name (`megarl.models.FAMILIES`), plugins' included."""

    def __getitem__(self, family: str) -> tuple[Rule, ...]:
        if family not in FAMILIES:
            raise KeyError(family)
        return FAMILIES.get(family).weight_rules

    def __iter__(self):
        return iter(FAMILIES.names())

    def __len__(self) -> int:
        return len(FAMILIES.names())


# Llama and Qwen2 share a layout; Qwen2 always has q/k/v biases (ModelShape.qkv_bias). Qwen3 adds the q/k norms,
# Qwen3-MoE the router and experts (its dense layers, `mlp_only_layers`, keep the dense MLP's names). The tables
# live with their families, `megarl/models/<family>/`.
FAMILY_RULES: Mapping[str, tuple[Rule, ...]] = _FamilyRules()

_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    # MLA on the TE spec (megatron-core's `get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True)`):
    # the latent norms fold into the up projections. Not run here (no TE on CPU).
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
}


def rules_for(shape: ModelShape) -> list[Rule]:
    if shape.family not in FAMILY_RULES:
        raise ValueError(f"no weight table for model family {shape.family!r}; known: {', '.join(FAMILY_RULES)}")
    flags = {"untied": not shape.tie_word_embeddings, "qkv_bias": shape.qkv_bias,
             "q_lora": shape.q_lora_rank > 0, "q_full": shape.q_lora_rank == 0}
    family = FAMILIES.get(shape.family)
    if shape.qk_norm != family.qk_norm or shape.is_moe != family.moe:
        kinds = [FAMILIES.get(n) for n in FAMILIES.names()]
        raise ValueError(f"no weight table for a {shape.family} model with qk_norm={shape.qk_norm} and "
                         f"{shape.num_experts} experts (qk norms: {', '.join(f.name for f in kinds if f.qk_norm)}; "
                         f"experts: {', '.join(f.name for f in kinds if f.moe)})")
    return [r for r in FAMILY_RULES[shape.family] if r.when is None or flags[r.when]]


def _compile(rules: list[Rule]) -> list[tuple[re.Pattern, Rule]]:
    out = []
    for r in rules:
        pattern = re.escape(r.mcore).replace(re.escape("{i}"), r"(?P<i>\d+)").replace(re.escape("{e}"), r"(?P<e>\d+)")
        out.append((re.compile(pattern + "$"), r))
    return out


def _match(name: str, rules: list[Rule]) -> tuple[Rule, int | None]:
    rule, layer, _ = _match_expert(name, rules)
    return rule, layer


def _match_expert(name: str, rules: list[Rule]) -> tuple[Rule, int | None, int | None]:
    """The rule for a canonical Megatron name, its global layer index and its global expert index."""
    for pattern, rule in _compile(rules):
        m = pattern.match(name)
        if m:
            found = m.groupdict()
            return rule, *(int(found[k]) if k in found else None for k in "ie")
    raise KeyError(f"Megatron parameter {name!r} has no entry in the weight table")


# ---------------------------------------------------------------------------------------------------------
# Full-tensor reshapes (no parallelism).


def _qkv_to_mcore(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    groups, d = shape.num_kv_heads, shape.head_dim
    per_group = shape.num_attention_heads // groups
    tail = q.shape[1:]
    q = q.reshape(groups, per_group * d, *tail)
    k = k.reshape(groups, d, *tail)
    v = v.reshape(groups, d, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def _qkv_to_hf(qkv: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, ...]:
    groups, d = shape.num_kv_heads, shape.head_dim
    per_group = shape.num_attention_heads // groups
    tail = qkv.shape[1:]
    grouped = qkv.reshape(groups, (per_group + 2) * d, *tail)
    q, k, v = torch.split(grouped, [per_group * d, d, d], dim=1)
    return tuple(t.reshape(-1, *tail).contiguous() for t in (q, k, v))


def hf_to_mcore_tensor(rule: Rule, hf_tensors: list[torch.Tensor], shape: ModelShape,
                       padded_vocab: int = 0) -> torch.Tensor:
    """`padded_vocab`: the rows of Megatron's embedding and output layer (0 = the HF vocabulary's)."""
    if rule.kind == "qkv":
        return _qkv_to_mcore(*hf_tensors, shape)
    if rule.kind == "gate_up":
        return torch.cat(hf_tensors, dim=0)
    if rule.kind == "vocab" and padded_vocab > hf_tensors[0].shape[0]:
        pad = hf_tensors[0].new_zeros(padded_vocab - hf_tensors[0].shape[0], *hf_tensors[0].shape[1:])
        return torch.cat([hf_tensors[0], pad], dim=0)
    return hf_tensors[0]


def mcore_to_hf_tensors(rule: Rule, tensor: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
    if rule.kind == "qkv":
        return list(_qkv_to_hf(tensor, shape))
    if rule.kind == "gate_up":
        return [t.contiguous() for t in torch.chunk(tensor, 2, dim=0)]
    if rule.kind == "vocab" and tensor.shape[0] > shape.vocab_size:
        return [tensor[: shape.vocab_size].contiguous()]  # the padding rows are no token
    return [tensor]


def hf_names(rule: Rule, layer: int | None, expert: int | None = None) -> list[str]:
    return [n.format(i=layer, e=expert) for n in rule.hf]


def mcore_to_hf(name: str, tensor: torch.Tensor, shape: ModelShape) -> list[tuple[str, torch.Tensor]]:
    """One full Megatron tensor (global name) -> its HF tensors."""
    rule, layer, expert = _match_expert(name, rules_for(shape))
    return list(zip(hf_names(rule, layer, expert), mcore_to_hf_tensors(rule, tensor, shape)))


# ---------------------------------------------------------------------------------------------------------
# Local (sharded, per-stage) parameters.


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def global_param_names(model: torch.nn.Module) -> dict[str, str]:
    """This stage's parameter names -> canonical names with global layer and expert indices and local-spec naming."""
    model = unwrap(model)
    layer_numbers = {}
    if hasattr(model, "decoder"):
        for local_index, layer in enumerate(model.decoder.layers):
            layer_numbers[local_index] = layer.layer_number - 1  # layer_number is global and 1-based
    first_expert = _first_local_expert(model)
    out = {}
    for name in named_weights(model):
        canonical = name
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)$", name)
        if m:
            rest = _TE_ALIASES.get(m[2], m[2])
            grouped = re.match(r"mlp\.experts\.(linear_fc[12])\.weight(\d+)$", rest)  # TE's TEGroupedMLP
            if grouped:
                rest = f"mlp.experts.local_experts.{grouped[2]}.{grouped[1]}.weight"
            local = re.match(r"mlp\.experts\.local_experts\.(\d+)\.(.*)$", rest)
            if local:
                rest = f"mlp.experts.local_experts.{first_expert + int(local[1])}.{local[2]}"
            canonical = f"decoder.layers.{layer_numbers[int(m[1])]}.{rest}"
        out[name] = canonical
    return out


# Buffers that are weights of the checkpoint: DeepSeek-V3's router bias (HF `e_score_correction_bias`), a buffer
# in both implementations because it steers the choice of experts without a gradient.
_WEIGHT_BUFFERS = (".mlp.router.expert_bias",)


def named_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and the weight buffers (`_WEIGHT_BUFFERS`) of `model`, by local name."""
    weights = dict(model.named_parameters())
    buffers = model.named_buffers() if hasattr(model, "named_buffers") else ()  # a stand-in may have none
    weights.update((n, b) for n, b in buffers if b is not None and n.endswith(_WEIGHT_BUFFERS))
    return weights


def _first_local_expert(model: torch.nn.Module) -> int:
    """The global index of this rank's first expert: EP rank x experts per EP rank."""
    experts = getattr(getattr(model, "config", None), "num_moe_experts", None)
    if not experts:
        return 0
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_rank() * (experts // ps.get_expert_model_parallel_world_size())


def _is_expert(global_name: str) -> bool:
    return ".mlp.experts." in global_name


def _tp_of(global_name: str):
    """(rank, size, group) of the tensor-parallel group that shards this parameter: expert-TP for experts."""
    from megatron.core import parallel_state as ps

    if _is_expert(global_name):
        return (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_group())
    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_group())


def _is_tp_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


_ROW_PARALLEL = ("self_attention.linear_proj.weight", "linear_fc2.weight")


def split_dim(rule: Rule, param: torch.Tensor) -> int:
    """The dimension tensor parallelism splits a parameter along, from its layer's role: column-parallel layers
    (the fused qkv, fc1, the vocabulary) split their output rows (0), row-parallel ones (the attention's output
    projection, fc2, dense or expert) their input columns (1). Not `param.partition_dim`: Transformer Engine's
    grouped experts (megatron-core's `TEGroupedLinear` with expert-TP or EP > 1) are built with
    `parallel_mode=None`, and TE's `GroupedLinear.reset_parameters` then marks every expert weight
    `partition_dim=0`, fc2 included, though megatron splits fc2 on dim 1."""
    if rule.mcore.endswith(_ROW_PARALLEL):
        return 1
    if rule.kind in ("qkv", "gate_up", "vocab"):
        return 0
    return param.partition_dim


def shard_for_tp(rule: Rule, full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    if tp_size == 1 or not _is_tp_sharded(param):
        return full
    dim = split_dim(rule, param)
    if rule.kind == "gate_up":
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp_size, dim)[tp_rank], torch.chunk(up, tp_size, dim)[tp_rank]], dim=0)
    return torch.chunk(full, tp_size, dim)[tp_rank]


def gather_tp(rule: Rule, local: torch.Tensor, param: torch.Tensor, tp_group, tp_size: int) -> torch.Tensor:
    if tp_size == 1 or not _is_tp_sharded(param):
        return local
    parts = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(parts, local.contiguous(), group=tp_group)
    dim = split_dim(rule, param)
    if rule.kind == "gate_up":
        halves = [torch.chunk(p, 2, dim=0) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves], dim), torch.cat([h[1] for h in halves], dim)], dim=0)
    return torch.cat(parts, dim)


def _read_safetensors(path: Path, names: Iterable[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    wanted = set(names)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"--hf-checkpoint {path}: no *.safetensors files there")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                if key in wanted:
                    out[key] = handle.get_tensor(key)
    missing = wanted - out.keys()
    if missing:
        raise KeyError(f"--hf-checkpoint {path}: tensors missing from the safetensors files: {sorted(missing)[:5]}")
    return out


@torch.no_grad()
@cpu_compat.in_megatron_scope
def load_hf_weights(model: torch.nn.Module, hf_dir: str | Path, shape: ModelShape, skip: tuple[str, ...] = ()) -> None:
    """Copy an HF checkpoint into this rank's shard of `model` (call before wrapping in DDP). Parameters whose
    canonical name starts with one of `skip` are left as they are (the critic's value head has no HF tensor)."""
    model = unwrap(model)
    rules = rules_for(shape)
    names = global_param_names(model)
    params = named_weights(model)
    plan = {}
    for local_name, global_name in names.items():
        if (skip and global_name.startswith(skip)) or is_adapter_param(global_name):
            continue  # LoRA adapters have no tensor in an HF checkpoint (a PEFT directory holds them)
        if global_name == "output_layer.weight" and shape.tie_word_embeddings:
            plan[local_name] = (_match("embedding.word_embeddings.weight", rules)[0], None, None)
        else:
            plan[local_name] = _match_expert(global_name, rules)
    hf = _read_safetensors(Path(hf_dir), (n for rule, layer, e in plan.values() for n in hf_names(rule, layer, e)))
    for local_name, (rule, layer, expert) in plan.items():
        param = params[local_name]
        tp_rank, tp_size, _ = _tp_of(names[local_name])
        rows = param.shape[0] * (tp_size if _is_tp_sharded(param) and split_dim(rule, param) == 0 else 1)
        full = hf_to_mcore_tensor(rule, [hf[n] for n in hf_names(rule, layer, expert)], shape, padded_vocab=rows)
        shard = shard_for_tp(rule, full, param, tp_rank, tp_size)
        if shard.shape != param.shape:
            raise ValueError(f"{local_name}: checkpoint gives shape {tuple(shard.shape)}, model has "
                             f"{tuple(param.shape)}")
        param.copy_(shard)


@torch.no_grad()
@cpu_compat.in_megatron_scope
def export_hf_weights(model: torch.nn.Module, shape: ModelShape) -> list[tuple[str, torch.Tensor]]:
    """Gather full HF-named tensors onto the model-parallel leader (TP rank 0 of PP stage 0).

    Every rank of the model-parallel group must call this (it runs collectives); the leader gets the full
    list, the other ranks an empty one. `iter_hf_weights` gives the same tensors one at a time.
    """
    return list(iter_hf_weights(model, shape))


def iter_hf_weights(model: torch.nn.Module, shape: ModelShape, every_tp_rank: bool = False,
                    merge_adapters: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """`export_hf_weights` as a stream: the leader receives one full HF tensor at a time, so a consumer that
    writes each away (a shard file, a sync bucket) never holds the whole model twice.

    Every rank of the model-parallel group must run the generator to its end, in step with the others (it runs
    TP gathers and PP broadcasts); ranks other than the leader yield nothing. With `every_tp_rank` every TP rank
    of the first stage yields the same full tensors in the same order (a colocated engine's TP ranks each load
    the bucket from their own GPU: `megarl.rollout.sglang_ipc`). The TP all-gather leaves every TP rank the full
    tensor anyway; what it adds is the PP hand-over of the later stages on every TP rank's pipeline group, not on
    TP rank 0's only (each TP rank's bytes travel in parallel, on their own link). A layer with a LoRA adapter is
    exported merged, `W + (alpha / rank) B A` (`_merged`), its adapter tensors not at all; without
    `merge_adapters`, as the frozen base alone (an engine that applies the adapters itself:
    `--lora-weight-sync adapter`).
    """
    from megatron.core import parallel_state as ps

    model = unwrap(model)
    pp_group, pp_size = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_world_size()
    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    rules = rules_for(shape)
    params = named_weights(model)
    yields = tp_rank == 0 or every_tp_rank

    def this_stage() -> Iterator[tuple[str, torch.Tensor]]:
        """This stage's tensors, gathered over TP (experts: over expert-TP, then EP), on its TP rank 0 (other TP
        ranks only join the gathers, unless `every_tp_rank`)."""
        for local_name, global_name in global_param_names(model).items():
            if global_name == "output_layer.weight" and shape.tie_word_embeddings:
                continue  # a PP copy of the embedding, which stage 0 exports
            if is_adapter_param(global_name):
                continue  # merged into its layer's weight below
            rule, layer, expert = _match_expert(global_name, rules)
            param = params[local_name]
            _, size, group = _tp_of(global_name)
            owner, _, attr = local_name.rpartition(".")
            local = (_merged(model.get_submodule(owner), param.detach()) if attr == "weight" and merge_adapters
                     else param.detach())
            full = gather_tp(rule, local, param, group, size)
            for e, tensor in _gather_ep(full, expert, shape):
                if yields:
                    yield from zip(hf_names(rule, layer, e), mcore_to_hf_tensors(rule, tensor, shape))

    if not yields:
        for _ in this_stage():
            pass
        return
    if pp_rank == 0:
        yield from this_stage()
    for stage in range(1, pp_size):
        # Stage `stage` sends its tensors to stage 0 over the PP group of TP rank 0 ranks (`every_tp_rank`: over
        # each TP rank's), one at a time, each announced by its (name, shape, dtype); None ends the stage.
        src = dist.get_global_rank(pp_group, stage)
        sending = this_stage() if pp_rank == stage else None
        while True:
            item = next(sending, None) if sending is not None else None
            meta = [(item[0], tuple(item[1].shape), item[1].dtype) if item is not None else None]
            dist.broadcast_object_list(meta, src=src, group=pp_group)
            if meta[0] is None:
                break
            name, size, dtype = meta[0]
            if item is not None:
                buf = item[1].contiguous()
            else:
                buf = torch.empty(size, dtype=dtype, device=_param_device(params))
            dist.broadcast(buf, src=src, group=pp_group)
            if pp_rank == 0:
                yield name, buf


def is_adapter_param(name: str) -> bool:
    """Whether a parameter (local or global name) is a LoRA adapter's (`megarl.mcore.lora`: `<layer>.lora.A.q`)."""
    return ".lora." in name


def _merged(layer: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `W + (alpha / rank) B A` when `layer` has a LoRA adapter (`megarl.mcore.lora`, whose
    shards merge without communication), else `weight`."""
    adapter = getattr(layer, "lora", None)
    if adapter is None:
        return weight
    return (weight.float() + adapter.delta(weight.shape[0])).to(weight.dtype)


def _gather_ep(tensor: torch.Tensor, expert: int | None, shape: ModelShape) -> list[tuple[int | None, torch.Tensor]]:
    """A non-expert tensor as it is; this rank's expert `expert` (global index) with the same local expert of
    every other expert-parallel rank: [(global index, tensor)] for all EP ranks, on every EP rank."""
    from megatron.core import parallel_state as ps

    if expert is None:
        return [(None, tensor)]
    ep_size = ps.get_expert_model_parallel_world_size()
    if ep_size == 1:
        return [(expert, tensor)]
    per_rank = shape.num_experts // ep_size
    local = expert - ps.get_expert_model_parallel_rank() * per_rank
    parts = [torch.empty_like(tensor) for _ in range(ep_size)]
    dist.all_gather(parts, tensor.contiguous(), group=ps.get_expert_model_parallel_group())
    return [(r * per_rank + local, t) for r, t in enumerate(parts)]


def _param_device(params: Mapping[str, torch.Tensor]) -> torch.device:
    return next(iter(params.values())).device
