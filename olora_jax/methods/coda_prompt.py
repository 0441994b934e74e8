"""CODA-Prompt (Smith et al., CVPR 2023), with its component blocks grown by the boundary switch.

A pool of M = `coda_prompt.pool_size` prompt components for each block l of
`coda_prompt.layers`: a key K_{m,l} (D,), an attention vector A_{m,l} (D,) and a prompt
P_{m,l} (Lp, D). The pool is allocated up front as T blocks of S = M // T components (static
shapes), T = `coda_prompt.n_tasks` or, when that is 0, the setting's `data.n_tasks` (a number
the config states, not read from the stream: the method stays task-free); the blocks in use are
0..c, c = min(n_boundaries, T - 1) (`prompt_pool.in_use`). Evaluation uses the blocks that have
trained (a block started by a boundary right before an evaluation joins after its first step).

Equations and where they live:

    q(x) = frozen model's class token (after the final LayerNorm), no gradient   prompt_pool.query
    alpha_{m,l}(x) = cos(q(x) * A_{m,l}, K_{m,l})  for m < (c + 1) S, else 0     `weights`
    p_l(x) = sum_m alpha_{m,l}(x) P_{m,l}   (Lp, D): its first Lp/2 tokens the     `prefixes`
             key prefix, the last Lp/2 the value prefix of block l (prefix-tuning)
    L = CE(f(x; p(x)), y) + ortho_weight * sum_l sum_{T in K, A, P}               `ortho_loss`
            mean_{i,j < (c+1) S} ((T T^T - I)_{ij})^2

(the paper's Eqs. 3-5 and its orthogonality loss; `*` elementwise, the attended query). Only
block c trains: the components of blocks < c enter the forward pass through stop_gradient (their
gradients are exactly 0) and `prompt_pool.freeze_rows` zeroes the updates of every component
outside block c, so neither weight decay nor Adam's moments move a frozen one. Blocks > c are
absent (alpha = 0) and stay zero until their turn.

The counter `n_boundaries` lives in the state (an int32 array: one jitted step for every c) and
`at_boundary` increments it when the run's boundary switch signals a boundary
(`boundaries.rule`): block c + 1 then starts, initialised by Gram-Schmidt orthogonal to every
earlier component (the authors' code: random normal vectors, each made orthogonal to the ones
before it and normalised; for P the (Lp, D) prompt flattened), and the optimizer restarts
(`reset_optimizer`). With 'none' (the default, task-free) only block 0 ever trains; past
T - 1 boundaries the last block keeps training (the authors' code has no block past its task
count).

Readings (docs/methods/coda_prompt.md lists them with the paper and the authors' code):
- Initialisation as the authors' released code: block 0 by Gram-Schmidt at the start, each later
  block at its boundary (the paper: the whole pool orthogonal at the start); earlier components
  keep their trained values and the new block is orthogonal to their span. Ours is exactly
  orthonormal to float32 precision (two projection passes per vector); the authors' Gram-Schmidt
  is not exactly so.
- Block size pool_size // n_tasks with n_tasks the setting's (the authors' pool / tasks), not a
  fixed count of blocks: with a fixed 10 a 5-task stream would leave half the pool unused.
- `ortho_weight` 0.0 as the authors' released ImageNet-R script ("with updated code, now can be
  0"), which relies on the Gram-Schmidt initialisation; the term is computed when it is > 0.
- The test-time pool is the blocks trained so far, as the authors' code (which evaluates with
  the components of the tasks so far); by default no class masking of the logits while training
  (the authors' code drops the logits of classes not seen yet and of earlier tasks; the fair
  task-free setting, as for L2P). `train_mask='task'` takes their CE over the current task's
  classes, read as the classes seen since the last boundary (`task_classes` in the state,
  emptied by `at_boundary`): the setting the parity check runs (tests/test_parity_coda_prompt.py).
  Adam, constant learning rate (their cosine schedule over 50 epochs has no counterpart in one
  online pass; its first epoch runs at the base rate).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olora_jax import config_keys
from olora_jax.config_keys import Constant, Key, authors, ours
from olora_jax.methods import base, common, prompt_pool

CODA = "GT-RIPL/CODA-Prompt"  # the authors' released code, where the defaults come from

BOUNDARY_SALT = 0x0C0DA  # folded into the step key for a new block's Gram-Schmidt draws
CONSTANTS = {
    "BOUNDARY_SALT": Constant("folded into the step key for a new block's Gram-Schmidt draws",
                              ours("49370 (0x0C0DA), any fixed number: it keeps the boundary's"
                                   " draws apart from the step's")),
}
ENTRIES = ("keys", "attention", "prompts")


def orthonormal_block(rows: jax.Array, key: jax.Array, start, size: int) -> jax.Array:
  """rows (M, d) with rows [start, start + size) replaced by orthonormal vectors orthogonal to the
  span of rows [0, start) (Gram-Schmidt on random normal draws; two passes for float32). Rows past
  the block are kept. `start` may be traced."""
  draws = jax.random.normal(key, rows.shape, rows.dtype)
  index = jnp.arange(rows.shape[0])
  earlier, new = index < start, (index >= start) & (index < start + size)

  def step(k, carry):
    basis, out = carry
    v = jnp.where(earlier[k], rows[k], draws[k])
    for _ in range(2):
      v = v - basis.T @ (basis @ v)
    norm = jnp.linalg.norm(v)
    b = jnp.where((earlier[k] | new[k]) & (norm > 1e-6), v / jnp.maximum(norm, 1e-6), 0.0)
    return basis.at[k].set(b), out.at[k].set(jnp.where(new[k], b, rows[k]))

  return jax.lax.fori_loop(0, rows.shape[0], step, (jnp.zeros_like(rows), rows))[1]


def init_block(pool: dict, key: jax.Array, start, size: int) -> dict:
  """The pool with components [start, start + size) of every layer and entry re-initialised by
  `orthonormal_block` (each layer and entry its own draws)."""
  out = {}
  for i, name in enumerate(ENTRIES):
    x = pool[name]  # (M, L, ...)
    flat = jnp.moveaxis(x.reshape(x.shape[0], x.shape[1], -1), 1, 0)  # (L, M, d)
    keys = jax.random.split(jax.random.fold_in(key, i), x.shape[1])
    flat = jax.vmap(lambda r, k: orthonormal_block(r, k, start, size))(flat, keys)
    out[name] = jnp.moveaxis(flat, 0, 1).reshape(x.shape)
  return out


def init_pool(key: jax.Array, block, width: int, size: int) -> dict:
  """{"keys" (M, L, D), "attention" (M, L, D), "prompts" (M, L, Lp, D)}: block 0 (`size`
  components) orthonormal, the later blocks zero until their boundary."""
  n_layers, m = len(block.layers), block.pool_size
  zeros = {"keys": jnp.zeros((m, n_layers, width), jnp.float32),
           "attention": jnp.zeros((m, n_layers, width), jnp.float32),
           "prompts": jnp.zeros((m, n_layers, block.prompt_length, width), jnp.float32)}
  return init_block(zeros, key, 0, size)


def block_size(pool_size: int, n_tasks: int) -> int:
  """Components per block: pool_size // n_tasks (the authors' code: one block per task, of the
  pool divided by the number of tasks, rounded down; the remainder is never used)."""
  return pool_size // n_tasks


def frozen_and_active(c, pool_size: int, size: int) -> tuple[jax.Array, jax.Array]:
  """(M,) bool: the components of earlier blocks (frozen), and those of blocks 0..c (in use)."""
  index = jnp.arange(pool_size)
  return index < c * size, index < (c + 1) * size


def freeze_earlier(pool: dict, frozen: jax.Array) -> dict:
  """The pool with the frozen components behind stop_gradient (their gradients are 0)."""
  return {name: jnp.where(frozen.reshape((-1,) + (1,) * (x.ndim - 1)),
                          jax.lax.stop_gradient(x), x) for name, x in pool.items()}


def cosine(a: jax.Array, b: jax.Array) -> jax.Array:
  """prompt_pool.cosine with the norms bounded below inside the square root: a zero vector (a
  component not yet in use) gets a zero gradient instead of NaN."""
  floor = prompt_pool.COSINE_EPS ** 2
  squared = (jnp.maximum(jnp.sum(a * a, axis=-1), floor)
             * jnp.maximum(jnp.sum(b * b, axis=-1), floor))
  return jnp.sum(a * b, axis=-1) / jnp.sqrt(squared)


def weights(pool: dict, queries: jax.Array, active: jax.Array) -> jax.Array:
  """alpha (B, M, L): cos(q * A_{m,l}, K_{m,l}) for the components in use, 0 for the others."""
  attended = queries[:, None, None, :] * pool["attention"][None]  # (B, M, L, D)
  return cosine(attended, pool["keys"][None]) * active[None, :, None]


def prefixes(pool: dict, alpha: jax.Array, layers) -> dict:
  """The ViT's `prefixes`: p_l = sum_m alpha_{m,l} P_{m,l}, split in key and value halves."""
  p = jnp.einsum("bml,mlpd->blpd", alpha, pool["prompts"])  # (B, L, Lp, D)
  half = p.shape[2] // 2
  return {f"encoderblock_{layer}": {"key": p[:, j, :half], "value": p[:, j, half:]}
          for j, layer in enumerate(layers)}


def ortho_loss(pool: dict, active: jax.Array) -> jax.Array:
  """sum over layers and K, A, P of mean_{i,j in use} ((T T^T - I)_{ij})^2."""
  pair = (active[:, None] & active[None, :]).astype(jnp.float32)
  total = jnp.zeros((), jnp.float32)
  for name in ENTRIES:
    x = pool[name]
    flat = jnp.moveaxis(x.reshape(x.shape[0], x.shape[1], -1), 1, 0)  # (L, M, d)
    gram = flat @ jnp.swapaxes(flat, 1, 2) - jnp.eye(x.shape[0])  # (L, M, M)
    total = total + jnp.sum(gram ** 2 * pair) / jnp.sum(pair)
  return total


def build(ctx: base.Context) -> base.Method:
  block = ctx.config.coda_prompt
  tx, apply = common.optimizer_and_apply(ctx, block)
  n_blocks = common.task_slots(ctx, block)
  layers, size = tuple(block.layers), block_size(block.pool_size, n_blocks)
  if size < 1:
    raise ValueError(f"coda_prompt.pool_size={block.pool_size} must be >= the number of tasks"
                     f" {n_blocks} (one block of pool_size // n_tasks components per task)")

  task_mask = block.train_mask == "task"

  def init(key, params):
    state = common.init_state(
        key, params, block.trainable, ctx.spec, ctx.config.learner.rank, tx,
        init_prompts=lambda k: init_pool(k, block, ctx.spec.width, size))
    state = {**state, "n_boundaries": jnp.zeros((), jnp.int32),
             "trained_blocks": jnp.zeros((), jnp.int32)}
    if task_mask:  # the classes seen since the last boundary
      state["task_classes"] = jnp.zeros((ctx.num_classes,), bool)
    return state

  def evaluated_block(state):
    """The last block evaluation uses: the one in use, or the last one trained when the block in
    use has had no step yet (a boundary signalled right before an evaluation)."""
    return jnp.maximum(jnp.minimum(prompt_pool.in_use(state, n_blocks),
                                   state["trained_blocks"] - 1), 0)

  def forward(state, params, images, queries, training=True):
    c = prompt_pool.in_use(state, n_blocks) if training else evaluated_block(state)
    frozen, active = frozen_and_active(c, block.pool_size, size)
    pool = freeze_earlier(params["prompt_pool"], frozen)
    alpha = weights(pool, queries, active)
    logits = apply(state["frozen"], params, images, prefixes=prefixes(pool, alpha, layers))
    return logits, pool, active

  @common.train_step("coda_prompt")
  def train_step(state, batch):
    queries = prompt_pool.query(apply, state["frozen"], batch["images"])
    if task_mask:
      task_classes = prompt_pool.task_classes(state, batch, ctx.num_classes)

    def loss_fn(params):
      logits, pool, active = forward(state, params, batch["images"], queries)
      if task_mask:
        logits = common.restrict_logits(logits, task_classes)
      ce = common.masked_mean(common.per_example_ce(logits, batch["labels"]), batch["mask"])
      if block.ortho_weight <= 0:
        return ce, dict(ce=ce)
      ortho = ortho_loss(pool, active)
      return ce + block.ortho_weight * ortho, dict(ce=ce, ortho_loss=ortho)

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    c = prompt_pool.in_use(state, n_blocks)
    frozen, active = frozen_and_active(c, block.pool_size, size)

    def freeze(updates):  # only block c of the pool moves
      return {**updates, "prompt_pool": prompt_pool.freeze_rows(updates["prompt_pool"],
                                                                active & ~frozen)}

    state = common.apply_gradients(state, grads, tx, freeze)
    state["trained_blocks"] = jnp.maximum(state["trained_blocks"], c + 1)
    if task_mask:
      state["task_classes"] = task_classes
    return state, {"loss": loss, **aux, "block": c}, {}

  def predict(state, images):
    queries = prompt_pool.query(apply, state["frozen"], images)
    return forward(state, state["params"], images, queries, training=False)[0]

  def grow(state, pool, old, new):
    """Block new starts orthogonal to the earlier components (unchanged once c is capped)."""
    key = jax.random.fold_in(common.step_key(state), BOUNDARY_SALT)
    grown = init_block(pool, key, new * size, size)
    return jax.tree.map(lambda a, b: jnp.where(new > old, a, b), grown, pool)

  advance = prompt_pool.counter_hook(tx, n_blocks, block.reset_optimizer, grow)
  return base.Method(name="coda_prompt", init=init, train_step=train_step, predict=predict,
                     at_boundary=prompt_pool.forgetting_task_classes(advance) if task_mask
                     else advance)


def config():
  """The `coda_prompt` block: the authors' ViT-B/16 ImageNet-R setting (their released script;
  docs/methods/coda_prompt.md); batch 128 in the authors' runs (ours: learner.batch_size)."""
  return common.baseline_block(
      trainable=Key("prompts", "'prompts', the only value: the components (keys, attention"
                    " vectors, prompts), plus the head, on the frozen backbone",
                    authors("prompts", f"{CODA}, models/zoo.py: the frozen backbone")),
      learning_rate=common.shared(1e-3, authors(1e-3, f"{CODA}, configs/imnet-r_prompt.yaml: lr"
                                                " (Adam)", batch=128,
                                                unscaled=config_keys.ADAM_UNSCALED)),
      weight_decay=common.shared(0.0, authors(0.0, f"{CODA}, configs/imnet-r_prompt.yaml:"
                                              " weight_decay")),
      layers=Key((0, 1, 2, 3, 4), "blocks that take a prompt prefix, indices < model.depth (the"
                 " authors': 0-4 of ViT-B's 12)",
                 authors((0, 1, 2, 3, 4), f"{CODA}, models/zoo.py: e_layers")),
      pool_size=Key(100, "M, components per block, in n_tasks groups of M // n_tasks, one group"
                    " per task; in [n_tasks, model width]",
                    authors(100, f"{CODA}, experiments/imagenet-r.sh: --prompt_param's first"
                                 " value")),
      n_tasks=Key(0, "T, the groups the pool is split into; 0 = data.n_tasks (read from the"
                  " config, never from a batch); past T boundaries the last group keeps"
                  " training",
                  ours("read from the stream (data.n_tasks), as the authors' count of tasks is"
                       " read from their dataset split")),
      prompt_length=Key(8, "Lp, tokens of a component: Lp/2 key and Lp/2 value prefix tokens"
                        " (even)",
                        authors(8, f"{CODA}, experiments/imagenet-r.sh: --prompt_param's second"
                                   " value")),
      ortho_weight=Key(0.0, "weight of the orthogonality loss on keys, attention vectors and"
                       " prompts (>= 0; the authors' released script: 0)",
                       authors(0.0, f"{CODA}, experiments/imagenet-r.sh: --prompt_param's third"
                                    " value")),
      reset_optimizer=Key(True, "Adam's state restarts at each boundary",
                          authors(True, f"{CODA}, learners/prompt.py: a new optimiser for each"
                                  " task")),
      train_mask=Key("none", "the classes of the training cross-entropy: 'none' every class |"
                     " 'task' the classes seen since the last boundary (the authors' code: the"
                     " current task's classes; the others' logits left out of the softmax)",
                     authors("task", f"{CODA}, learners/prompt.py: update_model (logits sliced to"
                             " the classes of the tasks so far, the earlier tasks' set to -inf)",
                             differs="'none': their mask reads the task structure; the task-free"
                             " default takes every class, as for L2P")))


METHODS = (base.MethodSpec(name="coda_prompt", build=build, config=config,
                           report_name="CODA-Prompt", table_row=18,
                           check=base.Check("step", CODA, "tests/test_parity_coda_prompt.py",
                                            settings={"boundaries.rule": "oracle",
                                                      "coda_prompt.train_mask": "task",
                                                      "coda_prompt.reset_optimizer": True,
                                                      "coda_prompt.ortho_weight": 0.0,
                                                      "coda_prompt.trainable": "prompts"},
                                            scope="40 steps over 5 tasks, float32, each new block"
                                            " from our init on both sides (its orthogonality"
                                            " checked apart)")),)
