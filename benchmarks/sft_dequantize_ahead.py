"""scripts/sft.py with GPT-OSS's resident experts' next chunk dequantized ahead, on a second CUDA stream while this
chunk's grouped GEMM runs, beside the recomputed projections kept for the input gradients as shipped: the variant of
`mxfp4_experts.DequantizePrefetch` that benchmarks/user_path.py's case gptoss20b_resident_ckpt_ahead times against
the shipped one, through the same `accelerate launch`.

    accelerate launch benchmarks/sft_dequantize_ahead.py --config recipes/... [sft.py arguments]
"""

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from finetune.models import mxfp4_experts  # noqa: E402 (the project's root is on the path first)

mxfp4_experts.PREFETCH = mxfp4_experts.DequantizePrefetch(ahead=True)
sys.argv[0] = str(ROOT / "scripts" / "sft.py")
runpy.run_path(sys.argv[0], run_name="__main__")
