#!/usr/bin/env python
"""Convert a HuggingFace model directory into a Megatron distributed checkpoint (torch_dist) that loads at any
TP/PP layout. Streams tensor by tensor (peak memory: about one copy of the model). Output is written to a
temporary directory and renamed when complete.

  python checkpoint_tools/hf_to_megatron.py --hf-dir H --out M [--dtype bf16|fp32] [--overwrite]
  torchrun --nproc-per-node N checkpoint_tools/hf_to_megatron.py ...   (rank 0 converts; the rest join the save)
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    from megarl.checkpoint.cli import VERBOSE_HELP, quiet_vendor_logs

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="HuggingFace model directory (config.json + safetensors)")
    p.add_argument("--out", required=True, help="output Megatron checkpoint directory")
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default=None,
                   help="dtype of the stored weights (default: the HF checkpoint's dtype)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint at --out")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    args = p.parse_args(argv)
    quiet_vendor_logs(args.verbose)

    from megarl.checkpoint.atomic import check_output_dir
    from megarl.checkpoint.dist_ckpt import hf_to_megatron
    from megarl.checkpoint.hf_io import HFReader
    from megarl.platform.distributed import init_distributed

    HFReader(args.hf_dir)  # validate before starting torch.distributed
    check_output_dir(args.out, args.overwrite)
    rank, _ = init_distributed()
    t0 = time.perf_counter()
    stats = hf_to_megatron(args.hf_dir, args.out, dtype=args.dtype, overwrite=args.overwrite)
    if rank == 0:
        print(json.dumps({"out": args.out, "seconds": round(time.perf_counter() - t0, 3), **stats}))
    return 0


if __name__ == "__main__":
    from megarl.checkpoint.cli import run_tool

    sys.exit(run_tool(main))
