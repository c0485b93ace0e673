"""``python -m parallm_engine.native [--force]``: build the native CPU kernels now (scripts/setup)."""

import sys

from . import NativeBuildError, build, supported_platform

if __name__ == "__main__":
    if not supported_platform():
        print("native kernels: not built on this platform (the pure-MLX kernels are used)")
        sys.exit(0)
    try:
        print(f"native kernels: {build(force='--force' in sys.argv)}")
    except NativeBuildError as e:
        print(f"native kernels: not built ({e}); the engine uses its pure-MLX kernels")
