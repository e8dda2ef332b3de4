#!/usr/bin/env python
"""Logit parity between transformers and megarl's Megatron model at a TP/PP layout.

Runs one fixed token batch through transformers (fp32, eager attention) and through the Megatron model built at
--tp/--pp/--ep/--etp (--ep: expert parallelism of a mixture-of-experts model; --etp: its expert tensor parallelism,
default --tp; on the fewest data-parallel replicas megatron-core's expert grid allows), with
weights from --megatron-dir (a megarl Megatron checkpoint) or, without it, loaded straight from --hf-dir.
Starts the layout's local ranks itself when not under torchrun (tp*pp*ep when --etp is --tp; e.g. 2 for --tp 2
--ep 2 --etp 1; a layout of one rank runs in the tool's own process).

The verdict: rounding alone moves logits by an amount that depends on the model (depth, logit size, vocabulary),
so the tolerance is derived from the model's own noise floor, the max and mean |logit diff| between transformers'
forward at --dtype and one precision up (fp32 vs fp64; bf16 vs fp32) on the same batch. It passes when the max
and the mean |diff| are each within --noise-multiple (default 4) times that floor; a layout bug (a swapped head, a
missing bias) is thousands of floors away in fp32, while in bf16 only gross errors stand out: check conversions
in fp32. --atol X judges max |diff| <= X instead and skips the floor's forward (which holds the model at 8 bytes
per parameter in fp64 on rank 0). Prints JSON: max_abs_logit_diff, mean_abs_logit_diff, argmax_agreement,
logit_scale, noise_floor_max/mean, noise_floor_routing_flips (MoE: the (token, layer) pairs the floor's two
forwards route to different experts; an fp32 floor with any is no rounding floor and the check does not pass:
rerun with another --seed, or use --atol), tolerance (on the max), tolerance_mean, tolerance_rule, the diffs over
the floor, the layout and passed. Exit status 0 passed, 1 failed, 2 bad input.

  python checkpoint_tools/verify.py --hf-dir H [--megatron-dir M] --tp 2 --pp 2 [--json out.json]
  python checkpoint_tools/verify.py --hf-dir H_MOE --tp 2 --ep 2
  python checkpoint_tools/verify.py --hf-dir H_MOE --tp 2 --ep 2 --etp 1
  python checkpoint_tools/verify.py --hf-dir H4LAYERS --pp 2 --vpp 2
  torchrun --nproc-per-node 4 checkpoint_tools/verify.py --hf-dir H --megatron-dir M --tp 2 --pp 2
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    from megarl.checkpoint.cli import VERBOSE_HELP, quiet_vendor_logs

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="HuggingFace model directory (the reference)")
    p.add_argument("--megatron-dir", default=None, help="Megatron checkpoint to check (default: load --hf-dir)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size (MoE models; carved out of data parallelism: tp*pp*ep ranks)")
    p.add_argument("--etp", type=int, default=None,
                   help="expert tensor-parallel size (MoE models; default --tp; etp*ep must divide tp*dp)")
    p.add_argument("--vpp", type=int, default=1,
                   help="virtual pipeline chunks per stage (megatron's interleaved schedule; needs --pp > 1)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="Megatron model dtype")
    p.add_argument("--atol", "--tolerance", dest="atol", type=float, default=None,
                   help="judge max |logit diff| <= ATOL instead of the noise-floor rule (no floor forward)")
    p.add_argument("--noise-multiple", type=float, default=None,
                   help="how many noise floors the max and the mean |logit diff| may each reach (default 4)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the result to this file")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    args = p.parse_args(argv)
    quiet_vendor_logs(args.verbose)

    from megarl.checkpoint.verify import verify

    result = verify(args.hf_dir, args.megatron_dir, args.tp, args.pp, args.dtype, args.atol,
                    args.batch, args.seq_len, args.seed, ep=args.ep, etp=args.etp, vpp=args.vpp,
                    multiple=args.noise_multiple)  # None: megarl.checkpoint.verify.NOISE_MULTIPLE
    if result is None:  # torchrun ranks other than 0
        return 0
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    from megarl.checkpoint.cli import run_tool

    sys.exit(run_tool(main))
