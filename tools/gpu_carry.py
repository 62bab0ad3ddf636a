"""What `make gpu-check` takes to a lent GPU machine, and whether it is enough and small enough.

    python tools/gpu_carry.py size [--limit-mib 64] [--carry PATH ...]     # the dry run: what is carried, sizes
    python tools/gpu_carry.py closure DIR [--python-version 3.12]          # do DIR's wheels install without network?

`size` lists the working tree as the device tool copies it (tracked files and untracked files git does not ignore)
and each carried ignored folder (default: .cache/gpu-wheels; `--optional` ones when present), with their sizes,
and exits 1 when the whole is over the limit (a lent machine takes 64 MiB) or a required folder is missing.
`closure` reads every wheel's declared dependencies (markers evaluated for CPython on x86_64 Linux) and exits 1,
naming them, when one is met neither by another wheel in DIR nor by what a CUDA torch install brings
(`FROM_TORCH`): on the GPU machine `pip install --no-index` would stop there. The size check needs only the
standard library (it runs before any environment exists); `closure` needs `packaging` (or pip's copy of it).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CARRY = (".cache/gpu-wheels",)  # the ignored paths `make gpu-check` needs (the device tool's `carry` list)
OPTIONAL = ()  # paths counted when present, never required (e.g. .cache/starter, which the check builds otherwise)
LIMIT_MIB = 64
# A CUDA torch wheel's own dependencies (torch 2.11-2.14 on PyPI): present wherever torch is installed.
FROM_TORCH = frozenset({"torch", "triton", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "setuptools",
                        "filelock", "fsspec", "typing-extensions", "cuda-bindings", "cuda-pathfinder"})
MIB = 2**20


def tree_files(root: Path) -> list[tuple[str, int]]:
    """(path, bytes) of the working tree as carried: tracked files and untracked ones git does not ignore."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True, timeout=60).stdout
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, FileNotFoundError) as e:
        raise SystemExit(f"gpu_carry: `git ls-files` failed in {root} ({e}): the dry run needs a git checkout") from e
    files = []
    for name in sorted(set(out.decode().split("\0")) - {""}):
        path = root / name
        if path.is_file() and not path.is_symlink():  # a tracked file deleted in the tree is not carried
            files.append((name, path.stat().st_size))
    return files


def folder_files(root: Path, folder: str) -> list[tuple[str, int]] | None:
    """(path, bytes) of every file under `folder` (None when it does not exist)."""
    base = root / folder
    if not base.exists():
        return None
    paths = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
    return [(str(p.relative_to(root)), p.stat().st_size) for p in paths]


def carry_report(tree: list[tuple[str, int]], carried: dict[str, list[tuple[str, int]] | None],
                 limit_mib: float = LIMIT_MIB, largest: int = 5,
                 optional: tuple[str, ...] = ()) -> tuple[list[str], bool]:
    """The dry run's lines and whether the carry fits: the tree (its `largest` files named), each carried folder,
    the total against `limit_mib`. A missing folder fails too (the check needs it on the other side), unless it is
    one of `optional`."""
    lines, ok = [], True
    total = sum(size for _, size in tree)
    lines.append(f"  working tree          {len(tree):6d} files {sum(s for _, s in tree) / MIB:8.2f} MiB")
    for name, size in sorted(tree, key=lambda f: -f[1])[:largest]:
        lines.append(f"      {size / MIB:8.2f} MiB  {name}")
    for folder, files in carried.items():
        if files is None and folder in optional:
            lines.append(f"  {folder:<21} absent (optional: leave it out of the carry list)")
            continue
        if files is None:
            lines.append(f"  {folder:<21} missing (`make gpu-wheels` fetches it)")
            ok = False
            continue
        size = sum(s for _, s in files)
        total += size
        lines.append(f"  {folder:<21} {len(files):6d} files {size / MIB:8.2f} MiB")
    limit = limit_mib * MIB
    verdict = "fits" if total <= limit else f"over by {(total - limit) / MIB:.2f} MiB"
    lines.append(f"  total                              {total / MIB:8.2f} MiB of {limit_mib:g} MiB: {verdict}")
    return lines, ok and total <= limit


def _wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(normalized name, version, Requires-Dist lines) of a wheel."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        text = z.read(meta).decode("utf-8", "replace").split("\n\n")[0]  # the headers, not the description
    fields = [line.split(":", 1) for line in text.splitlines() if ":" in line and not line.startswith(" ")]
    get = lambda key: [v.strip() for k, v in fields if k == key]
    return normalize(get("Name")[0]), get("Version")[0], get("Requires-Dist")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def unmet_requirements(wheels: list[Path], python_version: str = "3.12",
                       assumed: frozenset[str] = FROM_TORCH) -> list[str]:
    """Each declared dependency (no extras; markers for CPython on x86_64 Linux at `python_version`) that no wheel
    in `wheels` satisfies (name and version) and `assumed` does not hold, as `wheel: requirement (why)`."""
    try:
        from packaging.requirements import Requirement
        from packaging.version import Version
    except ImportError:  # pip's own copy, wherever pip is
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.version import Version

    env = {"python_version": python_version, "python_full_version": python_version + ".0",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix", "extra": ""}
    have = {}
    metas = []
    for path in wheels:
        name, version, requires = _wheel_metadata(path)
        have[name] = Version(version)
        metas.append((path.name, requires))
    unmet = []
    for wheel, requires in metas:
        for line in requires:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            name = normalize(req.name)
            if name in assumed:
                continue
            if name not in have:
                unmet.append(f"{wheel}: {line} (no wheel)")
            elif req.specifier and not req.specifier.contains(have[name], prereleases=True):
                unmet.append(f"{wheel}: {line} (the wheel is {have[name]})")
    return unmet


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    size = sub.add_parser("size", help="list what is carried, with sizes; exit 1 over the limit")
    size.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    size.add_argument("--carry", nargs="*", default=list(CARRY), help="ignored paths carried beside the tree")
    size.add_argument("--optional", nargs="*", default=list(OPTIONAL), help="ignored paths carried when present")
    size.add_argument("--root", type=Path, default=REPO)
    closure = sub.add_parser("closure", help="exit 1 when a wheel's dependency is in neither DIR nor torch's set")
    closure.add_argument("dir", type=Path)
    closure.add_argument("--python-version", default="3.12")
    args = p.parse_args(argv)
    if args.command == "size":
        carried = {folder: folder_files(args.root, folder) for folder in (*args.carry, *args.optional)}
        lines, ok = carry_report(tree_files(args.root), carried, args.limit_mib, optional=tuple(args.optional))
        print("gpu-check carry (the device tool's working tree + carry list):")
        print("\n".join(lines))
        if not ok:
            print(f"gpu-check carry: FAIL: a carried folder is missing or the whole is over {args.limit_mib:g} MiB")
        return 0 if ok else 1
    wheels = sorted(args.dir.glob("*.whl"))
    if not wheels:
        print(f"gpu_carry closure: no wheels in {args.dir} (`make gpu-wheels` fetches them)")
        return 1
    unmet = unmet_requirements(wheels, args.python_version)
    for line in unmet:
        print(f"unmet: {line}")
    print(f"gpu_carry closure: {len(wheels)} wheels, " + (f"{len(unmet)} unmet dependencies" if unmet else
                                                          "every dependency met (torch's own assumed present)"))
    return 1 if unmet else 0


if __name__ == "__main__":
    sys.exit(main())
