"""Dynamic loss scaling: kept here for compatibility; the module is
:mod:`jax_blocksparse.mixed_precision` (mixed precision is not part of dynamic sparsity)."""

from jax_blocksparse.mixed_precision import (
    LossScaleState,
    all_finite,
    dynamic_loss_scaling,
    loss_scale,
    scale_loss,
)

__all__ = ["LossScaleState", "all_finite", "dynamic_loss_scaling", "loss_scale", "scale_loss"]
