"""Registers and spills of the fused MXFP4 GEMM's tile configurations (finetune/models/mxfp4_grouped_gemm.py), compiled
for an H100 (sm_90) without one: Triton compiles each configuration, forward and transposed, and cuobjdump (shipped
with triton) reads the cubin's resource usage. A spill (STACK above 0) is local-memory traffic in the kernel's loop.
Another triton version may allocate otherwise (the figures in the kernel's comment are Triton 3.9's; the GPU image has
3.6), and registers say nothing of speed: mxfp4_resident_check.py --fused_gemm times the configurations on a GPU.

    pip install triton && python benchmarks/fused_gemm_registers.py            # the kernel's CONFIGS
    python benchmarks/fused_gemm_registers.py 256x64x32x8x3 128x256x64x8x3      # BLOCK_MxBLOCK_NxBLOCK_KxWARPSxSTAGES
"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIGNATURE = {"x": "*bf16", "blocks": "*u8", "scales": "*u8", "offsets": "*i32", "output": "*bf16", "rows": "i32",
             "experts": "i32", "groups": "i32", "outputs": "i32", "rows_bucket": "i32", "TRANSPOSED": "constexpr",
             "EXPERTS": "constexpr", "UPCAST_DOT": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
             "BLOCK_K": "constexpr"}


def resource_usage(block_m: int, block_n: int, block_k: int, warps: int, stages: int, transposed: bool) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from finetune.models import mxfp4_grouped_gemm

    constants = {"TRANSPOSED": transposed, "EXPERTS": mxfp4_grouped_gemm.EXPERTS_AT_LEAST, "UPCAST_DOT": False,
                 "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
    source = ASTSource(mxfp4_grouped_gemm._grouped_matmul_kernel, SIGNATURE,
                       constexprs={(list(SIGNATURE).index(name),): value for name, value in constants.items()})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
    fields = dict(re.findall(r"(REG|STACK):(\d+)", usage))
    return {"registers": int(fields["REG"]), "stack_bytes": int(fields["STACK"]), "wgmma": "wgmma" in kernel.asm["ptx"]}


def main() -> None:
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if len(sys.argv) > 1:
        configs = [tuple(int(part) for part in name.split("x")) for name in sys.argv[1:]]
    else:
        from finetune.models import mxfp4_grouped_gemm

        configs = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)
                   for c in mxfp4_grouped_gemm.CONFIGS]
    for config in configs:
        for transposed in (False, True):
            usage = resource_usage(*config, transposed)
            print("x".join(map(str, config)), "transposed" if transposed else "forward", usage, flush=True)


if __name__ == "__main__":
    main()
