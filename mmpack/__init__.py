"""mmpack: data packing for vision-language model training.

One import namespace over the project's four parts, so that a user's own ``trainer.py`` or ``dataloader/``
neither shadows nor is shadowed by them:

- :mod:`mmpack.packing`: pure algorithms (bin packing, length model, layout, manifest, statistics);
- :mod:`mmpack.offline_packing`: the offline job (``mmpack pack``), ``mmpack stats``;
- :mod:`mmpack.dataloader`: the rank-aware streaming loader;
- :mod:`mmpack.trainer`: the megatron-core trainer (``python -m mmpack.trainer.pretrain_vlm``).

The four live in top-level folders of the repository; ``mmpack/`` links them into this package. Above them, the
application layer lives here itself: :mod:`mmpack.cli` (the ``mmpack`` command) and :mod:`mmpack.demo`
(``mmpack demo``). This module imports nothing (every import of the package runs it).
"""

__version__ = "0.1.0"
