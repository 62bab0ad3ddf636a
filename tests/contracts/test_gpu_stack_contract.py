"""The GPU set's upstream facts megarl relies on, checked on CPU against the released packages' own files.

- Transformer Engine's parameter names, as megarl's weight table maps them (`megarl/mcore/convert.py`:
  `_TE_ALIASES`, the grouped-expert pattern in `global_param_names`, and the rule table), read with `ast` from the
  Python sources of the release the `gpu` extra pins. Those sources ship in the small pure-Python
  `transformer_engine` wheel (0.7 MB for 2.11.0); `transformer_engine_torch` (the compiled part) is not needed.
  The names are built the way TE builds them (`register_parameter("layer_norm_weight", ...)`, `weight_names =
  ["weight"]` when `parameters_split is None`, `register_parameter(f"weight{i}", ...)` per grouped expert), put
  under the module names megatron-core 0.16.1's TE layer spec gives them, and passed through megarl's own
  `global_param_names`: every Megatron name of the Qwen3-MoE / Qwen2 rule table must come out. A renamed TE
  parameter fails here, not on the first GPU load.
- SGLang's pins (torch, transformers): the `gpu` extra must pin what SGLang's wheel requires.

Downloads (`pip download --no-deps`) land in .cache/contract/ once, under the lock the other contract tests use;
without network and without the cache, the tests skip and name the command that fills it.
"""

from __future__ import annotations

import ast
import functools
import re
import runpy
import types
import zipfile
from unittest import mock

import setuptools
from packaging.requirements import Requirement

from sglang_upstream import ROOT, fetch_wheel

from megarl.mcore import convert

# One fetcher for every upstream wheel these tests read (cache, lock, the offline skip): sglang_upstream's.


@functools.lru_cache(maxsize=1)
def gpu_extra() -> dict[str, Requirement]:
    with mock.patch.object(setuptools, "setup") as setup:
        runpy.run_path(str(ROOT / "setup.py"))
    return {Requirement(r).name.lower(): Requirement(r) for r in setup.call_args.kwargs["extras_require"]["gpu"]}


def pinned(name: str) -> str:
    (spec,) = gpu_extra()[name].specifier
    assert spec.operator == "==", gpu_extra()[name]
    return spec.version


# --- Transformer Engine's sources --------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def te_wheel() -> zipfile.ZipFile:
    version = pinned("transformer-engine")
    return zipfile.ZipFile(fetch_wheel(f"transformer-engine=={version}",
                                       f"transformer_engine-{version}-py3-none-any.whl"))


def te_class(path: str, name: str) -> ast.ClassDef:
    """Class `name` of `transformer_engine/pytorch/<path>` in the pinned wheel."""
    tree = ast.parse(te_wheel().read(f"transformer_engine/pytorch/{path}").decode())
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"transformer_engine/pytorch/{path} defines no class {name}"
    return found[0]


def _template(node: ast.expr) -> str | None:
    """A parameter name as written: "weight" for a string, "weight{}" for f"weight{i}", None otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def registered(cls: ast.ClassDef) -> set[str]:
    """Names passed literally to `self.register_parameter(...)` anywhere in the class."""
    return {t for n in ast.walk(cls) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "register_parameter" and n.args and (t := _template(n.args[0])) is not None}


def default_split_names(cls: ast.ClassDef) -> set[str]:
    """`weight_names` / `bias_names` set under `if parameters_split is None:` (megatron-core passes no split)."""
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "parameters_split is None":
            for stmt in node.body:
                if (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.List)
                        and ast.unparse(stmt.targets[0]) in ("self.weight_names", "self.bias_names")):
                    names |= {_template(e) for e in stmt.value.elts}
    assert names, f"{cls.name}: no `if parameters_split is None:` default names"
    return names


@functools.lru_cache(maxsize=1)
def te_leaves() -> dict[str, set[str]]:
    """Parameter names of the TE modules megatron-core's TE spec builds, from the pinned sources."""
    rmsnorm = te_class("module/rmsnorm.py", "RMSNorm")  # te.pytorch.RMSNorm, a subclass of ops.RMSNorm
    assert [ast.unparse(b) for b in rmsnorm.bases] == ["_RMSNormOp"], ast.unparse(rmsnorm)
    return {
        "LayerNormLinear": registered(te_class("module/layernorm_linear.py", "LayerNormLinear"))
        | default_split_names(te_class("module/layernorm_linear.py", "LayerNormLinear")),
        "Linear": default_split_names(te_class("module/linear.py", "Linear")),
        "GroupedLinear": registered(te_class("module/grouped_linear.py", "GroupedLinear")),
        "RMSNorm": registered(rmsnorm) | registered(te_class("ops/basic/rmsnorm.py", "RMSNorm")),
    }


# megatron-core 0.16.1's TE spec (`get_gpt_layer_with_transformer_engine_spec` / `TEGroupedMLP`): which TE class
# each Megatron module of a layer is. Layer 0 is dense (the norms fused into linear_qkv and linear_fc1), layer 1 a
# MoE layer (its pre-MLP norm a TENorm before the router, its experts one GroupedLinear per fc).
_DENSE = {"self_attention.linear_qkv": "LayerNormLinear", "self_attention.linear_proj": "Linear",
          "self_attention.q_layernorm": "RMSNorm", "self_attention.k_layernorm": "RMSNorm",
          "mlp.linear_fc1": "LayerNormLinear", "mlp.linear_fc2": "Linear"}
_MOE = {**{k: v for k, v in _DENSE.items() if not k.startswith("mlp.")}, "pre_mlp_layernorm": "RMSNorm",
        "mlp.experts.linear_fc1": "GroupedLinear", "mlp.experts.linear_fc2": "GroupedLinear"}
EXPERTS = 3


def te_model_names() -> list[str]:
    """A two-layer Qwen3-MoE's parameter names as a TE-spec GPTModel names them; megatron's own modules
    (embedding, router, output layer) as megatron names them."""
    leaves = te_leaves()
    names = ["embedding.word_embeddings.weight", "output_layer.weight", "decoder.layers.1.mlp.router.weight"]
    names += [f"decoder.final_layernorm.{leaf}" for leaf in leaves["RMSNorm"]]
    for layer, modules in enumerate((_DENSE, _MOE)):
        for module, te in modules.items():
            for leaf in leaves[te]:
                for e in range(EXPERTS if "{}" in leaf else 1):
                    names.append(f"decoder.layers.{layer}.{module}.{leaf.format(e)}")
    return names


def expected_megatron_names() -> set[str]:
    """The rule table's Megatron names for the same model (every rule, the Qwen2 q/k/v bias included)."""
    rules = [r.mcore for r in convert.FAMILY_RULES["qwen3_moe"]]
    out = {r for r in rules if "{i}" not in r}
    out |= {r.format(i=0) for r in rules if "{i}" in r and "{e}" not in r and ".mlp.router." not in r}
    out |= {r.format(i=1, e=e) for r in rules if "{i}" in r and "mlp.linear_fc" not in r for e in range(EXPERTS)}
    return out


def test_te_parameter_names_map_onto_every_megatron_name_of_the_weight_table():
    names = te_model_names()
    layers = [types.SimpleNamespace(layer_number=n) for n in (1, 2)]
    model = types.SimpleNamespace(decoder=types.SimpleNamespace(layers=layers),
                                  named_parameters=lambda: [(n, None) for n in names])
    canonical = set(convert.global_param_names(model).values())
    missing = expected_megatron_names() - canonical
    assert not missing, (f"transformer-engine=={pinned('transformer-engine')}'s parameter names no longer reach "
                         f"these Megatron names through megarl/mcore/convert.py: {sorted(missing)}; "
                         f"TE modules' names: {te_leaves()}")


def test_te_grouped_expert_weights_are_out_by_in_and_carry_the_tp_attribute_convert_reads():
    """`weight{i}` is (out_features, in_features), as the local spec's per-expert Linear; TE marks its parameters
    with `tensor_model_parallel`, which convert._is_tp_sharded reads."""
    grouped = te_class("module/grouped_linear.py", "GroupedLinear")
    shapes = [ast.unparse(c) for c in ast.walk(grouped) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
              and c.func.attr == "register_parameter" and _template(c.args[0]) == "weight{}"]
    assert len(shapes) == 1 and re.search(r"torch\.empty\(\s*self\.out_features,\s*self\.in_features,", shapes[0]), \
        shapes
    tree = ast.parse(te_wheel().read("transformer_engine/pytorch/distributed.py").decode())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef)
             and n.name == "set_tensor_model_parallel_attributes"]
    set_attrs = {c.args[1].value for c in ast.walk(fn)
                 if isinstance(c, ast.Call) and ast.unparse(c.func) == "setattr"}
    assert {"tensor_model_parallel", "partition_dim"} <= set_attrs, set_attrs


def test_gpu_extra_pins_what_sglang_requires():
    """SGLang's wheel pins torch and transformers exactly; the `gpu` extra must pin the same, or it does not
    install as one set."""
    version = pinned("sglang")
    with zipfile.ZipFile(fetch_wheel(f"sglang=={version}", f"sglang-{version}-*.whl")) as whl:
        metadata = whl.read(f"sglang-{version}.dist-info/METADATA").decode()
    requires = {r.name.lower(): r for r in map(Requirement, re.findall(r"^Requires-Dist: (.+)$", metadata, re.M))
                if r.marker is None}
    for name in ("torch", "transformers"):
        assert str(requires[name].specifier) == f"=={pinned(name)}", (name, str(requires[name]))
