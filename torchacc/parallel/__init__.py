"""How a model becomes sharded: ``accelerate()`` and the engine behind it and ``FSDP2Strategy``.

Order of one ``accelerate()`` call: ``accelerate.py`` checks (``plan.py``), starts the process group and
compares the ranks' configs (``agree.py``), builds the mesh, then ``engine.py`` cuts a pipelined model to this
rank's stages (``pipeline.py``; ``pipeline_step.py`` runs their schedule in ``train_step``), applies tensor
parallelism (``tp.py``), context parallelism (``context.py``, ``context_attention.py``), activation checkpointing
(``activation_checkpoint.py``), compilation, FSDP2 or DDP (``fsdp.py``), meta-device materialization
(``meta_init.py``, ``init_from.py``) and mixed precision (``precision.py``).
"""
