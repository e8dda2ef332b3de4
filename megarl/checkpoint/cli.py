"""Shared plumbing of the `checkpoint_tools/` scripts: bad input -> one line on stderr and exit status 2; vendor
log noise quieted as `megarl train` does (`--verbose` lets it through)."""

from __future__ import annotations

import sys
from typing import Callable

from megarl.checkpoint.errors import EXIT_BAD_INPUT, CheckpointError
from megarl.checkpoint.name_map import LayoutError
from megarl.models.spec import UnsupportedModelError
from megarl.parallel.topology import TopologyError

BAD_INPUT = (CheckpointError, UnsupportedModelError, LayoutError, TopologyError)


VERBOSE_HELP = ("show megatron-core's, torch's and transformers' own warnings and logs (default: only their errors, "
                "as `megarl train` without --verbose)")


def quiet_vendor_logs(verbose: bool) -> None:
    """Before any vendor import: vendor warnings and logs at ERROR (megatron-core's "Transformer Engine and Apex are
    not installed", 7 per process) unless `verbose`; set in the environment too, so the ranks a tool starts
    (`megarl.platform.spawn.run_ranks`, torchrun children) inherit it. See `megarl.platform.vendor_logs`."""
    from megarl.platform.vendor_logs import quiet_vendors

    quiet_vendors("info" if verbose else "error")


def run_tool(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Call `main(argv)`; a bad-input error prints `error: <message>` (one line) and returns 2."""
    try:
        return main(argv)
    except BAD_INPUT as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {msg}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
