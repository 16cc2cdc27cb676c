"""GPT-OSS-20B loaded as it ships (experts resident in MXFP4, finetune/models/mxfp4_loading.py) from a local folder on
one GPU: seconds from the start of loading (cold, then with the files in page cache) and GPU memory, beside the
dequantize-at-load path's model size. The folder is written once by benchmarks/user_path.py's writer.

    python benchmarks/mxfp4_resident_load.py --work runs/up      # one JSON line, also in $OUT/mxfp4_resident_load.json
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30


def timed_load(folder: Path) -> dict:
    import torch

    from finetune.models import mxfp4_loading

    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = mxfp4_loading.load(str(folder), torch.device("cuda"), "bfloat16")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    result = {"seconds": round(seconds, 2), "allocated_GiB": round(torch.cuda.memory_allocated() / GIB, 2),
              "peak_GiB": round(torch.cuda.max_memory_allocated() / GIB, 2)}
    del model
    torch.cuda.empty_cache()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "up")
    args = parser.parse_args()
    folder = args.work / "gpt-oss-20b"
    if not (folder / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "user_path.py"), "--write_model", "gpt-oss-20b",
                        "--work", str(args.work)], check=True)
    stored = sum(path.stat().st_size for path in folder.glob("*.safetensors"))
    subprocess.run(["sh", "-c", "sync; echo 1 > /proc/sys/vm/drop_caches"], check=False)
    result = {"folder_GiB": round(stored / GIB, 2), "first_load": timed_load(folder), "page_cache_load": timed_load(folder)}
    line = json.dumps(result)
    print(line)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "mxfp4_resident_load.json").write_text(line + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
