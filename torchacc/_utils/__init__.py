"""Helpers every layer may use: atomic files (``fs``), the one tensor-tree walker (``tree``), tied
parameters (``tied``) and warnings emitted once (``logging``). Nothing here imports the rest of torchacc."""
