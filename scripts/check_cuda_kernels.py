#!/usr/bin/env python3
"""Compile the engine's CUDA kernel source with NVRTC on a machine without a GPU (compiling needs none).

``mx.fast.cuda_kernel`` compiles its source only when a GPU first runs it, so a typo costs a device session.
This wraps ``runner/gpu_attention``'s source the way MLX 0.32's CUDA backend does (its template values as
``constexpr`` / ``using`` lines, each input as a typed pointer plus ``<name>_shape`` where the source reads it,
in ``namespace mlx::core::cu``) and compiles every variant the engine can ask for: with and without the shared
prefix, float32 / float16 / bfloat16 pools and outputs, head sizes 32-256.

Needs NVRTC and the CUDA headers (``pip download nvidia-cuda-nvrtc nvidia-cuda-runtime``, unzip both) and the
CCCL headers MLX's CUDA wheel ships (``mlx/include/cccl`` inside ``mlx-cuda-13``):

    python scripts/check_cuda_kernels.py --nvrtc DIR/nvidia/cu13/lib/libnvrtc.so.13 \\
        --include DIR/nvidia/cu13/include --include WHEEL/mlx/include/cccl
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from parallm_engine.runner import gpu_attention as g  # noqa: E402

TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}


def wrap(shared: bool, T: str, TO: str, D: int, R: int, KH: int) -> str:
    ins = [("q", T), ("kpool", T), ("vpool", T), ("table", "int32_t"), ("starts", "int32_t")]
    if shared:
        ins += [("sk", T), ("sv", T), ("sflag", "bool")]
    src = g._source(shared)
    params = []
    for name, typ in ins:
        params.append(f"const {typ}* {name}")
        if f"{name}_shape" in src:
            params.append(f"const __grid_constant__ Shape {name}_shape")
    params += [f"{TO}* out", "float* lse"]
    consts = "".join(f"  constexpr int {k} = {v};\n" for k, v in
                     (("D", D), ("R", R), ("KH", KH), ("NW", g.WARPS), ("QSCALE", g._float_bits(D ** -0.5 * g.LOG2E))))
    return ("#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cuda/std/array>\n"
            "namespace mlx::core::cu {\nusing Shape = cuda::std::array<int32_t, 8>;\n"
            f"__global__ void kernel({', '.join(params)}) {{\n{consts}  using T = {T};\n  using TO = {TO};\n{src}\n}}\n}}\n")


def compile_source(lib, code: str, includes: list[str], arch: str) -> tuple[int, str]:
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), b"kernel.cu", 0, None, None) != 0:
        return 1, "nvrtcCreateProgram failed"
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"] + [f"-I{i}".encode() for i in includes]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nvrtc", required=True, help="path to libnvrtc.so")
    ap.add_argument("--include", action="append", default=[], help="header directory (repeat)")
    ap.add_argument("--arch", default="compute_90")
    args = ap.parse_args()
    lib = ctypes.CDLL(args.nvrtc)
    failed = 0
    variants = list(itertools.product([False, True], TYPES.values(), TYPES.values(),
                                      [(32, 1, 4), (64, 3, 3), (128, 4, 8), (256, 2, 4)]))
    for shared, T, TO, (D, R, KH) in variants:
        rc, log = compile_source(lib, wrap(shared, T, TO, D, R, KH), args.include, args.arch)
        if rc != 0:
            failed += 1
            print(f"FAILED shared={shared} T={T} TO={TO} D={D} R={R}:\n{log[:3000]}")
    print(f"{len(variants) - failed} of {len(variants)} variants compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
