"""The `megarl` command line.

    megarl train CONFIG [key=value ...] [--dry-run] [--verbose]
    megarl export CHECKPOINT_STEP_DIR --out HF_DIR [--overwrite]
    megarl quickstart [--out DIR]
    megarl plot RUN_DIR
    megarl serve MODEL_DIR [--host 127.0.0.1] [--port 0] [--api-key TOKEN] [...]   (docs/serve.md)
    megarl --version

The config is loaded and validated before anything else happens: a bad config prints one `megarl: error: ...`
line and exits with status 2 before any process or Ray cluster starts.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from typing import Optional, Sequence

import megarl
from megarl.config import ConfigError, JobConfig, dump_yaml, load_config
from megarl.config.memory import (
    check_fits,
    device_memory_bytes,
    job_memory_estimate,
    judge_pool_memory,
    rollout_pool_memory,
    teacher_pool_memory,
)
from megarl.config.placement import device_kind, format_table, placement
from megarl.config.validate import role_archs, teacher_arch
from megarl.rewards.scoring import RewardError
from megarl.trainer.faults import RunAborted

EXIT_OK = 0
EXIT_USAGE = 2  # bad config / usage, as argparse uses
EXIT_ABORTED = 1  # the trainer stopped the run (reward failures, non-finite steps): megarl.trainer.faults
SERVE_DEFAULT_MAX_MODEL_LEN = 2048  # `megarl serve`'s context when the model allows more

_TRAIN_HELP = """\
Run RL training from a YAML job config.

Overrides are dotted key=value pairs applied on top of the file, coerced to the field's type:
  actor.parallel.tp=2  algorithm.kl.coef=0.001  rollout.stop='["</answer>"]'  data.shuffle=false
  checkpoint.dir=null  resources.pools.default.devices_per_node=8
Every option is listed in docs/config.md.

--dry-run validates the config, prints the resolved config (YAML), a per-GPU memory estimate (refusing a layout
that exceeds the GPU's memory when CUDA is present or resources.device_memory_gb is set) and the placement table
(role, global rank, node, device, tp/pp/dp/cp coordinates, pipeline-stage layer range), and exits without
starting anything.

--verbose lets vLLM's, Ray's, megatron-core's, torch's and transformers' own logs and warnings through (the same as
logging.vendor_level=info); without it only their errors are shown.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megarl",
        description="megarl: Megatron-centric RL post-training for LLMs (actor/critic/reference/reward roles with "
        "their own TP/PP/DP, one Ray controller, in-place reshard into vLLM).",
    )
    parser.add_argument("--version", action="version", version=f"megarl {megarl.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    train = sub.add_parser(
        "train",
        help="train a policy from a YAML config (see `megarl train --help`)",
        description=_TRAIN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("config", metavar="CONFIG", help="YAML job config, e.g. yaml_configs/cpu_quickstart.yaml")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides applied on top of CONFIG")
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="validate, print the resolved config and the rank placement table, and exit 0",
    )
    train.add_argument("--verbose", action="store_true",
                       help="show the vendors' own logs and warnings (logging.vendor_level=info)")
    export = sub.add_parser(
        "export",
        help="write a checkpoint's actor as a HuggingFace model (see `megarl export --help`)",
        description="Write the actor of a trainer checkpoint (any step, any TP/PP/DP layout it was saved at) as a "
        "HuggingFace model directory: safetensors, config.json, generation config, tokenizer files.",
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT_STEP_DIR",
                        help="<checkpoint.dir>/step_NNNNNN, or a role's Megatron checkpoint directory")
    export.add_argument("--out", required=True, metavar="HF_DIR", help="output directory (must be empty or absent)")
    export.add_argument("--overwrite", action="store_true", help="replace an existing model at --out")
    export.add_argument("--max-shard-gb", type=float, default=2.0, help="largest safetensors file, GiB")
    export.add_argument("--lora", action="store_true",
                        help="the checkpoint's LoRA adapters (actor.lora) as a PEFT adapter directory "
                        "(adapter_config.json + adapter_model.safetensors) for the HF base model")
    quickstart = sub.add_parser(
        "quickstart",
        help="SFT then GRPO teach a small model two-digit addition; held-out accuracy in OUT/summary.json",
        description="Build a two-digit addition task, a character tokenizer and a small random Llama, warm it up "
        "with SFT on the Megatron actor, then run GRPO through the full stack (Ray, Megatron, reshard, vLLM); "
        "writes summary.json, samples.md, metrics.jsonl and the HF export (hf/) under --out.",
    )
    from megarl.trainer.quickstart import add_arguments as quickstart_arguments  # stdlib-only at import

    quickstart_arguments(quickstart)
    serve = sub.add_parser(
        "serve",
        help="an OpenAI-compatible endpoint over a model (see docs/serve.md)",
        description="Serve an HF model directory (or a megarl checkpoint step directory, exported first) on a vLLM "
        "engine behind megarl's request-level engine server: POST /v1/chat/completions, /v1/completions, GET "
        "/v1/models, /health. Prints the base URL for the openai client. Binds 127.0.0.1 on a free port by default; "
        "another host needs --api-key.",
    )
    serve.add_argument("model", metavar="MODEL_DIR", help="HF model directory (its tokenizer's chat template serves "
                       "/v1/chat/completions; without one only /v1/completions answers), or "
                       "<checkpoint.dir>/step_NNNNNN")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (non-loopback needs --api-key)")
    serve.add_argument("--port", type=int, default=0, help="port (0: a free one, printed)")
    serve.add_argument("--api-key", default=None, help="bearer token every /v1 request must send")
    serve.add_argument("--served-model-name", default=None, help="model id in /v1/models (default: MODEL_DIR's name)")
    serve.add_argument("--tool-parser", default="hermes", help="tool-call parser (rollout.tool_parser's names)")
    serve.add_argument("--max-model-len", type=int, default=None, help="context: prompt + completion tokens "
                       f"(default: the model's max_position_embeddings, at most {SERVE_DEFAULT_MAX_MODEL_LEN})")
    serve.add_argument("--max-tokens", type=int, default=None, help="most completion tokens a request may ask for")
    serve.add_argument("--max-n", type=int, default=8, help="most choices per request (n)")
    serve.add_argument("--max-in-flight", type=int, default=64, help="requests held at once; more get 429")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (413 past it)")
    serve.add_argument("--request-timeout-s", type=float, default=600.0, help="bound of one request (504 past it)")
    serve.add_argument("--dtype", default="auto", help="engine dtype (auto: the one the checkpoint's config.json "
                       "names; vLLM's own auto would downcast float32 to bfloat16)")
    serve.add_argument("--kv-cache-gib", type=float, default=1.0, help="CPU KV-cache size, GiB")
    plot = sub.add_parser(
        "plot",
        help="PNG plots and a summary table of a run directory's metrics.jsonl",
        description="Write RUN_DIR/plots/*.png (reward, validation, KL, entropy, response length, clip fraction, "
        "time per phase) from RUN_DIR/metrics.jsonl and print the run's summary table. Needs matplotlib "
        "(pip install 'megarl[plots]').",
    )
    plot.add_argument("run_dir", metavar="RUN_DIR", help="a run's logging.dir (holds metrics.jsonl)")
    return parser


def dry_run_report(cfg: JobConfig) -> str:
    """The resolved config as YAML, the per-GPU memory estimate, the actor's rank order with the reshard bytes it
    implies (and the natural order's), then the placement table.

    Raises ConfigError when the device memory is known (`resources.device_memory_gb`, or CUDA present) and the
    estimate exceeds it."""
    layers = {role: arch.num_layers for role, arch in role_archs(cfg).items()}
    layers.update({f"teacher/{name}": teacher_arch(t.path, f"distillation.teachers.{name}").num_layers
                   for name, t in cfg.distillation.teachers.items() if t.enabled})
    kind = device_kind(cfg)
    from megarl.reshard.rank_order import actor_order_report
    from megarl.trainer.schedule import describe_schedule

    actor_topo, order = actor_order_report(cfg)
    order_title = "actor rank order and reshard bytes (megarl/reshard/rank_order.py)"
    if cfg.rollout.pool is not None:  # the engines on a pool of their own: the sync over the bridge instead
        from megarl.reshard.pool_plan import pool_sync_lines

        order_title = f"rollout pool {cfg.rollout.pool!r} and the weight sync (megarl/reshard/pool_plan.py)"
        order = "\n".join(pool_sync_lines(cfg))
    rows = placement(cfg, layers, kind, {"actor": actor_topo})
    memory = job_memory_estimate(cfg, device_memory_bytes(cfg))
    check_fits(memory)
    return (
        "# resolved config\n"
        + dump_yaml(cfg)
        + "\n# memory per GPU of the actor's pool (static estimate, megarl/config/memory.py)\n"
        + memory.describe()
        + rollout_pool_memory(cfg, memory)
        + judge_pool_memory(cfg, memory.device_bytes)
        + teacher_pool_memory(cfg, memory)
        + f"\n\n# {order_title}\n"
        + order
        + "\n\n# schedule (trainer.mode, docs/async.md)\n"
        + describe_schedule(cfg)
        + "\n\n# placement (rollout rows: tp = engine TP rank, dp = engine index)\n"
        + format_table(rows, layers)
        + "\n"
    )


def _train(args: argparse.Namespace) -> int:
    overrides = list(args.overrides) + (["logging.vendor_level=info"] if args.verbose else [])
    cfg = load_config(args.config, overrides)
    if args.dry_run:
        sys.stdout.write(dry_run_report(cfg))
        return EXIT_OK
    from megarl.api import RLTrainer  # lazy: pulls in the controller (torch, megatron-core, ray on start)

    keep = [o for o in overrides if not o.startswith("checkpoint.resume=")]
    with RLTrainer(cfg, resume_command=shlex.join(["megarl", "train", args.config, *keep,
                                                   "checkpoint.resume=true"])) as trainer:
        trainer.fit()
    return EXIT_OK


def _plot(args: argparse.Namespace) -> int:
    from megarl.trainer.plots import PlotsUnavailable, plot_run, read_metrics, summary_table

    rows = read_metrics(args.run_dir)
    if not rows:
        print(f"megarl: error: {args.run_dir}: no metrics.jsonl with any step (is it a megarl run directory?)",
              file=sys.stderr)
        return EXIT_USAGE
    print(summary_table(rows))
    try:
        paths = plot_run(args.run_dir)
    except PlotsUnavailable as e:
        print(f"megarl: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print("\n".join(paths))
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    import json

    from megarl.checkpoint.errors import CheckpointError
    from megarl.checkpoint.export import export_hf, export_lora  # lazy: torch, megatron-core

    try:
        if args.lora:
            stats = export_lora(args.checkpoint, args.out, overwrite=args.overwrite)
        else:
            stats = export_hf(args.checkpoint, args.out, overwrite=args.overwrite, max_shard_gb=args.max_shard_gb)
    except CheckpointError as e:
        print(f"megarl: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(stats))
    return EXIT_OK


def serve_context_len(model_dir: str, requested: Optional[int]) -> int:
    """The engine context of `megarl serve` for HF directory `model_dir`: `requested` (--max-model-len) or, when None,
    the model's `max_position_embeddings` capped at SERVE_DEFAULT_MAX_MODEL_LEN. Raises ValueError for a request
    beyond the model's positions (the engine would refuse it later, less clearly)."""
    import json
    import os

    with open(os.path.join(model_dir, "config.json")) as f:
        positions = json.load(f).get("max_position_embeddings")
    if requested is None:
        return min(SERVE_DEFAULT_MAX_MODEL_LEN, positions or SERVE_DEFAULT_MAX_MODEL_LEN)
    if positions is not None and requested > positions:
        raise ValueError(f"--max-model-len {requested} is over the model's max_position_embeddings ({positions}, "
                         f"{model_dir}/config.json); pass --max-model-len {positions} or less, or leave it out")
    return requested


def _serve(args: argparse.Namespace) -> int:
    import os
    import tempfile

    from megarl.serving.openai_api import ServedModel, check_bind, serve_forever
    from megarl.serving.openai_protocol import ServeLimits

    def limits_for(model_dir: str) -> ServeLimits:
        return ServeLimits(max_model_len=serve_context_len(model_dir, args.max_model_len), max_n=args.max_n,
                           max_tokens=args.max_tokens, max_in_flight=args.max_in_flight,
                           max_body_bytes=args.max_body_bytes, request_timeout_s=args.request_timeout_s)

    try:
        check_bind(args.host, args.api_key)
        ServeLimits(max_model_len=args.max_model_len or 1, max_n=args.max_n, max_tokens=args.max_tokens,
                    max_in_flight=args.max_in_flight, max_body_bytes=args.max_body_bytes,
                    request_timeout_s=args.request_timeout_s)  # the flags, checked before any export
    except ValueError as e:
        print(f"megarl: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    with tempfile.TemporaryDirectory(prefix="megarl-serve-") as scratch:
        model_dir = args.model
        if not os.path.isfile(os.path.join(model_dir, "config.json")):  # a checkpoint: export its actor first
            from megarl.checkpoint.errors import CheckpointError
            from megarl.checkpoint.export import export_hf

            try:
                model_dir = export_hf(args.model, os.path.join(scratch, "hf"))["out"]
            except CheckpointError as e:
                print(f"megarl: error: {args.model} is neither a HuggingFace model directory (no config.json) nor "
                      f"a checkpoint: {e}", file=sys.stderr)
                return EXIT_USAGE
        try:
            served = ServedModel(model_dir, limits=limits_for(model_dir), model_name=args.served_model_name,
                                 tool_parser=args.tool_parser, api_key=args.api_key, dtype=args.dtype,
                                 kv_cache_gib=args.kv_cache_gib)
        except (ValueError, KeyError) as e:
            print(f"megarl: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        try:
            serve_forever(served, args.host, args.port, api_key=args.api_key,
                          announce=lambda url: print(f"megarl serve: {url}", flush=True))
        finally:
            served.close()
    return EXIT_OK


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the `megarl` console script and `python -m megarl`; returns the exit status."""
    parser = build_parser()
    try:
        # overrides may come after --dry-run, which argparse's nargs="*" positional would not accept alone
        args, extra = parser.parse_known_args(argv)
        if extra:
            if args.command != "train" or any(x.startswith("-") for x in extra):
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            args.overrides = list(args.overrides) + extra
    except SystemExit as e:  # --help, --version and usage errors
        return int(e.code or 0)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "export":
            return _export(args)
        if args.command == "quickstart":
            from megarl.trainer.quickstart import run_from_args

            run_from_args(args)
            return EXIT_OK
        if args.command == "plot":
            return _plot(args)
        if args.command == "serve":
            return _serve(args)
    except ConfigError as e:
        print(f"megarl: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (RewardError, RunAborted) as e:  # the run stopped on purpose: one line, no traceback
        print(f"megarl: error: {e}", file=sys.stderr)
        return EXIT_ABORTED
    except KeyboardInterrupt as e:  # a signal that stops the run at once (megarl.trainer.stop), or Ctrl-C earlier
        print(f"megarl: error: {str(e) or 'interrupted'}", file=sys.stderr)
        return int(getattr(e, "exit_code", 128 + signal.SIGINT))
    parser.error(f"unknown command {args.command!r}")
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
