#!/usr/bin/env python
"""Export a megarl Megatron distributed checkpoint (any TP/PP it was saved at) to a HuggingFace directory:
safetensors shards, config.json, generation config and tokenizer files. Reads one layer at a time. Output is
written to a temporary directory and renamed when complete.

  python checkpoint_tools/megatron_to_hf.py --megatron-dir M --out H2 [--max-shard-gb 2] [--overwrite]
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    from megarl.checkpoint.cli import VERBOSE_HELP, quiet_vendor_logs

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--megatron-dir", required=True, help="Megatron checkpoint written by megarl")
    p.add_argument("--out", required=True, help="output HuggingFace directory")
    p.add_argument("--max-shard-gb", type=float, default=2.0, help="largest safetensors shard, GiB")
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint at --out")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    args = p.parse_args(argv)
    quiet_vendor_logs(args.verbose)

    from megarl.checkpoint.atomic import check_output_dir
    from megarl.checkpoint.dist_ckpt import megatron_to_hf, read_meta
    from megarl.platform.distributed import init_distributed

    read_meta(args.megatron_dir)  # validate before starting torch.distributed
    check_output_dir(args.out, args.overwrite)
    rank, _ = init_distributed()
    t0 = time.perf_counter()
    stats = megatron_to_hf(args.megatron_dir, args.out, overwrite=args.overwrite,
                           max_shard_bytes=int(args.max_shard_gb * 1024**3))
    if rank == 0:
        print(json.dumps({"out": args.out, "seconds": round(time.perf_counter() - t0, 3), **stats}))
    return 0


if __name__ == "__main__":
    from megarl.checkpoint.cli import run_tool

    sys.exit(run_tool(main))
