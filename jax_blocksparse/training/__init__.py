"""Dynamic sparse training: the layout is learned, every step stays block-sparse.

Block-level versions of sparse momentum, RigL, SET, gradual magnitude pruning and
a static-sparse baseline, with layer budgets (uniform, ERK; defined in
:mod:`jax_blocksparse.layers.budgets` and re-exported here, as are the block scores
of :mod:`jax_blocksparse.layers.select`). They continue from a trained dense model
made block-sparse in one call (:func:`jax_blocksparse.nnx.sparsify`,
:func:`jax_blocksparse.nn.sparsify`, with ``dynamic=True``). Layouts live beside
the params (a linen "layout" variable collection, or any pytree of
:class:`~jax_blocksparse.Layout`) and change inside jit with fixed capacities, so
nothing recompiles. Works with any optax optimizer: the update moves every
per-block leaf of the optimizer state with its block and resets it at grown blocks.

A linen training loop::

    import jax_blocksparse as jbs
    from jax_blocksparse import training as jst

    method = jst.RigL(density=0.1, total_steps=T, update_every=100)
    plan = method.plan({"fc1": (784, 320), "fc2": (320, 96)}, block_size=16)
    # build the model from BlockSparseDense(..., mask=plan[name].mask,
    #     capacity=plan[name].capacity, dynamic=True, name=name)
    variables = model.init(key, x)
    params, layouts = variables["params"], variables["layout"]
    opt_state = tx.init(params)

    def loss_fn(params, layouts, x, y):
        logits = model.apply({"params": params, "layout": layouts}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def train_step(params, layouts, opt_state, x, y):      # block-sparse fprop/bprop/updat
        grads = jax.grad(loss_fn)(params, layouts, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    @jax.jit
    def sparsity_step(step, params, layouts, opt_state, x, y):
        dense = jst.dense_grads(loss_fn, params, layouts, x, y)   # RigL only
        return method.update(step, params, layouts, opt_state, dense)

    for step in range(1, T + 1):
        params, opt_state = train_step(params, layouts, opt_state, *next(batches))
        if method.is_update_step(step):
            params, layouts, opt_state, log = sparsity_step(step, params, layouts, opt_state, *batch)
            print(jst.format_log(log))
"""

from jax_blocksparse.layers.budgets import (
    DISTRIBUTIONS,
    LayerPlan,
    allocate_blocks,
    erk_densities,
    plan_layouts,
    uniform_densities,
)
from jax_blocksparse.layers.select import block_magnitude, grid_scores, redistribute
from jax_blocksparse.training._paths import is_layout, named_layouts
from jax_blocksparse.training.log import LayoutChangeLog, format_log, log_rows
from jax_blocksparse.training.methods import (
    METHODS,
    SET,
    DynamicSparsity,
    MagnitudePruning,
    RigL,
    SparseMomentum,
    SparsityUpdate,
    StaticSparse,
    get_method,
)
from jax_blocksparse.training.nnx_utils import nnx_dense_grads, nnx_update
from jax_blocksparse.training.probe import ProbedLayout, dense_grads, grid_view, probe_product, unwrap
from jax_blocksparse.training.remap import remap_blocks, remap_tree, slot_map
from jax_blocksparse.training.schedules import annealed_fraction, cosine_decay, cubic_density

__all__ = [
    "DISTRIBUTIONS",
    "METHODS",
    "SET",
    "DynamicSparsity",
    "LayerPlan",
    "LayoutChangeLog",
    "MagnitudePruning",
    "ProbedLayout",
    "RigL",
    "SparseMomentum",
    "SparsityUpdate",
    "StaticSparse",
    "allocate_blocks",
    "annealed_fraction",
    "block_magnitude",
    "cosine_decay",
    "cubic_density",
    "dense_grads",
    "erk_densities",
    "format_log",
    "get_method",
    "grid_scores",
    "grid_view",
    "is_layout",
    "log_rows",
    "named_layouts",
    "nnx_dense_grads",
    "nnx_update",
    "plan_layouts",
    "probe_product",
    "redistribute",
    "remap_blocks",
    "remap_tree",
    "slot_map",
    "uniform_densities",
    "unwrap",
]
