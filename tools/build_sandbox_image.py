"""Build the Docker sandbox image without a registry: copy this host's Python into an image with `docker import`.

    python tools/build_sandbox_image.py [--tag megarl-sandbox:latest] [--python /usr/bin/python3.11]
                                        [--site-packages numpy,...]

The image holds the interpreter, its standard library (tests, idle, tkinter and ensurepip left out), the
packages named by `--site-packages` (default: numpy, which test programs often use; the copies of this
environment's, with their bundled libraries) in the interpreter's own site-packages, the shared libraries `ldd`
lists for the interpreter and every extension module, the dynamic loader, `/usr/bin/python3` and an /etc/passwd
with `nobody`: nothing else (no shell, no package manager). The tar stream goes straight into `docker import`;
paths are kept as on the host, with every directory world-readable so that uid 65534 can use them. A package
named but not installed here is an error; `--site-packages ""` builds without any.

Another image works too: `DockerSandbox(image=..., python=...)` needs only a `python3` (>= 3.9, with ctypes)
in it. Debian's route, slower and bigger (measured: ~99 s and 154 MB, where this tool's copy took ~6 s and 78 MB):
`debootstrap --variant=minbase --include=python3-minimal,libpython3.11-stdlib bookworm ROOT &&
tar -C ROOT -c . | docker import - TAG`.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time

DEFAULT_TAG = "megarl-sandbox:latest"
DEFAULT_PACKAGES = ("numpy",)
_SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "ensurepip", "site-packages", "dist-packages",
              "lib2to3", "__phello__", "config-3.11-x86_64-linux-gnu"}
_PASSWD = "root:x:0:0:root:/root:/nonexistent\nnobody:x:65534:65534:nobody:/nonexistent:/nonexistent\n"
_GROUP = "root:x:0:\nnogroup:x:65534:\n"


def _ldd(paths: list[str]) -> set[str]:
    libs: set[str] = set()
    for path in paths:
        out = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
        for line in out.splitlines():
            m = re.search(r"(?:=>\s*)?(/\S+)\s+\(0x", line)
            if m:
                libs.add(m.group(1))
    return libs


def collect(python: str, packages: list[str]) -> tuple[str, list[str], list[str], dict[str, str]]:
    """(the interpreter's real path, directories to copy whole, single files to copy, package directories of
    this environment -> where they go in the image: the interpreter's site-packages)."""
    real = os.path.realpath(python)
    paths = json.loads(subprocess.run([real, "-c", "import sysconfig, json; print(json.dumps(sysconfig.get_paths()))"],
                                      capture_output=True, text=True, check=True).stdout)
    stdlib = paths["stdlib"]
    dynload = os.path.join(stdlib, "lib-dynload")
    extensions = [os.path.join(dynload, f) for f in os.listdir(dynload) if f.endswith(".so")] \
        if os.path.isdir(dynload) else []
    sites = site_packages(packages, paths["purelib"])
    for src in sites:
        extensions += [os.path.join(base, f) for base, _, names in os.walk(src) for f in names if ".so" in f]
    files = sorted(lib for lib in _ldd([real] + extensions) if not any(lib.startswith(src) for src in sites))
    return real, [stdlib], files, sites


def site_packages(packages: list[str], target: str) -> dict[str, str]:
    """The directories of `packages` in this environment (the package, its `.libs` of bundled shared libraries,
    its dist-info) -> their place under `target`."""
    import importlib.metadata
    import importlib.util

    out = {}
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"--site-packages: {name!r} is not installed for {sys.executable}")
        pkg = list(spec.submodule_search_locations)[0]
        here = os.path.dirname(pkg)
        dist = importlib.metadata.distribution(name)
        extra = [os.path.join(here, f"{name}.libs"), os.path.join(here, os.path.basename(str(dist._path)))]
        for path in [pkg] + [p for p in extra if os.path.isdir(p)]:
            out[path] = os.path.join(target, os.path.basename(path))
    return out


def _entries(real_python: str, dirs: list[str], files: list[str], sites: dict[str, str]):
    yield real_python, real_python
    for f in files:
        yield f, f
    for top, dest in [(d, d) for d in dirs] + list(sites.items()):
        for base, subdirs, names in os.walk(top):
            subdirs[:] = [d for d in subdirs if d not in _SKIP_DIRS and d != "__pycache__"]
            for name in names:
                path = os.path.join(base, name)
                if not os.path.islink(path) or os.path.exists(path):
                    yield path, os.path.join(dest, os.path.relpath(path, top))


def write_tar(out, real_python: str, dirs: list[str], files: list[str], sites: dict[str, str]) -> int:
    """Write the image's root filesystem as a tar stream; returns the bytes of file content."""
    total = 0
    seen_dirs: set[str] = set()
    with tarfile.open(fileobj=out, mode="w|") as tar:
        def add_dir(path):
            parts = path.strip("/").split("/")
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d and d not in seen_dirs:
                    seen_dirs.add(d)
                    info = tarfile.TarInfo(d)
                    info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
                    tar.addfile(info)

        def add_bytes(name, data, mode=0o644):
            add_dir(os.path.dirname(name))
            info = tarfile.TarInfo(name.lstrip("/"))
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))

        for src, dst in _entries(real_python, dirs, files, sites):
            with open(src, "rb") as f:  # follows symlinks: the image gets the real content under the asked name
                data = f.read()
            add_bytes(dst, data, 0o755 if os.access(src, os.X_OK) else 0o644)
            total += len(data)
        add_bytes("/etc/passwd", _PASSWD.encode())
        add_bytes("/etc/group", _GROUP.encode())
        for d in ("/tmp", "/usr/bin", "/proc", "/dev", "/sys"):  # /tmp 1777: Docker's tmpfs copies its mode
            add_dir(d)
        link = tarfile.TarInfo("usr/bin/python3")
        link.type, link.linkname = tarfile.SYMTYPE, real_python
        tar.addfile(link)
    return total


def build(tag: str = DEFAULT_TAG, python: str | None = None, docker: str = "docker",
          packages: tuple[str, ...] = DEFAULT_PACKAGES) -> None:
    real, dirs, files, sites = collect(python or getattr(sys, "_base_executable", sys.executable), list(packages))
    start = time.time()
    proc = subprocess.Popen([docker, "import", "--change", "USER 65534:65534", "-", tag], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL)
    size = write_tar(proc.stdin, real, dirs, files, sites)
    proc.stdin.close()
    if proc.wait() != 0:
        raise SystemExit(f"docker import failed with status {proc.returncode}")
    print(f"built {tag}: {real} with {len(files)} shared libraries, packages: {', '.join(packages) or 'none'}, "
          f"{size / 1e6:.0f} MB, {time.time() - start:.1f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default=DEFAULT_TAG, help="image name to create")
    parser.add_argument("--python", default=None, help="interpreter to copy (default: the one running this)")
    parser.add_argument("--docker", default="docker", help="docker CLI to use")
    parser.add_argument("--site-packages", default=",".join(DEFAULT_PACKAGES),
                        help="packages of this environment to carry into the image, comma-separated ('' for none)")
    args = parser.parse_args(argv)
    build(args.tag, args.python, args.docker, tuple(p for p in args.site_packages.split(",") if p))


if __name__ == "__main__":
    main()
