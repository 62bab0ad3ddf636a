"""Will a run fit, and how long will a step take? Per-GPU memory by component and a step-time estimate.

Arithmetic over the model shape and the run's settings: no torch, nothing allocated. `megarl-plan` is the
command line. Memory, in bytes, for P parameters held by one GPU (its TP shard of its PP stage):

- a mixture of experts (Qwen3-MoE) holds on a GPU its TP shard of the attention, the dense MLPs and the routers,
  and its expert-TP shard of num_experts / EP experts per sparse layer; compute follows the active parameters
  (the top-k experts a token runs through), memory all of them.
- actor weights 2P (bf16); gradients 4P (megarl's DDP reduces gradients in fp32); optimizer 12P (fp32 main
  params + Adam m and v), divided by DP with --use-distributed-optimizer. So a 70B actor is 140 GB of weights
  and 18 bytes/param = 1.26 TB of training state before activations (Adam's fp32 m and v alone are 560 GB).
- activations per token and layer (bf16, flash attention, no recomputation): 2 x (4h + 2 q + 2 kv) + 6 f bytes,
  with q = heads x head_dim, kv = kv_heads x head_dim, f = the MLP width (norm inputs and outputs, QKV, attention
  output, SwiGLU's two inputs and output). All of it is sharded over TP with --sequence-parallel; without it the
  8h bytes of the norms' inputs and outputs are whole on every TP rank. A PP stage keeps min(PP, micro-batches)
  micro-batches in flight (1F1B). The last stage adds the log-prob head as tools/bench/logprob_memory.py measures
  it (`logprob_head_bytes`): with full logits (--logprob-chunk-tokens 0) five fp32 [tokens, vocab / TP] tensors,
  20 bytes per vocabulary entry per token; with --logprob-chunk-tokens three [chunk, vocab / TP] fp32 tensors
  whatever the length. (Before issue 29 the planner counted 10 bytes per entry for full logits, half the measured
  peak; `fixes` now offers --logprob-chunk-tokens when the head is what does not fit.)
- KV cache per token: 2 (K and V) x layers x kv_heads x head_dim x 2 bytes, sharded over the engine's TP;
  multi-latent attention (DeepSeek-V3) caches one latent per token and layer, layers x (kv_lora_rank +
  qk_rope_head_dim) x 2 bytes, on every TP rank (SGLang's MLA cache).
- reference model (when --kl-coef > 0): its bf16 weights, sharded like the actor.
- --offload-frozen: the reference's and a local teacher's weights are on the GPU only in a phase of their own, their
  log-probs (the actor's resident state, the frozen weights, one layer's activations of a micro-batch and the
  log-prob head: a forward pass without gradients); every other phase counts them as 0.
- teacher model (on-policy distillation, a local --teacher checkpoint): its bf16 weights, sharded over TP and PP like
  the actor's, and one forward pass (2 FLOPs a parameter a token) a step; a served teacher costs these GPUs nothing.
- LoRA (--lora-rank R): the base weights are frozen: 2P of bf16 weights and no gradient or optimizer state for
  them. The adapters' parameters L (`lora_params`; per GPU `lora_stage_params`: for a column-parallel layer A
  [R, in] is replicated over TP and B [out / TP, R] split, for a row-parallel one A [R, in / TP] split and B
  [out, R] replicated) take 2L of bf16 weights, 4L of fp32 gradients and 12L of optimizer state (fp32 main copy +
  Adam m and v, as above: bf16 training keeps a main copy; divided by DP with the distributed optimizer). No
  reference model: the reference is the actor with its adapters off. The engine still holds the whole (merged)
  weights, and the weight sync sends them.
- reward model (`hf_rm`, --reward-model): not on the GPUs: each trainer process that leads a model replica starts
  one megarl-serve-rm holding it in fp32 on the CPU, so a node holds (GPUs per node / (TP x PP x CP)) copies of
  4 bytes x its parameters in host memory (`megarl-plan` prints them; `reward_model_params`).
- rollout engine (SGLang): it reserves --sglang-mem-fraction of the GPU (0.85 on a dedicated rollout GPU) for its
  weights (2 x all parameters / engine TP) and a KV pool; colocated, it releases both while the actor trains,
  and the actor's optimizer (and weights) can leave the GPU while the engine generates (--offload-optimizer,
  --offload-params).
- 4 GiB per GPU for the CUDA context, NCCL buffers and allocator fragmentation.
- the weight sync (a phase of its own): after the update, no activations; the pushing GPUs hold 3 buckets
  (--sync-bucket-mb, or the largest tensor where that is larger: `sync_buckets_bytes`). Colocated, the engine takes
  its weights' memory back before the first bucket, and the actor has let go of its gradients (and with
  --offload-optimizer of its optimizer state) just before (`megarl.stages.colocation.free_for_push`): actor
  weights + optimizer + reference + engine weights + buckets. Disaggregated, the training GPUs keep their whole
  training state beside the buckets.
- the async copy (--async-staleness): each sync's copy of the weights waits for the engine while the actor trains
  on, the whole model in bf16 (`async_copy_bytes`), in pinned host memory on the pushing rank only (`MemoryPlan.host`;
  none on the GPUs); disaggregated, the pusher's worker brings it back to its GPU two buckets at a time, during the
  training phase.
- the peak (`MemoryPlan.peak_phase`) is the phase with the largest total; the rollout phase counts the gradients
  unless --offload-optimizer: freed before the push, they are back after an evaluation or a checkpoint between
  steps.

Time: rollout = prefill (2P FLOPs per prompt token) + decoding to --max-response-len, each decode step bounded
by reading the engine's weights and the live KV cache from HBM (or by its FLOPs); training = 6P FLOPs per token
(+2P for the actor's log-probs, +2P for the reference's), plus attention, at a model-FLOPs utilisation; weight
sync = the bf16 weights over NVLink (colocated) or the inter-node network (disaggregated). These are estimates to
choose a layout by, good to a factor of ~1.5, not measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from megarl.model_shape import ModelShape

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GIB = 2**30  # memory is reported in GiB, as nvidia-smi's MiB and the GPUs' nominal sizes are binary
MIB = 2**20
OVERHEAD_BYTES = 4 * GIB


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: float  # what nvidia-smi reports as total
    bf16_tflops: float  # dense peak
    hbm_gbps: float  # GB/s
    nvlink_gbps: float  # GB/s per GPU, one direction


GPUS = {
    "h100": GPU("H100 80GB SXM", 81559 * MIB, 989, 3350, 450),
    "h200": GPU("H200 141GB SXM", 143771 * MIB, 989, 4800, 450),
    "a100": GPU("A100 80GB SXM", 81920 * MIB, 312, 2039, 300),
    "a100-40g": GPU("A100 40GB SXM", 40960 * MIB, 312, 1555, 300),
    "l40s": GPU("L40S 48GB", 46068 * MIB, 362, 864, 32),
}


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus: int  # in the whole job
    gpus_per_node: int = 8
    internode_gbps: float = 3200.0  # Gbit/s into one node (8 x 400G InfiniBand NDR)


@dataclass(frozen=True)
class RunSettings:
    """The settings that size a run; names follow megarl's flags (see RunSettings.from_config)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: each sequence split over this many ranks, which share one DP rank's samples
    ep: int = 1  # expert parallel: each rank holds num_experts / ep experts of every sparse layer
    etp: int = 0  # expert-tensor parallel; 0 = tp
    mode: Literal["colocated", "disaggregated"] = "colocated"
    async_staleness: int = 0  # disaggregated: >= 1 overlaps rollout with training (--async-staleness)
    rollout_gpus: int = 0  # disaggregated: GPUs that run the engine (0 = the planner picks the split)
    engine_tp: int = 0  # SGLang's TP; 0 = the actor's (colocated) / the smallest that leaves room (disaggregated)
    rollout_batch_size: int = 128  # prompts per step
    n_samples_per_prompt: int = 8
    prompt_len: int = 256  # mean prompt tokens
    max_response_len: int = 4096
    mean_response_frac: float = 0.6  # mean response length / max-response-len
    micro_batch_size: int = 4
    updates_per_rollout: int = 1
    kl: bool = False  # a reference model is loaded (--kl-coef > 0)
    teacher_params: float = 0.0  # on-policy distillation's local teacher (--teacher), its parameters; 0 = none
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    offload_optimizer: bool = False
    offload_params: bool = False
    offload_frozen: bool = False  # the reference and a local teacher on the GPU only for their log-probs
    engine_mem_fraction: float = 0.5  # colocated; a dedicated rollout GPU uses DEDICATED_ENGINE_FRACTION
    mfu: float = 0.35  # training model-FLOPs utilisation
    logprob_chunk_tokens: int = 0  # the log-prob head's chunk (--logprob-chunk-tokens); 0 = full logits
    lora_rank: int = 0  # LoRA adapters of this rank (--lora-rank); 0 = full fine-tuning
    lora_targets: tuple[str, ...] = LORA_TARGETS  # --lora-target-modules, HF projection names
    sync_bucket_mb: int = 512  # the weight sync's bucket size (--sync-bucket-mb)

    @classmethod
    def from_config(cls, cfg, **planner) -> "RunSettings":
        """From a megarl Config; `planner`: the settings no flag sets (prompt_len, mean_response_frac, mfu)."""
        t, r, m = cfg.training, cfg.rollout, cfg.model
        # The sglang backend's options (`megarl.rollout.slots.SGLangOptions`); absent from a config built without
        # components, which takes their defaults.
        sglang = cfg.components.get("rollout_backend.sglang")
        engine_tp, engine_mem = (sglang.sglang_tp_size, sglang.sglang_mem_fraction) if sglang else (0, 0.5)
        return cls(tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size, cp=m.context_parallel_size,
                   ep=m.expert_model_parallel_size, etp=m.expert_tensor_parallel_size, engine_tp=engine_tp,
                   rollout_batch_size=cfg.data.rollout_batch_size, n_samples_per_prompt=r.n_samples_per_prompt,
                   max_response_len=r.max_response_len, micro_batch_size=t.micro_batch_size,
                   updates_per_rollout=t.updates_per_rollout, kl=cfg.algorithm.kl_coef > 0,
                   distributed_optimizer=t.use_distributed_optimizer, offload_optimizer=t.offload_optimizer,
                   offload_params=t.offload_params, offload_frozen=t.offload_frozen,
                   sequence_parallel=m.sequence_parallel,
                   logprob_chunk_tokens=m.logprob_chunk_tokens, engine_mem_fraction=engine_mem,
                   mode="disaggregated" if r.rollout_servers else "colocated", async_staleness=t.async_staleness,
                   lora_rank=m.lora_rank, lora_targets=m.lora_targets, sync_bucket_mb=r.sync_bucket_mb,
                   teacher_params=_teacher_params(m.teacher), **planner)


def _teacher_params(teacher: str) -> float:
    """The parameters of a local --teacher checkpoint (its config.json); 0 without one, for a served teacher (its
    memory is its server's) and for a checkpoint not downloaded yet."""
    from megarl.preflight import read_shape
    from megarl.teacher import parse_teachers

    total = 0.0
    for source in (parse_teachers(teacher).values() if teacher else ()):
        # megarl-plan reads a missing checkpoint's shape from the recipe's TEACHER_SHAPE
        if not source.startswith(("http://", "https://")) and (Path(source) / "config.json").is_file():
            total += num_params(read_shape("--teacher", source))
    return total


DEDICATED_ENGINE_FRACTION = 0.85  # launch/slurm/disaggregated.sbatch's SGLANG_MEM_FRACTION
# The chunk `fixes` suggests: tools/bench/logprob_memory.py's default, the low end of the guide's 1024 to 4096,
# where the head is near its floor (at Qwen's vocabulary, 1.8 GiB per TP rank whatever the length).
SUGGESTED_CHUNK_TOKENS = 1024


# ------------------------------------------------------------------------------------------------ the model

def layer_params(s: ModelShape, layer: int = 0) -> int:
    """Layer `layer`'s parameters, every expert included."""
    return s.attention_params() + s.mlp_params(layer) + 2 * s.hidden_size


def num_params(s: ModelShape) -> int:
    return s.param_count()


def active_params(s: ModelShape) -> int:
    """What one token runs through: a mixture of experts' top-k experts, not all of them (`num_params` if dense)."""
    return s.param_count(active=True)


def expert_params(s: ModelShape, layer: int) -> int:
    """Layer `layer`'s expert weights (0 in a dense layer; the router is not an expert)."""
    return s.num_experts * 3 * s.hidden_size * s.moe_ffn_hidden_size if s.is_moe_layer(layer) else 0


def reward_model_params(s: ModelShape) -> int:
    """An `hf_rm` sequence classifier: the embedding and trunk, the final norm and a one-label head
    (no output layer)."""
    return sum(layer_params(s, i) for i in range(s.num_layers)) + s.vocab_size * s.hidden_size + 2 * s.hidden_size


def stage_params(s: ModelShape, tp: int, pp: int, ep: int = 1, etp: int = 0) -> float:
    """Parameters on one GPU of the largest PP stage: its layers (experts split over EP x expert-TP, the rest over
    TP) and, first/last stage, the embedding/output."""
    embed = s.vocab_size * s.hidden_size / tp
    per_stage = math.ceil(s.num_layers / pp)
    stages = [range(i * per_stage, min(s.num_layers, (i + 1) * per_stage)) for i in range(pp)]

    def on_gpu(layers) -> float:
        return sum((layer_params(s, i) - expert_params(s, i)) / tp + expert_params(s, i) / (ep * (etp or tp))
                   for i in layers)

    layers = max(on_gpu(st) for st in stages)
    first = layers + embed
    last = layers + (0 if s.tie_word_embeddings and pp == 1 else embed) + s.hidden_size / tp
    return first + last - layers if pp == 1 else max(first, last)


def expert_bytes_per_gpu(s: ModelShape, r: "RunSettings") -> float:
    """The bf16 expert weights one GPU holds (its EP rank's experts, its expert-TP shard) in its PP stage."""
    per_stage = math.ceil(s.num_layers / r.pp)
    return 2 * sum(expert_params(s, i) for i in range(per_stage)) / (r.ep * (r.etp or r.tp))


def _lora_projections(s: ModelShape, layer: int, targets: tuple[str, ...]) -> list[tuple[str, int, int]]:
    """(parallel mode, in, out) of each adapted projection of `layer`, as `megarl.mcore.lora.attach` adapts them:
    the attention's four, and the MLP's three in a dense model (experts: `lora_layer_params`)."""
    h, q, kv = s.hidden_size, s.num_attention_heads * s.head_dim, s.num_kv_heads * s.head_dim
    f = s.ffn_hidden_size
    shapes = {"q_proj": ("column", h, q), "k_proj": ("column", h, kv), "v_proj": ("column", h, kv),
              "o_proj": ("row", q, h), "gate_proj": ("column", h, f), "up_proj": ("column", h, f),
              "down_proj": ("row", f, h)}
    mlp = ("gate_proj", "up_proj", "down_proj")
    return [shapes[t] for t in targets if t in shapes and (t not in mlp or not s.is_moe)]


def lora_layer_params(s: ModelShape, layer: int, rank: int, targets: tuple[str, ...], tp: int = 1,
                      ep: int = 1) -> float:
    """One TP rank's adapter parameters in `layer`: column-parallel A [rank, in] (replicated) + B [out / tp, rank];
    row-parallel A [rank, in / tp] + B [out, rank] (replicated). Expert targets (`experts.gate_up_proj`,
    `experts.down_proj`, expert-TP 1): an A and a B per expert on the EP rank, over the fused gate/up
    (A [rank, hidden], B [2 x expert width, rank]) and the down projection (A [rank, width], B [hidden, rank])."""
    total = 0.0
    for mode, n_in, n_out in _lora_projections(s, layer, targets):
        total += rank * (n_in + n_out / tp) if mode == "column" else rank * (n_in / tp + n_out)
    if s.is_moe_layer(layer):
        h, f = s.hidden_size, s.moe_ffn_hidden_size
        per_expert = (rank * (h + 2 * f) if "experts.gate_up_proj" in targets else 0) + \
            (rank * (f + h) if "experts.down_proj" in targets else 0)
        total += per_expert * s.num_experts / ep
    return total


def lora_params(s: ModelShape, rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
    """The trainable parameters of LoRA adapters of `rank` on `targets`, the whole model (TP 1, EP 1)."""
    return int(sum(lora_layer_params(s, i, rank, targets) for i in range(s.num_layers)))


def lora_stage_params(s: ModelShape, r: "RunSettings") -> float:
    """The adapter parameters on one GPU of the largest PP stage (0 without LoRA)."""
    if not r.lora_rank:
        return 0.0
    per_stage = math.ceil(s.num_layers / r.pp)
    return max(sum(lora_layer_params(s, i, r.lora_rank, r.lora_targets, r.tp, r.ep)
                   for i in range(st, min(s.num_layers, st + per_stage))) for st in range(0, s.num_layers, per_stage))


def weights_bytes(params: float, bytes_per_param: int = 2) -> float:
    return params * bytes_per_param


def adam_state_bytes(params: float, distributed_over: int = 1) -> float:
    """fp32 main params + Adam m + v: 12 bytes a parameter (sharded over DP with the distributed optimizer)."""
    return 12 * params / distributed_over


def kv_bytes_per_token(s: ModelShape, bytes_per_value: int = 2) -> int:
    """K and V for one token in every layer: 2 x layers x kv_heads x head_dim x bytes; MLA: the compressed latent
    and the shared RoPE key, layers x (kv_lora_rank + rope) x bytes."""
    if s.is_mla:
        return s.num_layers * (s.kv_lora_rank + s.head_dim) * bytes_per_value
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * bytes_per_value


def _kv_tp(s: ModelShape, engine_tp: int) -> int:
    """The engine TP ranks its KV cache is split over: KV heads shard over TP, beyond that they are replicated; an
    MLA latent is on every rank."""
    return 1 if s.is_mla else min(engine_tp, s.num_kv_heads)


def _attention_widths(s: ModelShape) -> tuple[int, int]:
    """Per token and layer, the widths of the query-key product and of the value product (and output):
    heads x head_dim each; MLA: heads x (nope + rope) and heads x v_head_dim."""
    if s.is_mla:
        return s.num_attention_heads * (s.qk_nope_head_dim + s.head_dim), s.num_attention_heads * s.v_head_dim
    return s.num_attention_heads * s.head_dim, s.num_attention_heads * s.head_dim


SYNC_BUCKETS = 3  # live on a pushing GPU during a push (`sync_buckets_bytes`)
ASYNC_LOADING_BUCKETS = 2  # --async-staleness: the pusher's worker brings the copy back to its GPU (`OrderedEngine`)


def sync_buckets_bytes(s: ModelShape, r: RunSettings, buckets: int = SYNC_BUCKETS) -> float:
    """The weight sync's buckets on a pushing GPU: `buckets` of --sync-bucket-mb (during a push, three: the
    tensors of the bucket being filled, the bucket handed over, the one the engine is loading; 3 to 4 measured on
    CPU, tests/unit/test_colocation.py), each as large as the largest tensor where that is larger (a tensor larger
    than a bucket gets one of its own): the embedding, vocabulary x hidden in bf16."""
    return buckets * max(r.sync_bucket_mb * MIB, weights_bytes(s.vocab_size * s.hidden_size))


def async_copy_bytes(s: ModelShape, r: RunSettings) -> float:
    """--async-staleness: the copy of the weights each sync queues for the engine while the actor trains on
    (`megarl.rollout.pipeline.OrderedEngine`): the whole model in bf16, in pinned host memory on the pushing rank
    until the engine has loaded it (0 without --async-staleness). None of it stays on the GPUs."""
    return weights_bytes(num_params(s)) if r.async_staleness else 0.0


def activation_bytes_per_token_layer(s: ModelShape) -> int:
    if s.is_mla:  # q, k (nope + rope each), v and the attention output, after the up-projections
        qk, v = _attention_widths(s)
        return 2 * (4 * s.hidden_size + 2 * qk + 2 * v) + 6 * s.ffn_hidden_size
    q, kv = s.num_attention_heads * s.head_dim, s.num_kv_heads * s.head_dim
    return 2 * (4 * s.hidden_size + 2 * q + 2 * kv) + 6 * s.ffn_hidden_size


# ------------------------------------------------------------------------------------------------ memory

@dataclass
class Phase:
    """Bytes per GPU by component during one phase."""

    name: str
    components: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.components.values())


@dataclass
class MemoryPlan:
    pool: str  # "all GPUs", "training GPUs", "rollout GPUs"
    gpus: int
    phases: list[Phase]
    capacity: float
    kv_needed: float  # bytes per GPU to hold the whole batch's KV cache at once
    kv_pool: float  # bytes per GPU the engine has for it
    problems: list[str]
    host: dict[str, float] = field(default_factory=dict)  # host memory of the pool's pushing rank, by component

    @property
    def peak(self) -> float:
        return self.peak_phase.total

    @property
    def peak_phase(self) -> Phase:
        """The phase that needs the most memory (the first of equals)."""
        return max(self.phases, key=lambda p: p.total)

    @property
    def fits(self) -> bool:
        return not self.problems


def _sequence_len(r: RunSettings) -> int:
    return r.prompt_len + r.max_response_len


def _engine_tp(s: ModelShape, r: RunSettings, cluster: Cluster) -> int:
    """--sglang-tp-size if set; colocated, the actor's TP; on dedicated GPUs the smallest power of two (within a
    node) whose weight shard leaves at least half the engine's memory for the KV cache."""
    if r.engine_tp:
        return r.engine_tp
    if r.mode == "colocated":
        return r.tp
    tp = 1
    while (tp < cluster.gpus_per_node
           and weights_bytes(num_params(s)) / tp > DEDICATED_ENGINE_FRACTION * cluster.gpu.memory_bytes / 2):
        tp *= 2
    return tp


def _micro_batch_bytes(s: ModelShape, r: RunSettings) -> tuple[float, float, float]:
    """(tokens, one layer's activation bytes a token, the log-prob head's bytes) of one micro-batch on this rank."""
    tokens = r.micro_batch_size * _sequence_len(r) / r.cp  # this rank's share of each sequence
    whole = 8 * s.hidden_size  # the norms' inputs and outputs: TP-sharded only with sequence parallelism
    per_token = (activation_bytes_per_token_layer(s) - whole) / r.tp + whole / (r.tp if r.sequence_parallel else 1)
    logits = logprob_head_bytes(tokens, s.vocab_size, s.hidden_size, tp=r.tp, chunk_tokens=r.logprob_chunk_tokens)
    return tokens, per_token, logits


def _train_phase(s: ModelShape, r: RunSettings, dp: int) -> dict[str, float]:
    p = stage_params(s, r.tp, r.pp, r.ep, r.etp)
    samples_per_rank = r.rollout_batch_size * r.n_samples_per_prompt / dp / r.updates_per_rollout
    micro_batches = max(1, math.ceil(samples_per_rank / r.micro_batch_size))
    tokens, per_token, logits = _micro_batch_bytes(s, r)
    in_flight = min(r.pp, micro_batches)
    layers = math.ceil(s.num_layers / r.pp) * per_token * tokens * in_flight
    trained = lora_stage_params(s, r) if r.lora_rank else p  # LoRA: the adapters only; the base is frozen
    teacher = {"teacher model": weights_bytes(r.teacher_params) / (r.tp * r.pp)} if r.teacher_params else {}
    return {"actor weights": weights_bytes(p + (trained if r.lora_rank else 0)), "gradients (fp32)": 4 * trained,
            "optimizer (fp32 main + Adam)": adam_state_bytes(trained, dp * r.cp if r.distributed_optimizer else 1),
            "activations + logits": layers + logits,
            "reference model": weights_bytes(p) if r.kl and not r.lora_rank else 0.0,
            **teacher}  # the teacher, frozen bf16, sharded over TP and PP like the actor


FROZEN = ("reference model", "teacher model")


def _logprob_phase(s: ModelShape, r: RunSettings, train: dict[str, float]) -> dict[str, float]:
    """--offload-frozen: the frozen models come back for their log-probs, a forward pass without gradients: the
    actor's resident state, the frozen weights, one layer's activations of a micro-batch at a time and the
    log-prob head. (Taken out of `train`, which the caller then counts without them.)"""
    tokens, per_token, logits = _micro_batch_bytes(s, r)
    phase = {k: v for k, v in train.items() if k != "activations + logits"}
    phase["forward activations + logits"] = per_token * tokens + logits
    return phase


def memory_plan(s: ModelShape, r: RunSettings, cluster: Cluster) -> list[MemoryPlan]:
    """One MemoryPlan per pool of GPUs: colocated has one; disaggregated has training and rollout GPUs."""
    cap = cluster.gpu.memory_bytes
    total = num_params(s)
    etp = _engine_tp(s, r, cluster)
    samples = r.rollout_batch_size * r.n_samples_per_prompt
    kv_tp = _kv_tp(s, etp)
    if r.mode == "colocated":
        train_gpus = rollout_gpus = cluster.gpus
    else:
        rollout_gpus = r.rollout_gpus
        train_gpus = cluster.gpus - rollout_gpus
    engines = max(1, rollout_gpus // etp)
    kv_needed = samples / engines * _sequence_len(r) * kv_bytes_per_token(s) / kv_tp
    engine_weights = weights_bytes(total) / etp
    plans = []

    def check(pool, gpus, phases, kv_pool, problems, host=None):
        for ph in phases:
            if ph.total > cap:
                big = max(ph.components, key=ph.components.get)
                problems.append(f"{pool}, {ph.name}: {ph.total / GIB:.1f} GiB > {cap / GIB:.1f} GiB "
                                f"(largest: {big}, {ph.components[big] / GIB:.1f} GiB)")
        plans.append(MemoryPlan(pool, gpus, phases, cap, kv_needed, kv_pool, problems, host or {}))

    problems: list[str] = []
    dp, rem = divmod(train_gpus, r.tp * r.pp * r.cp)
    if dp < 1 or rem:
        problems.append(f"{train_gpus} training GPUs are not a multiple of TP {r.tp} x PP {r.pp} x CP {r.cp}")
        dp = max(dp, 1)
    if s.is_moe and train_gpus % ((r.etp or r.tp) * r.ep * r.pp):
        problems.append(f"{train_gpus} training GPUs are not a multiple of expert-TP {r.etp or r.tp} x EP {r.ep} x "
                        f"PP {r.pp}")
    train = _train_phase(s, r, dp)
    train["CUDA context, NCCL, fragmentation"] = OVERHEAD_BYTES
    logprob: list[Phase] = []
    if r.offload_frozen and any(train.get(k) for k in FROZEN):  # the frozen models leave every other phase
        logprob = [Phase("log-probs (frozen models on)", _logprob_phase(s, r, train))]
        for k in FROZEN:
            if k in train:
                train[k] = 0.0
    host = {"async weight copy (pinned)": async_copy_bytes(s, r)} if r.async_staleness else {}
    # The push, after the update: no activations; buckets on the pushing GPUs (and, colocated, the engine's weights)
    sync = {k: v for k, v in train.items() if k != "activations + logits"}
    if r.mode == "disaggregated":
        if r.async_staleness:  # the pusher's worker loads the last sync's copy while the actor trains
            train["weight-sync buckets"] = sync_buckets_bytes(s, r, ASYNC_LOADING_BUCKETS)
        sync["weight-sync buckets"] = sync_buckets_bytes(s, r)
        check("training GPUs", train_gpus, [*logprob, Phase("training", train), Phase("weight sync", sync)], 0.0,
              problems, host)
        reserve = DEDICATED_ENGINE_FRACTION * cap
        rollout = {"engine weights": engine_weights, "KV cache": max(0.0, reserve - engine_weights),
                   "CUDA context, NCCL, fragmentation": OVERHEAD_BYTES}
        rproblems = [] if reserve > engine_weights else [
            f"rollout GPUs: the engine's weights ({engine_weights / GIB:.1f} GiB) exceed its share of the GPU; "
            f"raise the engine TP"]
        check("rollout GPUs", rollout_gpus, [Phase("rollout", rollout)], rollout["KV cache"], rproblems)
        return plans
    reserve = r.engine_mem_fraction * cap
    kv_pool = max(0.0, reserve - engine_weights)
    resident = {k: v for k, v in train.items() if k not in ("activations + logits",)}
    if r.offload_optimizer:
        resident["gradients (fp32)"] = resident["optimizer (fp32 main + Adam)"] = 0.0
    if r.offload_params:
        resident["actor weights"] = 0.0
    rollout = {**resident, "engine weights": engine_weights, "KV cache": kv_pool}
    if reserve <= engine_weights:
        problems.append(f"the engine's weights ({engine_weights / GIB:.1f} GiB) exceed --sglang-mem-fraction "
                        f"{r.engine_mem_fraction} of the GPU")
    # The engine takes its weights' memory back before the push (SGLang resumes them first); the actor has let go
    # of its gradients, and with --offload-optimizer of its optimizer state (`colocation.free_for_push`).
    if not r.async_staleness:
        sync["gradients (fp32)"] = 0.0
        if r.offload_optimizer:
            sync["optimizer (fp32 main + Adam)"] = 0.0
    sync.update({"engine weights": engine_weights, "weight-sync buckets": sync_buckets_bytes(s, r)})
    check("all GPUs", cluster.gpus, [*logprob, Phase("training (engine released)", train), Phase("weight sync", sync),
                                     Phase("rollout", rollout)], kv_pool, problems, host)
    return plans


# ------------------------------------------------------------------------------------------------ time

@dataclass
class StepTime:
    rollout: float
    training: float
    weight_sync: float
    waves: int  # rounds of decoding the KV pool forces (1 = the whole batch at once)
    overlapped: bool = False  # asynchronous (disaggregated, --async-staleness >= 1): rollout beside training

    @property
    def synchronous(self) -> float:
        return self.rollout + self.training + self.weight_sync

    @property
    def asynchronous(self) -> float:
        """Rollout and training overlap; the weight sync stays between them (the engine loads between batches)."""
        return max(self.rollout, self.training) + self.weight_sync

    @property
    def total(self) -> float:
        return self.asynchronous if self.overlapped else self.synchronous


def step_time(s: ModelShape, r: RunSettings, cluster: Cluster, plans: list[MemoryPlan]) -> StepTime:
    g = cluster.gpu
    total, active = num_params(s), active_params(s)  # memory traffic reads every expert; FLOPs follow the active
    etp = _engine_tp(s, r, cluster)
    rollout_gpus = cluster.gpus if r.mode == "colocated" else r.rollout_gpus
    train_gpus = cluster.gpus if r.mode == "colocated" else cluster.gpus - r.rollout_gpus
    engines = max(1, rollout_gpus // etp)
    seqs = r.rollout_batch_size * r.n_samples_per_prompt / engines
    rollout_plan = plans[-1]
    waves = max(1, math.ceil(rollout_plan.kv_needed / rollout_plan.kv_pool)) if rollout_plan.kv_pool > 0 else 1
    live = seqs / waves
    prefill = 2 * active * seqs * r.prompt_len / (etp * g.bf16_tflops * 1e12 * 0.5)
    kv_tp = _kv_tp(s, etp)
    mean_ctx = r.prompt_len + r.max_response_len / 2
    bytes_per_step = weights_bytes(total) / etp + live * mean_ctx * kv_bytes_per_token(s) / kv_tp
    per_step = max(bytes_per_step / (g.hbm_gbps * 1e9 * 0.7), 2 * active * live / (etp * g.bf16_tflops * 1e12 * 0.5))
    rollout = prefill + waves * r.max_response_len * (per_step + 2e-3)  # +2 ms scheduling per step
    tokens = r.rollout_batch_size * r.n_samples_per_prompt * (r.prompt_len + r.mean_response_frac * r.max_response_len)
    passes = 6 + 2 + (2 if r.kl else 0)  # update fwd+bwd, the actor's log-probs, the reference's
    attention = s.num_layers * mean_ctx * sum(_attention_widths(s))  # per token, forward: q k^T and p v
    flops = tokens * (passes * active + passes / 2 * attention) + tokens * 2 * r.teacher_params  # teacher's forward
    dp = max(1, train_gpus // (r.tp * r.pp * r.cp))
    micro = max(1, math.ceil(r.rollout_batch_size * r.n_samples_per_prompt / dp / r.updates_per_rollout
                             / r.micro_batch_size))
    bubble = 1 + (r.pp - 1) / micro
    training = flops / (train_gpus * g.bf16_tflops * 1e12 * r.mfu) * bubble
    sync_bytes = weights_bytes(total)
    if r.mode == "colocated":  # gather + HF names + CUDA IPC within the node; a quarter of NVLink is typical
        sync = sync_bytes / (g.nvlink_gbps * 1e9 / 4) + 0.5
    else:  # NCCL broadcast from the training ranks to the servers over the network
        sync = sync_bytes / (cluster.internode_gbps / 8 * 1e9 * 0.7) + 1.0
    return StepTime(rollout, training, sync, waves, overlapped=r.mode == "disaggregated" and r.async_staleness > 0)


# ------------------------------------------------------------------------------------------------ advice

@dataclass
class Plan:
    run: RunSettings
    memory: list[MemoryPlan]
    time: StepTime

    @property
    def fits(self) -> bool:
        return all(m.fits for m in self.memory)


def plan(s: ModelShape, r: RunSettings, cluster: Cluster) -> Plan:
    if r.mode == "disaggregated" and not r.rollout_gpus:
        r = best_split(s, r, cluster).run
    r = replace(r, engine_tp=_engine_tp(s, r, cluster))
    mem = memory_plan(s, r, cluster)
    return Plan(r, mem, step_time(s, r, cluster, mem))


def best_split(s: ModelShape, r: RunSettings, cluster: Cluster) -> Plan:
    """The disaggregated split with the shortest step among those that fit: whole nodes for the rollout, as
    launch/slurm/disaggregated.sbatch splits them, or whole engines within a single node."""
    unit = r.tp * r.pp
    etp = _engine_tp(s, replace(r, mode="disaggregated"), cluster)
    step = cluster.gpus_per_node if cluster.gpus > cluster.gpus_per_node else etp
    best = None
    for rollout_gpus in range(step, cluster.gpus, step):
        if (cluster.gpus - rollout_gpus) % unit:
            continue
        cand = replace(r, mode="disaggregated", rollout_gpus=rollout_gpus, engine_tp=etp)
        mem = memory_plan(s, cand, cluster)
        p = Plan(cand, mem, step_time(s, cand, cluster, mem))
        if best is None or (p.fits, -p.time.total) > (best.fits, -best.time.total):
            best = p
    if best is None:  # no split exists (e.g. one GPU): report the half-and-half attempt
        cand = replace(r, mode="disaggregated", rollout_gpus=max(1, cluster.gpus // 2), engine_tp=etp)
        mem = memory_plan(s, cand, cluster)
        best = Plan(cand, mem, step_time(s, cand, cluster, mem))
    return best


def fixes(s: ModelShape, r: RunSettings, cluster: Cluster) -> list[str]:
    """Single changes of megarl flags that make a colocated run fit."""
    out = []
    tries = [] if r.logprob_chunk_tokens else [(f"--logprob-chunk-tokens {SUGGESTED_CHUNK_TOKENS}",
                                                dict(logprob_chunk_tokens=SUGGESTED_CHUNK_TOKENS))]
    tries += [("--sequence-parallel", dict(sequence_parallel=True))] if r.tp > 1 and not r.sequence_parallel else []
    tries += [("--use-distributed-optimizer", dict(distributed_optimizer=True)),
             ("--offload-optimizer", dict(offload_optimizer=True)),
             ("--offload-optimizer --offload-params", dict(offload_optimizer=True, offload_params=True)),
             *([("--offload-frozen", dict(offload_frozen=True))]
               if (r.kl and not r.lora_rank or r.teacher_params) and not r.offload_frozen else []),
             (f"--micro-batch-size {max(1, r.micro_batch_size // 2)}",
              dict(micro_batch_size=max(1, r.micro_batch_size // 2))),
             ("--micro-batch-size 1", dict(micro_batch_size=1))]
    if r.tp * 2 <= cluster.gpus_per_node and s.num_attention_heads % (r.tp * 2) == 0:
        tries.append((f"--tensor-model-parallel-size {r.tp * 2}", dict(tp=r.tp * 2)))
    if r.pp * 2 <= s.num_layers:
        tries.append((f"--pipeline-model-parallel-size {r.pp * 2}", dict(pp=r.pp * 2)))
    for flags, change in tries:
        cand = replace(r, **change)
        if cluster.gpus % (cand.tp * cand.pp) == 0 and all(m.fits for m in memory_plan(s, cand, cluster)):
            out.append(flags)
    return out


def recommend(s: ModelShape, r: RunSettings, cluster: Cluster) -> tuple[str, str, Plan, Plan]:
    """(choice, reason, colocated plan, best disaggregated plan)."""
    colo = plan(s, replace(r, mode="colocated", rollout_gpus=0), cluster)
    dis = best_split(s, replace(r, rollout_gpus=0), cluster) if cluster.gpus > 1 else None
    if colo.fits and (dis is None or not dis.fits or colo.time.total <= dis.time.total):
        why = (f"it fits ({colo.memory[0].peak / GIB:.0f} of {cluster.gpu.memory_bytes / GIB:.0f} GiB at peak) and "
               "every "
               f"GPU works in both phases: ~{colo.time.total:.0f} s a step")
        if dis is not None and dis.fits:
            why += (f" vs ~{dis.time.total:.0f} s disaggregated ({dis.run.rollout_gpus} rollout + "
                    f"{cluster.gpus - dis.run.rollout_gpus} training GPUs, each pool idle while the other works)")
        return "colocated", why, colo, dis or colo
    if dis is not None and dis.fits:
        if colo.fits:
            why = (f"~{dis.time.total:.0f} s a step vs ~{colo.time.total:.0f} s colocated: the dedicated engines keep "
                   f"a KV pool large enough to decode the batch in {dis.time.waves} wave(s) instead of "
                   f"{colo.time.waves}")
        else:
            why = (f"colocated does not fit ({colo.memory[0].problems[0]}); with {dis.run.rollout_gpus} GPUs for "
                   f"SGLang and {cluster.gpus - dis.run.rollout_gpus} for training it does")
        return "disaggregated", why, colo, dis
    fix = fixes(s, replace(r, mode="colocated", rollout_gpus=0), cluster)
    why = ("neither layout fits: " if dis is not None else "it does not fit (one GPU: colocated only): ")
    why += (colo.memory[0].problems or ["?"])[0]
    why += (f"; each of these makes colocated fit: {'; '.join(fix)}" if fix
            else "; it needs more GPUs or a smaller model")
    return "neither", why, colo, dis or colo



def logprob_head_bytes(tokens: float, vocab: int, hidden: int, *, tp: int = 1, chunk_tokens: int = 0) -> float:
    """Extra peak bytes of the log-prob and entropy head, forward and backward, on one TP rank, above its inputs
    (the hidden states and the output-weight shard), with fp32 logits, as tools/bench/logprob_memory.py measures it.

    Full logits (`chunk_tokens` 0): five [tokens, vocab / TP] fp32 tensors are live at the peak (the cross-entropy's
    scaled copy, kept as its softmax, the entropy's scaled copy, its exp(x - m) kept for the backward pass, and
    gradients), plus the weight's gradient. Chunked (`--logprob-chunk-tokens`): three [chunk, vocab / TP] tensors
    (the chunk's logits, their exponentials or gradient, and a transposed copy of it for the weight's gradient), two
    weight-sized ones (the weight's fp32 gradient and a transposed copy for the matmul) and the hidden states'
    gradient. Both add a few fp32 numbers per token (log-probs, entropy, sums). Below two whole chunks (tokens <
    2 x chunk) two chunk-sized tensors are live at the peak, not three: the third is a whole chunk's, held while
    the next whole chunk is computed (measured, chunk 1,024, vocab 151,936: 1,262 MiB at 1,024 and 1,536 tokens,
    1,856 at 2,048)."""
    local = vocab / tp
    per_token = 32
    if not chunk_tokens:
        return 4 * (5 * tokens * local + local * hidden) + per_token * tokens
    live = 3 if tokens >= 2 * chunk_tokens else 2
    return 4 * (live * min(chunk_tokens, tokens) * local + 2 * local * hidden + tokens * hidden) + per_token * tokens
