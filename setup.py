"""Build entry for torchacc. Tool settings live in pyproject.toml."""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'VERSION = "([^"]+)"', (HERE / "torchacc" / "_utils" / "version.py").read_text()).group(1)
METRICS = {"tensorboard": ["tensorboard"], "wandb": ["wandb>=0.19"], "plot": ["matplotlib"]}  # one extra per sink

setup(
    name="torchacc",
    version=VERSION,
    description="Config-driven, one-call FSDP2 acceleration for PyTorch training",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["torchacc", "torchacc.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "omegaconf>=2.4", "tqdm"],
    extras_require={
        "hf": ["transformers", "datasets"],
        "dev": ["pytest", "pytest-xdist", "ruff"],
        "bench": ["matplotlib"],
        **METRICS,
        "metrics": sorted({req for reqs in METRICS.values() for req in reqs}),  # every sink and the plot
    },
    entry_points={"console_scripts": ["torchacc=torchacc.__main__:main"]},
)
