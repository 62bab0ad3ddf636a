"""Process groups, the communication backend and the layer spec: each chosen in exactly one place here."""

from __future__ import annotations

import datetime
import importlib.util
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.mcore import cpu_compat


def default_backend() -> str:
    """NCCL where there is a GPU, gloo on CPU. The one place the backend is chosen."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_host(t: torch.Tensor, op=None, group=None) -> torch.Tensor:
    """All-reduce a small host tensor (metrics, flags, counts) and return it on the host. NCCL reduces only device
    tensors, so under NCCL it travels through the GPU; under gloo it stays where it is."""
    import torch.distributed as dist

    op = dist.ReduceOp.SUM if op is None else op
    if dist.get_backend(group) == "nccl":
        on_device = t.to(device())
        dist.all_reduce(on_device, op=op, group=group)
        return on_device.cpu()
    dist.all_reduce(t, op=op, group=group)
    return t


def uses_transformer_engine(use_transformer_engine: bool | None) -> bool:
    """Resolve `--transformer-impl`: `None` means "TE when available" (a TE that is installed but does not work
    is reported, once, and Megatron's local spec chosen); True without a working TE is an error."""
    ok, why = transformer_engine_status()
    if use_transformer_engine is None:
        if not ok and why.startswith("transformer_engine.pytorch"):
            _say_once(f"Transformer Engine is installed but {why}: megarl builds Megatron's local layer spec "
                      "instead (install transformer_engine_torch built against this torch, docs/gpu-stack.md)")
        return ok
    if use_transformer_engine and not ok:
        raise RuntimeError(f"--transformer-impl transformer_engine needs a working Transformer Engine on a CUDA GPU: "
                           f"{why}; use --transformer-impl local, or auto")
    return use_transformer_engine


_SAID: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def layer_spec(use_transformer_engine: bool | None = None, normalization: str = "RMSNorm", local_kernels: bool = False,
               *, qk_layernorm: bool = False, num_experts: int | None = None, multi_latent_attention: bool = False):
    """Megatron's Transformer Engine spec on GPUs with TE installed, its local spec otherwise: with
    `local_kernels`, the local spec with megarl's attention and norms (`megarl/mcore/local_kernels.py`; the config
    needs `local_kernels.transformer_config_overrides()` for its RoPE). `num_experts`: a mixture-of-experts layer
    (the local spec's `SequentialMLP`, TE's `TEGroupedMLP`); `qk_layernorm`: Qwen3's per-head q/k norms;
    `multi_latent_attention`: DeepSeek-V3's MLA (`megarl.mcore.mla`; with `local_kernels`, megarl's norms only).

    The one place the spec is chosen. `None` means "TE when available".
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    moe = dict(num_experts=num_experts, qk_layernorm=qk_layernorm) if num_experts or qk_layernorm else {}
    if multi_latent_attention:
        if uses_transformer_engine(use_transformer_engine):
            return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, qk_layernorm=True,
                                                              multi_latent_attention=True,
                                                              moe_grouped_gemm=bool(num_experts))
        from megarl.mcore import local_kernels as kernels
        from megarl.mcore import mla

        return mla.local_spec(num_experts=num_experts, norm=kernels.RMSNorm if local_kernels else None)
    if uses_transformer_engine(use_transformer_engine):
        return get_gpt_layer_with_transformer_engine_spec(**moe, moe_grouped_gemm=bool(num_experts))
    if local_kernels:
        from megarl.mcore import local_kernels as kernels

        return kernels.local_spec(normalization=normalization, **moe)
    return get_gpt_layer_local_spec(normalization=normalization, **moe)


def decoder_block_spec(config, moe_layers: tuple[int, ...], use_transformer_engine: bool | None = None,
                       local_kernels: bool = False, qk_layernorm: bool = False, multi_latent_attention: bool = False):
    """The layers of this rank's pipeline stage, for the cases one layer spec cannot say: a mixture-of-experts
    model (the expert layer's spec where the global layer index is in `moe_layers`, Qwen3-MoE's `mlp_only_layers`
    / `decoder_sparse_step` giving the others a dense MLP), and sequence parallelism on the local spec (the final
    norm is megarl's, which supports it). Otherwise the final norm is the one Megatron's block picks for a single
    layer spec."""
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    dense = layer_spec(use_transformer_engine, local_kernels=local_kernels, qk_layernorm=qk_layernorm,
                       multi_latent_attention=multi_latent_attention)
    sparse = layer_spec(use_transformer_engine, local_kernels=local_kernels, qk_layernorm=qk_layernorm,
                        num_experts=config.num_moe_experts,
                        multi_latent_attention=multi_latent_attention) if moe_layers else dense
    offset = get_transformer_layer_offset(config)
    layers = [sparse if offset + i in moe_layers else dense for i in range(get_num_layers_to_build(config))]
    final_norm = transformer_block.LayerNormImpl
    if local_kernels and config.sequence_parallel:
        final_norm = dense.submodules.input_layernorm
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=final_norm)


def transformer_engine_available() -> bool:
    return transformer_engine_status()[0]


def transformer_engine_status() -> tuple[bool, str]:
    """(usable, why not). `import transformer_engine` is no test: TE 2.11's `__init__` swallows the failure of its
    torch extension (missing, or built against another torch), and megatron-core then refuses the TE spec
    ("Transformer Engine is not installed") when the model is built. Its torch module is what must import."""
    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    if importlib.util.find_spec("transformer_engine") is None:
        return False, "transformer_engine is not installed"
    try:
        import transformer_engine.pytorch  # noqa: F401 - only to see that it imports
    except Exception as e:  # noqa: BLE001 - ImportError, OSError of a library, anything its extension raises
        return False, f"transformer_engine.pytorch does not import ({type(e).__name__}: {e})"
    return True, ""


@dataclass(frozen=True)
class ParallelInfo:
    """Where this rank sits in the TP x CP x PP x DP grid. CP ranks of one DP rank hold the same samples."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    cp_rank: int = 0
    cp_size: int = 1

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_mp_leader(self) -> bool:
        """The first rank of a model replica (TP x CP x PP): it runs the rollout engine for its DP shard."""
        return self.tp_rank == 0 and self.pp_rank == 0 and self.cp_rank == 0

    @property
    def replica_size(self) -> int:
        """Ranks that hold one model replica and share one DP rank's samples: TP x CP x PP."""
        return self.tp_size * self.cp_size * self.pp_size


_REPLICA_GROUP = None  # TP x CP x PP ranks of one DP rank, when CP > 1 (Megatron's model-parallel group is TP x PP)


def init_distributed(tp: int = 1, pp: int = 1, timeout_s: float = 600.0, seed: int = 0, cp: int = 1,
                     ep: int = 1, etp: int = 0) -> ParallelInfo:
    """Initialise torch.distributed (from torchrun's environment) and Megatron's model-parallel groups.

    `ep` / `etp`: expert-parallel and expert-tensor-parallel sizes (0 = TP) of a mixture-of-experts model; the
    experts' grid (expert-TP x EP x expert-DP x PP) spans the same ranks as the attention's (TP x CP x DP x PP).
    A collective that waits longer than `timeout_s` raises instead of hanging.
    """
    global _REPLICA_GROUP
    from megatron.core import parallel_state, tensor_parallel

    cpu_compat.install()
    if not dist.is_initialized():
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        if "MASTER_ADDR" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend=default_backend(),
            world_size=world_size,
            rank=rank,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    world_size = dist.get_world_size()
    if world_size % (tp * pp * cp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp}"
        )
    if world_size % ((etp or tp) * ep * pp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by --expert-tensor-parallel-size {etp or tp} x "
            f"--expert-model-parallel-size {ep} x --pipeline-model-parallel-size {pp}"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp or None,
        distributed_timeout_minutes=max(1, int(timeout_s // 60)),
    )
    if cp > 1:
        _REPLICA_GROUP = _new_replica_group(tp, pp, cp, world_size // (tp * pp * cp), timeout_s)
    with cpu_compat.megatron_scope():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return parallel_info()


def parallel_info() -> ParallelInfo:
    from megatron.core import parallel_state as ps

    return ParallelInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(),
    )


def _new_replica_group(tp: int, pp: int, cp: int, dp: int, timeout_s: float):
    """This rank's TP x CP x PP group, in Megatron's own rank order (every rank creates every group)."""
    from megatron.core.parallel_state import RankGenerator

    mine = None
    for ranks in RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp").get_ranks("tp-cp-pp"):
        group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))
        if dist.get_rank() in ranks:
            mine = group
    return mine


def cp_group():
    """This rank's context-parallel group (one rank when CP = 1)."""
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group()


def mp_group():
    """Ranks that hold one model replica and share its samples (TP x CP x PP)."""
    from megatron.core import parallel_state as ps

    return _REPLICA_GROUP if _REPLICA_GROUP is not None else ps.get_model_parallel_group()


def mp_leader_global_rank() -> int:
    return dist.get_global_rank(mp_group(), 0)


def destroy() -> None:
    from megatron.core import parallel_state

    global _REPLICA_GROUP
    _REPLICA_GROUP = None
    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


# -- small collectives the training loop uses --------------------------------------------------------------------


def agree_any(flag: bool) -> bool:
    """True on every rank if it is true on any (so all ranks take the same branch)."""
    t = all_reduce_host(torch.tensor([1 if flag else 0], dtype=torch.int32), op=dist.ReduceOp.MAX)
    return bool(t.item())


def max_over_ranks(value: float) -> float:
    t = all_reduce_host(torch.tensor([value], dtype=torch.float64), op=dist.ReduceOp.MAX)
    return float(t.item())


def broadcast_in_mp_group(obj):
    """The model-parallel leader's `obj` on every rank of its replica (TP x CP x PP)."""
    box = [obj]
    dist.broadcast_object_list(box, src=mp_leader_global_rank(), group=mp_group())
    return box[0]


def broadcast_from_last_stage(t: torch.Tensor) -> torch.Tensor:
    """The last pipeline stage's `t` on every stage of this pipeline (on the host)."""
    from megatron.core import parallel_state as ps

    on_device = t.to(device())
    dist.broadcast(on_device, src=ps.get_pipeline_model_parallel_last_rank(),
                   group=ps.get_pipeline_model_parallel_group())
    return on_device.cpu()
