"""The direction of dependencies, checked mechanically: megatron-core only under megarl/mcore/, no torch in the
verifiers, the sandbox or megarl-verify, and an entrypoint that holds no algorithm or backend names."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from helpers import REPO, env

PACKAGE = REPO / "megarl"


def _imports(path: Path) -> set[str]:
    """Top-level package names a module imports, anywhere in it (functions included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def _modules(under: Path) -> list[Path]:
    return sorted(under.rglob("*.py"))


def test_only_megarl_mcore_imports_megatron():
    outside = [p for p in _modules(PACKAGE) if PACKAGE / "mcore" not in p.parents]
    assert len(outside) > 30, "the scan must see the package"
    offenders = [str(p.relative_to(REPO)) for p in outside if "megatron" in _imports(p)]
    assert offenders == []


def test_verifiers_and_sandbox_import_no_torch():
    light = _modules(PACKAGE / "verifiers") + _modules(PACKAGE / "sandbox") + _modules(PACKAGE / "tools")
    assert [str(p.relative_to(REPO)) for p in light if _imports(p) & {"torch", "megatron"}] == []
    # and not through anything they import: load every one of them, and megarl-verify, in a fresh interpreter
    names = [".".join(p.relative_to(REPO).with_suffix("").parts) for p in light if p.name != "__init__.py"]
    code = (f"import importlib, sys\nfor n in {names + ['megarl.cli.verify', 'megarl.reward', 'megarl.samples']!r}:\n"
            "    importlib.import_module(n)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def _registered_names() -> set[str]:
    from megarl.algorithms import advantage_names, kl_names, policy_loss_names
    from megarl.rollout import rollout_names
    from megarl.rollout.backends import backend_names

    return set(advantage_names() + policy_loss_names() + kl_names() + backend_names() + rollout_names())


def _code_words(path: Path) -> set[str]:
    """Identifiers and the words of string constants in a module's code (its docstring and comments aside), and
    their underscore-separated parts, lower-cased."""
    tree = ast.parse(path.read_text())
    docstring = ast.get_docstring(tree, clean=False)
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.arg)):
            words.add(node.name if isinstance(node, ast.FunctionDef) else node.arg)
        elif isinstance(node, ast.alias):
            words |= set((node.asname or node.name).split("."))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value != docstring:
            words |= set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", node.value))
    return words | {part.lower() for w in words for part in w.split("_")}


def test_train_py_holds_no_algorithm_or_backend_names():
    source = (PACKAGE / "train.py").read_text()
    words = _code_words(PACKAGE / "train.py")
    assert {"enter_rollout", "collect", "update", "sync"} <= words, "the scan must see the loop"
    names = _registered_names()
    assert {"grpo", "gae", "clip", "sglang", "builtin", "megatron", "single_turn"} <= names
    # Names a step could branch on: every registered algorithm and backend, and PPO's fourth model.
    assert sorted(words & (names | {"critic", "ppo", "reference"})) == []
    assert len(source.splitlines()) <= 150


def test_recipes_parse_without_torch_for_the_launch_scripts_check():
    """launch/render.py's pre-launch check runs on the batch host's python, which may have no torch."""
    code = ("import sys\nsys.modules['torch'] = None  # any import of torch now fails\n"
            "from megarl.config import parse_args\n"
            "cfg = parse_args(['recipes/r1_code.sh', '--plugins', 'no_such_module'], check_registries=False)\n"
            "print(cfg.rollout.rollout_backend, cfg.sandbox.sandbox)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["sglang", "local"]


def test_no_sys_path_edits_outside_the_tests_conftest():
    """megarl is installed (`make venv`: pip install -e .) and a script's own directory is already first on sys.path,
    so nothing under megarl/, tools/ or launch/ assigns, inserts into, appends to, extends, slices or removes from
    sys.path; tests/conftest.py is the one place that puts the checkout there. Reading sys.path is fine."""

    def is_sys_path(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys")

    def edits(tree) -> list[tuple[int, str]]:
        """(line, enclosing function) of every edit of sys.path in a module."""
        found, scopes = [], {}
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(fn):
                    scopes.setdefault(id(inner), fn.name)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.Delete)):
                targets = node.targets if isinstance(node, ast.Delete) else [node.target]
            edited = any(is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value)) for t in targets)
            edited |= (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                       and is_sys_path(node.func.value)
                       and node.func.attr in ("insert", "append", "extend", "remove", "pop", "clear"))
            if edited:
                found.append((node.lineno, scopes.get(id(node), "<module>")))
        return found

    # `--plugins path/to/x.py` asks for that file's directory on sys.path (its siblings import as the user expects,
    # and worker processes find it too): the one edit the user requests by name.
    allowed = {("megarl/registry.py", "load_plugins")}
    files = [p for top in ("megarl", "tools", "launch") for p in sorted((REPO / top).rglob("*.py"))]
    assert len(files) > 100, "the scan must see the code"
    seen, offenders = set(), []
    for path in files:
        rel = str(path.relative_to(REPO))
        for line, scope in edits(ast.parse(path.read_text())):
            if (rel, scope) in allowed and (rel, scope) not in seen:
                seen.add((rel, scope))
            else:
                offenders.append(f"{rel}:{line}")
    assert seen == allowed, "the plugin loader's edit must be seen (the scan is blind otherwise)"
    assert offenders == []
