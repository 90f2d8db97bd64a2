"""One line naming the Python and the packages an accelerator session measured with (the session scripts,
benchmarks/gpu_session.sh and benchmarks/tpu_session.sh, print it first; BENCHMARKS.md records it).

    python -m benchmarks.versions jax jaxlib flax ...
"""

from __future__ import annotations

import platform
import sys
from importlib import metadata


def version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def main(names: list[str]) -> int:
    print("python", platform.python_version(), "|", ", ".join(f"{name} {version(name)}" for name in names))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
