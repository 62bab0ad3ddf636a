"""The rollout slots' registries, and the options of the built-in entries that take any.

    ROLLOUTS   rollout functions (`--rollout-function`)   `megarl.rollout.functions`, `.tool_use`
    BACKENDS   rollout engines (`--rollout-backend`)      `megarl.rollout.backends`

As in `megarl.algorithms.slots`: the entries register themselves when their module is imported (on the first
lookup), and the built-ins' options are declared here, in pure Python, so that the command line lists their flags
and each section checks its own values without importing torch. Sections: "rollout_function.tool_use",
"rollout_backend.builtin", "rollout_backend.sglang".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megarl.errors import ConfigError
from megarl.registry import Registry, option

ROLLOUTS = Registry("rollout function", builtins=("megarl.rollout.functions", "megarl.rollout.tool_use",
                                                      "megarl.rollout.verifiers_env"),
                    options_declared_here=True)
BACKENDS = Registry("rollout backend", builtins=("megarl.rollout.backends",), options_declared_here=True)


def _positive(obj, *names: str) -> None:
    for n in names:
        if getattr(obj, n) < 1:
            raise ConfigError(f"--{n.replace('_', '-')} must be >= 1, got {getattr(obj, n)}")


@dataclass
class ToolUseOptions:
    """`--rollout-function tool_use`: its parser, its tools, its limits, and the per-call limits it builds every
    tool with (`megarl.tool_calls.ToolSettings`, with the run's `--sandbox*`); `megarl.rollout.tool_use`."""

    tool_parser: str = option("hermes", "--rollout-function tool_use: how a turn's tool calls are read (hermes: "
                              "<tool_call>{json}</tool_call>; python: a fenced python block calls the python tool)",
                              names="megarl.tool_calls:TOOL_PARSERS")
    tools: str = option("python", "--rollout-function tool_use: comma-separated tools the model may call (registered "
                        "with megarl.tool_calls.register_tool)", names="megarl.tool_calls:TOOLS", many=True)
    max_turns: int = option(4, "tool_use: most model turns per trajectory (a turn ends at a tool call or the end)")
    max_tool_calls: int = option(4, "tool_use: most tool calls per trajectory; a turn that calls beyond them ends it, "
                                 "those calls unrun")
    max_tool_output_tokens: int = option(256, "tool_use: a call's output is cut to this many tokens, with a marker "
                                         "saying how many were cut (the whole trajectory stays within "
                                         "--max-response-len tokens, policy and tools together)")
    tool_response_format: Literal["auto", "chat", "text"] = option(
        "auto", "tool_use: tool output as the chat template's tool turn (chat; turns end at the end-of-turn "
        "token) or in the parser's text wrapper right after the call (text; turns end at the call's closing "
        "tag); auto = chat when the tokenizer has a chat template")
    tool_timeout: float = option(5.0, "seconds of wall-clock (and CPU) time per tool call")
    tool_memory_mb: int = option(256, "memory a tool call may use")
    tool_output_bytes: int = option(16384, "stdout (and stderr) bytes a tool call may print; more is cut and said so")
    tool_workers: int = option(2, "sandbox workers running tool calls: the calls of a batch run this many at a time "
                               "(the sandbox is --sandbox)")
    tool_call_cost: float = option(0.0, "tool_use: subtracted from a trajectory's reward per tool call; 0 = off")
    tool_format_bonus: float = option(0.0, "tool_use: added to the reward of a trajectory that called a tool and "
                                      "whose every call was well formed and ran without error; 0 = off")
    tool_calls_fail: bool = option(False, "tool_use control runs: every tool call gets an error observation and "
                                   "nothing runs (what the tool is worth)")
    openenv: str = option("", "tool_use: an OpenEnv Environment subclass, 'pkg.module:Class', run in this process: "
                          "one instance per trajectory, reset with the row's label, stepped by --openenv-tool calls "
                          "(megarl.tool_calls.openenv; needs megarl[openenv])")
    openenv_url: str = option("", "tool_use: an OpenEnv server (http://127.0.0.1:PORT), one WebSocket session per "
                              "trajectory, instead of --openenv; it must allow as many sessions as the ranks' "
                              "trajectories of a rollout")
    openenv_tool: str = option("env", "tool_use with --openenv / --openenv-url: the tool name whose calls step the "
                               "environment; a call's arguments are the action's fields")
    openenv_timeout: float = option(30.0, "tool_use: seconds to connect to --openenv-url and for each environment "
                                    "reset or step (a step past it fails its trajectory)")

    def __post_init__(self):
        _positive(self, "max_turns", "max_tool_calls", "max_tool_output_tokens", "tool_memory_mb",
                  "tool_output_bytes", "tool_workers")
        if self.tool_timeout <= 0:
            raise ConfigError(f"--tool-timeout must be > 0 seconds, got {self.tool_timeout}")
        if self.tool_call_cost < 0 or self.tool_format_bonus < 0:
            raise ConfigError(f"--tool-call-cost and --tool-format-bonus must be >= 0, got {self.tool_call_cost} "
                              f"and {self.tool_format_bonus}")
        if not [t for t in self.tools.split(",") if t.strip()]:
            raise ConfigError("--tools must name at least one tool, e.g. --tools python")
        if self.openenv and self.openenv_url:
            raise ConfigError(f"--openenv {self.openenv} and --openenv-url {self.openenv_url}: give one (in-process "
                              "or served)")
        if self.openenv and (":" not in self.openenv or self.openenv.startswith(":") or self.openenv.endswith(":")):
            raise ConfigError(f"--openenv {self.openenv!r}: expected 'pkg.module:Class'")
        if self.openenv_url and not self.openenv_url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ConfigError(f"--openenv-url {self.openenv_url!r}: expected http://, https://, ws:// or wss://")
        if self.openenv_timeout <= 0:
            raise ConfigError(f"--openenv-timeout must be > 0 seconds, got {self.openenv_timeout}")
        if (self.openenv or self.openenv_url) and self.openenv_tool in [t.strip() for t in self.tools.split(",")]:
            raise ConfigError(f"--openenv-tool {self.openenv_tool!r} is also in --tools {self.tools}: give the "
                              "environment's tool another name")


@dataclass
class VerifiersOptions:
    """`--rollout-function verifiers`: a verifiers 0.4.0 taskset, run in the environment `make verifiers-env`
    builds, in a process of its own, against a token endpoint over the run's engine (`megarl.rollout.verifiers_env`)."""

    verifiers_taskset: str = option("", "--rollout-function verifiers: the taskset id (the importable module that "
                                    "exports the verifiers Taskset); row i of --prompt-data is its task i")
    verifiers_path: str = option("", "verifiers: directories put on the verifiers process's PYTHONPATH, "
                                 "':'-separated (where the taskset's module is)")
    verifiers_env: str = option("", "verifiers: the environment `make verifiers-env` built; empty = "
                                "$MEGARL_VERIFIERS_ENV, else .cache/verifiers-env in the checkout")
    verifiers_timeout: float = option(600.0, "verifiers: seconds one rollout call (all its episodes) may take; the "
                                      "verifiers process is killed after that and the call fails")
    verifiers_max_turns: int = option(0, "verifiers: most model turns per episode; 0 = the taskset's own limit")
    verifiers_concurrency: int = option(64, "verifiers: episodes in flight at once (their requests are batched "
                                        "into the engine)")
    verifiers_batch_window: float = option(0.05, "verifiers: seconds the token endpoint waits for more requests "
                                           "before it calls the engine")
    verifiers_correct_at: float = option(1.0, "verifiers: an episode whose reward is at least this is outcome "
                                         "'correct' (what dynamic sampling and the accuracy metric read)")

    def __post_init__(self):
        _positive(self, "verifiers_concurrency")
        if self.verifiers_timeout <= 0 or self.verifiers_batch_window < 0 or self.verifiers_max_turns < 0:
            raise ConfigError(f"--verifiers-timeout must be > 0, --verifiers-batch-window and --verifiers-max-turns "
                              f">= 0; got {self.verifiers_timeout}, {self.verifiers_batch_window} and "
                              f"{self.verifiers_max_turns}")

    def resolve(self, cfg) -> None:
        if cfg.rollout.rollout_function == "verifiers" and not self.verifiers_taskset:
            raise ConfigError("--rollout-function verifiers needs --verifiers-taskset (the verifiers taskset's "
                              "module name)")


@dataclass
class BuiltinOptions:
    """`--rollout-backend builtin`: megarl's PyTorch engine (`megarl.rollout.backends`)."""

    rollout_device: Literal["auto", "cpu", "cuda"] = option("auto", "where the built-in engine runs")
    rollout_threads: int = option(1, "--async-staleness >= 1 with the built-in engine: torch threads of the engine's "
                                  "own process (the trainer keeps --threads-per-rank)")

    def __post_init__(self):
        _positive(self, "rollout_threads")


@dataclass
class SGLangOptions:
    """`--rollout-backend sglang`: the engine's share of the GPU, its TP size, and where the servers of
    `--rollout-servers` meet the trainer for weight updates (`megarl.rollout.backends`)."""

    sglang_mem_fraction: float = option(0.5, "share of each GPU SGLang takes for weights and KV cache "
                                        "(mem_fraction_static); the rest stays with the colocated actor")
    sglang_tp_size: int = option(0, "SGLang's tensor-parallel size; 0 = the actor's TP size (colocated) or what each "
                                 "server reports (--rollout-servers)")
    weight_sync_port: int = option(0, "disaggregated mode: the port of the weight-update group's rendezvous on rank "
                                   "0's host; 0 = MASTER_PORT + 17")

    def __post_init__(self):
        if not 0 < self.sglang_mem_fraction < 1:
            raise ConfigError(f"--sglang-mem-fraction must be in (0, 1), got {self.sglang_mem_fraction}")
        if self.sglang_tp_size < 0 or self.weight_sync_port < 0:
            raise ConfigError(f"--sglang-tp-size and --weight-sync-port must be >= 0, got {self.sglang_tp_size} and "
                              f"{self.weight_sync_port}")

    def resolve(self, cfg) -> None:
        r, tp = cfg.rollout, cfg.model.tensor_model_parallel_size
        if r.rollout_backend == "sglang" and not r.rollout_servers and self.sglang_tp_size > tp:
            raise ConfigError(f"--sglang-tp-size {self.sglang_tp_size}: a colocated SGLang engine runs on the GPUs of "
                              "its model replica's first-stage TP ranks, which each hand it the weights from their "
                              f"own GPU, so at most --tensor-model-parallel-size {tp} (0 = the same)")


def check_adapter_sync(cfg) -> None:
    """`--lora-weight-sync adapter`: SGLang gets the adapters in PEFT form (`megarl.mcore.lora.peft_tensors`),
    through its LoRA API; what that takes (`megarl.config.Config` calls this when the flag says adapter)."""
    m = cfg.model
    if not m.lora_rank:
        raise ConfigError("--lora-weight-sync adapter needs --lora-rank > 0 (without adapters every engine gets "
                          "the whole model: --lora-weight-sync merged)")
    if experts := [t for t in m.lora_targets if t.startswith("experts.")]:
        raise ConfigError(f"--lora-weight-sync adapter with --lora-target-modules {','.join(experts)}: SGLang "
                          "0.5.23 loads PEFT target_modules, not the target_parameters that hold expert adapters; "
                          "use --lora-weight-sync merged")
    qkv = {"q_proj", "k_proj", "v_proj"} & set(m.lora_targets)
    if (qkv and not {"q_proj", "v_proj"} <= qkv) or ("up_proj" in m.lora_targets
                                                    and "gate_proj" not in m.lora_targets):
        raise ConfigError(f"--lora-weight-sync adapter with --lora-target-modules {m.lora_target_modules}: "
                          "SGLang 0.5.23 stacks the q, k, v adapters into one (and gate, up) and needs q_proj "
                          "with v_proj, and gate_proj with up_proj (k_proj or up_proj may be left out); add "
                          "them or use --lora-weight-sync merged")
    if cfg.training.async_staleness:
        raise ConfigError(f"--lora-weight-sync adapter with --async-staleness {cfg.training.async_staleness}: "
                          "a new adapter replaces the old one while other leaders' queued batches may still "
                          "name it; use --lora-weight-sync merged")


ROLLOUTS.declare("tool_use", ToolUseOptions)
ROLLOUTS.declare("verifiers", VerifiersOptions)
BACKENDS.declare("builtin", BuiltinOptions)
BACKENDS.declare("sglang", SGLangOptions)
