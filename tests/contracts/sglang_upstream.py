"""SGLang 0.5.23's own source, for the contract tests, read from its wheel without installing SGLang.

SGLang pins torch==2.14.1 (a CUDA build on PyPI) and ~47 other packages, so it is not installed in the CPU test
environment. Its wheel (39 MB, `pip download --no-deps`) is fetched once into .cache/contract/, under a file lock so
that two xdist workers do not both fetch it, and the pieces the adapter's contract depends on are taken from it:

- `sglang/api/v1/api_types.py`, whole: the generated `/generate` schema that SGLang's HTTP server checks every
  body against (`entrypoints/api_contract.py`). It needs msgspec only.
- The control endpoints' body types: the route table of `entrypoints/http_server.py` (route path -> the
  `Annotated[X, Body()]` type), and those classes (with their `BaseReq` base) taken out of `managers/io_struct.py`
  and executed with `utils/msgspec_utils.py`, whole, which turns them into the pydantic schema FastAPI validates
  with. io_struct.py itself imports torch, zmq and half of SGLang, so only the class definitions are executed.
- `Engine`'s method signatures (with its bases `EngineScoreMixin` and `EngineBase`) and `ServerArgs`' field names and
  declared types, read with `ast` from `entrypoints/engine.py` and `server_args.py` + `arg_groups/fields/*.py`:
  neither module imports without the 2.14.1 stack.
- The weight-sync path, as code that runs here under torch 2.13: `weight_sync/tensor_bucket.py` (whole; it imports
  only torch), and from `utils/common.py` the `MultiprocessingSerializer`, its `SafeUnpickler` and the payload
  normaliser; from `managers/tp_worker.py` `deserialize_own_rank`; from
  `model_executor/model_runner_components/weight_updater.py` `_update_weights_from_flattened_bucket` and
  `_receive_bucketed_weights_from_distributed`.

What is stood in for, and why (each is named where it is built): `pybase64` by the standard library's `base64` when
it is not installed (same `b64encode` / `b64decode(validate=)`); `get_parallel()` by the TP rank under test;
`monkey_patch_torch_reductions` by a no-op (it re-maps CUDA device indices in IPC handles, and no CUDA tensor is
involved here); `sglang`, `sglang.srt` and `sglang.srt.weight_sync` by empty packages (their `__init__` files import
the whole runtime). Nothing here runs SGLang under the torch 2.14.1 it pins, builds a real `ServerArgs`, or opens a
CUDA IPC handle: those need the GPU stack (tools/gpu_check.sh).
"""

from __future__ import annotations

import ast
import fcntl
import functools
import inspect
import subprocess
import sys
import textwrap
import types
import typing
import zipfile
from pathlib import Path

import pytest

SGLANG_VERSION = "0.5.23"
ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "contract"
DOWNLOAD_TIMEOUT_S = 300
# The names SGLang's pickled payloads refer to: the wheel's modules are executed under them (see `weight_sync`).
TENSOR_BUCKET = "sglang.srt.weight_sync.tensor_bucket"
_PRIVATE = "_megarl_contract_sglang"  # prefix of the other modules built here, out of `sglang`'s namespace


_UNAVAILABLE: dict[str, str] = {}  # requirement -> why it could not be fetched: tried once per process


def fetch_wheel(requirement: str, pattern: str) -> Path:
    """`pip download --no-deps requirement` into .cache/contract/ once; the wheel matching `pattern` there.

    Skips the calling test, naming the command, when the wheel is absent and cannot be fetched (offline); the
    download is tried once per process, with pip's retries and socket timeout kept short."""
    if requirement in _UNAVAILABLE:
        pytest.skip(_UNAVAILABLE[requirement])
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another xdist worker may be fetching it right now
        found = sorted(CACHE.glob(pattern))
        if not found:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--retries", "1", "--timeout",
                   "20", requirement, "-d", str(CACHE)]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
                why = (done.stderr or done.stdout).strip().splitlines()[-1:] if done.returncode else []
            except subprocess.TimeoutExpired:
                why = [f"no answer in {DOWNLOAD_TIMEOUT_S} s"]
            found = sorted(CACHE.glob(pattern))
            if not found:
                _UNAVAILABLE[requirement] = (
                    f"{requirement} is not in {CACHE} and could not be downloaded (offline?): "
                    f"{' '.join(why) or 'no wheel'}; fill the cache with `pip download --no-deps {requirement} "
                    f"-d {CACHE}`")
                pytest.skip(_UNAVAILABLE[requirement])
    return found[-1]


@functools.lru_cache(maxsize=1)
def _wheel() -> zipfile.ZipFile:
    return zipfile.ZipFile(fetch_wheel(f"sglang=={SGLANG_VERSION}", f"sglang-{SGLANG_VERSION}-*.whl"))


def source(path: str) -> str:
    """The text of `sglang/<path>` in the wheel."""
    return _wheel().read(f"sglang/{path}").decode()


def _module(name: str, code: str, filename: str, namespace: dict | None = None) -> types.ModuleType:
    """Execute `code` as module `name` (registered in sys.modules: msgspec and pickle resolve names through it)."""
    module = types.ModuleType(name)
    module.__file__ = filename
    module.__dict__.update(namespace or {})
    sys.modules[name] = module
    exec(compile(code, filename, "exec"), module.__dict__)
    return module


@functools.lru_cache(maxsize=None)
def _parsed(path: str) -> dict[str, ast.AST]:
    return {n.name: n for n in ast.parse(source(path)).body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}


@functools.lru_cache(maxsize=None)
def _lines(path: str) -> list[str]:
    return source(path).splitlines(keepends=True)


def _pieces(path: str, nodes: list[ast.AST], prelude: str = "") -> str:
    """The source of `nodes` of `sglang/<path>` (methods dedented to functions), each on its own line numbers,
    after `prelude` (imports, in the lines above the first): a traceback then points at the wheel's real lines.
    `ast.get_source_segment` is not used: it splits the whole file again on every call."""
    lines = _lines(path)
    code = prelude
    for node in sorted(nodes, key=lambda n: n.lineno):
        pad = node.lineno - 1 - code.count("\n")
        if pad < 0:
            raise ValueError(f"sglang/{path}: {getattr(node, 'name', node)} overlaps the prelude or another piece")
        code += "\n" * pad + textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno]))
    return code


def _defs(path: str, names: set[str]) -> dict[str, ast.AST]:
    """The top-level classes / functions of `sglang/<path>` by name, checking `names` are there."""
    nodes = _parsed(path)
    missing = names - nodes.keys()
    if missing:
        raise LookupError(f"sglang {SGLANG_VERSION} sglang/{path} defines no {sorted(missing)}")
    return nodes


def _methods(path: str, cls: str, names: set[str]) -> str:
    """The source of methods `names` of class `cls` in `sglang/<path>`, dedented to top-level functions."""
    nodes = _defs(path, {cls})
    found = {n.name: n for n in nodes[cls].body if isinstance(n, ast.FunctionDef) and n.name in names}
    if found.keys() != names:
        raise LookupError(f"sglang {SGLANG_VERSION} {cls} in sglang/{path} has no {sorted(names - found.keys())}")
    return _pieces(path, list(found.values()))


# -- /generate: the generated schema -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def api_types() -> types.ModuleType:
    """`sglang/api/v1/api_types.py`, whole (msgspec only)."""
    return _module(f"{_PRIVATE}.api_types", source("api/v1/api_types.py"), "sglang/api/v1/api_types.py")


# -- control endpoints: the route table and the body types --------------------------------------------------------


@functools.lru_cache(maxsize=1)
def routes() -> dict[str, str | None]:
    """Every POST route of SGLang's HTTP server: path -> the name of its JSON body type (None: it takes no body).

    Read from `entrypoints/http_server.py`'s decorators: `@app.post(path)` / `@app.api_route(path, methods=[..."POST"])`
    and the handler's `Annotated[X, Body()]` (or plain `X`) parameter."""
    text = source("srt/entrypoints/http_server.py")
    out: dict[str, str | None] = {}
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for deco in node.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                    and deco.func.attr in ("post", "api_route") and deco.args
                    and isinstance(deco.args[0], ast.Constant) and isinstance(deco.args[0].value, str)):
                continue
            methods = next((k.value for k in deco.keywords if k.arg == "methods"), None)
            if deco.func.attr == "api_route" and methods is not None and "POST" not in ast.literal_eval(methods):
                continue
            out[deco.args[0].value] = _body_type(node)
    return out


def _body_type(handler) -> str | None:
    for arg in handler.args.args:
        ann = arg.annotation
        if ann is None:
            continue
        if (isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Annotated"
                and "Body(" in ast.unparse(ann)):
            return ast.unparse(ann.slice.elts[0])
        if isinstance(ann, ast.Name) and ann.id.endswith(("ReqInput", "Req", "Request")) and arg.arg == "obj":
            return ann.id
    return None


@functools.lru_cache(maxsize=None)
def body_type(name: str) -> type:
    """io_struct's class `name` (a msgspec Struct on `BaseReq`), executed alone with SGLang's msgspec_utils."""
    path = "srt/utils/msgspec_utils.py"
    utils = _module(f"{_PRIVATE}.msgspec_utils", source(path), f"sglang/{path}")
    nodes = _defs("srt/managers/io_struct.py", {name, "BaseReq"})
    chain, cls = [], nodes[name]
    while cls is not None:  # the class and its bases defined in io_struct, base first
        chain.insert(0, cls)
        base = next((b.id for b in cls.bases if isinstance(b, ast.Name) and b.id in nodes), None)
        cls = nodes[base] if base else None
    prelude = ("from __future__ import annotations\n"
               "from typing import Annotated, Any, Dict, List, Literal, Optional, Tuple, Union\n"
               "import msgspec\n")
    code = _pieces("srt/managers/io_struct.py", chain, prelude)
    module = _module(f"{_PRIVATE}.io_struct_{name}", code, "sglang/srt/managers/io_struct.py",
                     {"Base64Bytes": utils.Base64Bytes,
                      "msgspec_struct_pydantic_core_schema": utils.msgspec_struct_pydantic_core_schema})
    return getattr(module, name)


# -- Engine and ServerArgs, read with ast -------------------------------------------------------------------------


_NO_DEFAULT = inspect.Parameter.empty


@functools.lru_cache(maxsize=1)
def engine_signatures() -> dict[str, inspect.Signature]:
    """Public method name -> signature (names, kinds, which have defaults) of `sglang.Engine`, its own methods over
    its bases' (`class Engine(EngineScoreMixin, EngineBase)`)."""
    out: dict[str, inspect.Signature] = {}
    for path, cls in [("srt/entrypoints/EngineBase.py", "EngineBase"),
                      ("srt/entrypoints/engine_score_mixin.py", "EngineScoreMixin"),
                      ("srt/entrypoints/engine.py", "Engine")]:
        nodes = _defs(path, {cls})
        for fn in nodes[cls].body:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[fn.name] = _signature(fn.args)
    return out


def _signature(a: ast.arguments) -> inspect.Signature:
    P = inspect.Parameter
    params = []
    positional = a.posonlyargs + a.args
    defaults = [_NO_DEFAULT] * (len(positional) - len(a.defaults)) + [None] * len(a.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        kind = P.POSITIONAL_ONLY if i < len(a.posonlyargs) else P.POSITIONAL_OR_KEYWORD
        params.append(P(arg.arg, kind, default=default))
    if a.vararg:
        params.append(P(a.vararg.arg, P.VAR_POSITIONAL))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        params.append(P(arg.arg, P.KEYWORD_ONLY, default=_NO_DEFAULT if default is None else None))
    if a.kwarg:
        params.append(P(a.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


@functools.lru_cache(maxsize=1)
def server_args_fields() -> dict[str, str]:
    """`ServerArgs`' input fields -> their declared type's source. SGLang 0.5.23 assembles `ServerArgs` with
    `msgspec.defstruct` from the namespaces listed in `server_args._INPUT_NAMESPACES` (each a Struct in
    `arg_groups/fields/*.py` whose fields are `name: A[T, help] = default`) plus `ServerArgs`' own annotations."""
    text = source("srt/server_args.py")
    tree = ast.parse(text)
    where: dict[str, str] = {}  # namespace class -> module
    listed: list[str] = []
    fields: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang.srt.arg_groups.fields."):
            where.update({alias.name: node.module for alias in node.names})
        elif (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES"
                                                   for t in node.targets)):
            listed = [e.id for e in node.value.elts]
        elif isinstance(node, ast.ClassDef) and node.name == "ServerArgs":
            fields.update(_annotated(node))
    if not listed:
        raise LookupError(f"sglang {SGLANG_VERSION} server_args.py has no _INPUT_NAMESPACES list")
    for name in listed:
        module = where[name].removeprefix("sglang.")
        nodes = _defs(module.replace(".", "/") + ".py", {name})
        fields.update(_annotated(nodes[name]))
    return fields


def _annotated(cls: ast.ClassDef) -> dict[str, str]:
    out = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            ann = node.annotation
            if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "A":
                ann = ann.slice.elts[0]  # A[T, help or Arg(...)]: the type is T
            out[node.target.id] = ast.unparse(ann)
    return out


def declared_type(annotation: str):
    """A field's declared type as a typing object, for the plain ones (int, Optional[float], Literal[...], ...)."""
    return eval(annotation, {k: getattr(typing, k) for k in typing.__all__}, {})


# -- LoRA adapters from tensors: how SGLang reads them ------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def lora() -> types.SimpleNamespace:
    """SGLang's reading of an adapter loaded from tensors (`LoRAAdapter.initialize_weights_from_tensors`), as its
    code run here: `LoRAConfig` (`lora/lora_config.py`, whole: it imports huggingface_hub only), `get_layer_id`
    (`layers/utils/common.py`), the adapter's `normalize_qkv_proj` / `normalize_gate_up_proj` (which stack PEFT's
    q/k/v and gate/up tensors into SGLang's fused buffers), and `SUPPORTED_LORA_TARGET_MODULES`, the choices of
    `--lora-target-modules` (`utils/common.py`)."""
    config = _module(f"{_PRIVATE}.lora_config", source("srt/lora/lora_config.py"), "sglang/srt/lora/lora_config.py")
    layer_utils = _defs("srt/layers/utils/common.py", {"get_layer_id"})
    layers = _module(f"{_PRIVATE}.layer_utils", _pieces("srt/layers/utils/common.py",
                                                         [layer_utils["get_layer_id"]], "import re\n"),
                     "sglang/srt/layers/utils/common.py")
    adapter = _module(f"{_PRIVATE}.lora_adapter", _methods("srt/lora/lora.py", "LoRAAdapter",
                                                           {"normalize_qkv_proj", "normalize_gate_up_proj"}),
                      "sglang/srt/lora/lora.py", {"torch": __import__("torch"), "List": typing.List,
                                                  "Dict": typing.Dict})
    supported = next(ast.literal_eval(n.value) for n in ast.parse(source("srt/utils/common.py")).body
                     if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and
                                                          t.id == "SUPPORTED_LORA_TARGET_MODULES" for t in n.targets))
    return types.SimpleNamespace(LoRAConfig=config.LoRAConfig, get_layer_id=layers.get_layer_id,
                                 normalize_qkv_proj=adapter.normalize_qkv_proj,
                                 normalize_gate_up_proj=adapter.normalize_gate_up_proj, supported_targets=supported)


# -- weight sync: the wheel's code, run here ----------------------------------------------------------------------


def weight_sync(monkeypatch) -> types.SimpleNamespace:
    """SGLang's weight-sync code, run under this torch. `sglang.srt.utils` and `sglang.srt.weight_sync.tensor_bucket`
    are put in sys.modules under their own names (megarl's `serialize_bucket` imports them; pickled payloads name
    `FlattenedTensorMetadata` by its module), with empty parent packages; `monkeypatch` removes them afterwards, so
    that nothing else in this process sees a partial `sglang`."""
    try:
        import pybase64
    except ImportError:  # stand-in: the standard library's codec, same call signatures
        import base64 as pybase64

    for pkg in ("sglang", "sglang.srt", "sglang.srt.weight_sync"):
        monkeypatch.setitem(sys.modules, pkg, types.ModuleType(pkg))
    monkeypatch.setitem(sys.modules, TENSOR_BUCKET, None)  # restored (removed) by monkeypatch; set just below
    path = "srt/weight_sync/tensor_bucket.py"
    bucket = _module(TENSOR_BUCKET, source(path), f"sglang/{path}")
    names = {"MultiprocessingSerializer", "SafeUnpickler", "_safe_load_torch_storage", "_looks_like_pickle_payload",
             "normalize_serialized_named_tensor_payload", "normalize_serialized_named_tensor_payloads"}
    nodes = _defs("srt/utils/common.py", names)
    prelude = ("from __future__ import annotations\nimport binascii, io, pickle\n"
               "from multiprocessing.reduction import ForkingPickler\nfrom typing import List, Union\nimport torch\n"
               "SerializedTensorPayload = Union[str, bytes, bytearray, memoryview]\n")
    code = _pieces("srt/utils/common.py", [nodes[n] for n in names], prelude)
    monkeypatch.setitem(sys.modules, "sglang.srt.utils", None)
    utils = _module("sglang.srt.utils", code, "sglang/srt/utils/common.py", {"pybase64": pybase64})

    def get_parallel():  # stand-in: the rank under test, set by the caller through `ns.tp_rank`
        return types.SimpleNamespace(tp_rank=ns.tp_rank)

    shared = {"torch": __import__("torch"), "MultiprocessingSerializer": utils.MultiprocessingSerializer,
              "FlattenedTensorBucket": bucket.FlattenedTensorBucket,
              "FlattenedTensorMetadata": bucket.FlattenedTensorMetadata,
              "monkey_patch_torch_reductions": lambda: None, "get_parallel": get_parallel}
    worker = _module(f"{_PRIVATE}.tp_worker", _methods("srt/managers/tp_worker.py", "BaseTpWorker",
                                                      {"deserialize_own_rank"}),
                     "sglang/srt/managers/tp_worker.py", shared)
    updater = _module(f"{_PRIVATE}.weight_updater", _methods(
        "srt/model_executor/model_runner_components/weight_updater.py", "WeightUpdater",
        {"_update_weights_from_flattened_bucket", "_receive_bucketed_weights_from_distributed"}),
        "sglang/srt/model_executor/model_runner_components/weight_updater.py", shared)
    ns = types.SimpleNamespace(tp_rank=0, utils=utils, tensor_bucket=bucket,
                               deserialize_own_rank=worker.deserialize_own_rank,
                               update_from_flattened_bucket=updater._update_weights_from_flattened_bucket,
                               receive_bucket=updater._receive_bucketed_weights_from_distributed)
    return ns
