"""The MLX side: the model pool, one engine thread per model, the demo models.

Importing this package first chooses the BLAS that MLX's CPU backend will call
(engine/blas.py): that has to happen before anything loads `mlx.core`, and every
module that imports MLX lives here, so this is the one place that runs early enough.
"""

from engine import blas as _blas

_blas.preload()
