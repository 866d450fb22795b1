from setuptools import find_packages, setup

setup(
    name="megadiv",
    version="0.1.0",
    description="Megatron-scale GRPO trainer with a unified policy-divergence clipping framework",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["megadiv", "megadiv.*"]),
    package_data={"megadiv": ["data/files/*.md", "data/files/*/*", "rollout/sglang_cpu/**/*"]},
    install_requires=[
        "torch>=2.6",
        "megatron-core==0.16.1",
        "numpy>=1.26",
        "psutil>=5.9",
        "xxhash>=3.0",
        "pyyaml>=6.0",
        "safetensors>=0.4",
        "transformers>=5.19,<5.20",
        "math-verify>=0.9,<0.10",
        "tensorboard>=2.14",
        "datasets>=3.0",
        "matplotlib>=3.7",
        "scipy>=1.11",                  # megadiv sweep: t quantiles and the paired test
        "requests>=2.31",
        "deepspeed>=0.19.8,<0.20",
    ],
    extras_require={
        # GPU tier, bounded as requirements-gpu.txt (tests/test_gpu_lock.py checks both against the
        # packages' own metadata): Transformer Engine in megatron-core 0.16.1's declared range, and the
        # SGLang release whose weight-update API megadiv speaks (it pins torch and transformers).
        # apex is not on PyPI: the NGC image carries it, or build it from NVIDIA's sources.
        "gpu": ["transformer-engine[core_cu13,pytorch]>=2.9.0a0,<2.12.0", "sglang==0.5.23", "torch==2.14.1"],
        "test": ["pytest>=8.0", "pytest-timeout>=2.3", "ruff==0.17.5"],
        "wandb": ["wandb>=0.19"],  # run.loggers: [..., wandb]
    },
    entry_points={"console_scripts": ["megadiv=megadiv.cli:main"]},
)
