"""Where megarl runs: device choice, torch.distributed start-up, seeding, and megatron-core on CPU."""

from megarl.platform.device import device_kind, local_device
from megarl.platform.distributed import init_distributed, seed_everything
from megarl.platform.megatron_cpu_compat import megatron_on_cpu

__all__ = ["device_kind", "local_device", "init_distributed", "seed_everything", "megatron_on_cpu"]
