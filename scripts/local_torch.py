"""Whether setup should take torch from a local wheel directory instead of uv.lock's PyPI build.

    python3 scripts/local_torch.py uv.lock WHEEL_DIR

uv.lock pins torch as PyPI publishes it: on Linux x86_64 that is the CUDA build, several GB with
its CUDA libraries. Where pip is configured with a local wheel directory holding a build of the
*same* torch version for this Python (a CPU build, as on this project's CPU machines), setup
installs everything else exactly as locked and that wheel in torch's place. This prints the
packages setup must then leave out (torch, and the CUDA libraries only torch's CUDA build needs:
triton stays where another package requires it too, as the Torchtitan extra does), one line, or
nothing when the directory has no such wheel (setup installs the lock as it is).
Reads only uv.lock and the directory; prints nothing on any doubt.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path


def cuda_only(packages: dict[str, dict]) -> set[str]:  # type: ignore[type-arg]
    """Packages reachable from torch only through its CUDA dependencies: the nvidia/cuda
    libraries always (a CPU build of torch cannot use them), the rest (triton, what they
    require) unless a package other than torch requires them too."""

    def deps(name: str) -> list[str]:
        package = packages.get(name, {})
        names = [d["name"] for d in package.get("dependencies", [])]
        for extra in package.get("optional-dependencies", {}).values():
            names += [d["name"] for d in extra]
        return names

    def is_cuda(name: str) -> bool:
        return name.startswith(("nvidia-", "cuda-")) or name == "triton"

    todo = [d for d in deps("torch") if is_cuda(d)]
    closure: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in closure:
            closure.add(name)
            todo += deps(name)
    elsewhere = {d for n in packages if n not in closure and n != "torch" for d in deps(n)}
    return {n for n in closure if n.startswith(("nvidia-", "cuda-")) or n not in elsewhere}


def main() -> None:
    lock_path, wheel_dir = Path(sys.argv[1]), Path(sys.argv[2])
    if not lock_path.is_file() or not wheel_dir.is_dir():
        return
    packages = {p["name"]: p for p in tomllib.loads(lock_path.read_text())["package"]}
    version = packages.get("torch", {}).get("version")
    if not version:
        return
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    pattern = re.compile(rf"torch-{re.escape(version)}(\+[a-z0-9.]+)?-{tag}-{tag}-\S+\.whl$")
    if not any(pattern.match(p.name) for p in wheel_dir.iterdir()):
        return
    print(" ".join(["torch", *sorted(cuda_only(packages))]))


if __name__ == "__main__":
    main()
