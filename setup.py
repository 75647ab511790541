"""Build entry for torchacc. Tool settings live in pyproject.toml."""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="torchacc",
    version="0.1.0",
    description="Config-driven, one-call FSDP2 acceleration for PyTorch training",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["torchacc", "torchacc.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "omegaconf>=2.4", "tqdm"],
    extras_require={
        "hf": ["transformers", "datasets"],
        "dev": ["pytest", "ruff"],
        "bench": ["matplotlib"],
    },
    entry_points={"console_scripts": ["torchacc=torchacc.__main__:main"]},
)
