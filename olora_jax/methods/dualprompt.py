"""DualPrompt (Wang et al., ECCV 2022), with its task index taken from the boundary switch.

Two kinds of prompts, both prefix-tuning (`VisionTransformer(prefixes=...)`: per block, Lp key
and Lp value tokens prepended to the projected keys and values of attention), on the frozen
backbone:

- the G-prompt (general): one learned prefix g_l (2, Lg, D) for each block l in
  `dualprompt.g_layers`, shared by every image and trained throughout;
- the E-prompts (expert): a pool of M = `dualprompt.pool_size` prompts e_i (one prefix
  (2, Le, D) for each block of `dualprompt.e_layers`) with one key k_i (D,) each.

Equations and where they live (k = `top_k`):

    q(x) = frozen model's class token (after the final LayerNorm), no gradient   prompt_pool.query
    training:  task t = n_boundaries; while (t + 1) k <= M its E-prompts S are    `task_rows`
               t k .. (t + 1) k - 1 for every image, after that (the pool has
               run out) each image's k nearest keys, as at test time
               L = CE(f(x; g, e_S), y) + key_loss_weight * sum_{i in S} (1 - cos(q(x), k_i))
    test:      S(x) = the k keys nearest q(x) in 1 - cos among the keys some   `predict`
               training step used (`prompt_pool.trained_only`)
               logits = f(x; g, e_S(x))

(the paper's Eq. 3 with its matching loss, lambda = `key_loss_weight`). The training-time index
t is the paper's task identity: here it is `n_boundaries`, a counter in the state (an int32
array, so the one jitted step serves every task) that `at_boundary` increments when the run's
boundary switch signals a boundary (`boundaries.rule`). With 'oracle' t is the true task index
(the paper's setting); with 'plateau' the loss-window rule decides; with 'none' (the default,
task-free) t stays 0: one E-prompt and the G-prompt train on the whole stream, and the test-time
match has that one trained key to choose (a key no step trained keeps its initial value; it is
never a candidate). A stream with more boundaries than the pool holds tasks (M // k) falls back,
as the authors' code does once its task's prompt mask would run past the pool, to free key
selection in training.

Readings (docs/methods/dualprompt.md lists them with the paper and the authors' code):
- Only the E-prompts and keys used in the step move (their rows of the pool;
  `prompt_pool.freeze_rows` zeroes the updates of the others, so neither weight decay nor Adam's
  moments move an earlier E-prompt); the G-prompt and the head train always.
- At a boundary the new task's E-prompts start as copies of the previous task's
  (`init_from_previous`, the authors' `shared_prompt_pool=True`; their keys are not shared)
  and the optimizer state is reset (`reset_optimizer`, their `reinit_optimizer=True`).
- Initialisation as the authors' code: prompts and keys uniform in [0, 0.01).
- The classifier reads the class token; by default no class masking of the logits while
  training (the authors' `train_mask`; the fair task-free setting, as for L2P);
  `train_mask='task'` takes the CE over the classes seen since the last boundary
  (`prompt_pool.task_classes`), the setting of the check against GT-RIPL/CODA-Prompt's DualPrompt
  (tests/test_parity_coda_prompt.py). Adam with the global gradient norm clipped to `clip_norm`
  (their 1.0), constant learning rate `learning_rate` * B / 256 for the learner's batch B (the
  authors' linear scaling; `lr_reference_batch`, `learning_rate`).
- A block in both lists prepends its E-prefix, then its G-prefix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olora_jax.config_keys import Constant, Key, authors
from olora_jax.methods import base, common, prompt_pool

DUALPROMPT = "google-research/l2p"  # the authors' released code (DualPrompt's configs)
DUALPROMPT_PORT = "JH-LEE-KR/dualprompt-pytorch"  # their PyTorch port

INIT_MAX = 0.01  # prompts and keys start uniform in [0, INIT_MAX) (the authors' initialiser)
CONSTANTS = {
    "INIT_MAX": Constant("prompts and keys start uniform in [0, INIT_MAX)",
                         authors(0.01, f"{DUALPROMPT}: the prompts' and keys' default"
                                 " initialiser (uniform, scale 0.01)")),
}


def init_pool(key: jax.Array, block, width: int) -> dict:
  """{"g_prompts" (|g_layers|, 2, Lg, D), "e_prompts" (M, |e_layers|, 2, Le, D), "keys" (M, D)}."""
  g_key, e_key, k_key = jax.random.split(key, 3)

  def uniform(k, shape):
    return jax.random.uniform(k, shape, jnp.float32, 0.0, INIT_MAX)

  return {"g_prompts": uniform(g_key, (len(block.g_layers), 2, block.g_prompt_length, width)),
          "e_prompts": uniform(e_key, (block.pool_size, len(block.e_layers), 2,
                                       block.prompt_length, width)),
          "keys": uniform(k_key, (block.pool_size, width))}


def prefixes(pool: dict, idx: jax.Array, g_layers, e_layers) -> dict:
  """The ViT's `prefixes` for E-prompts idx (B, N) (in rank order) and the G-prompt."""
  batch = idx.shape[0]
  e = pool["e_prompts"][idx]  # (B, N, |e|, 2, Le, D)
  e = jnp.moveaxis(e, 1, 3).reshape(batch, e.shape[2], 2, -1, e.shape[-1])  # (B, |e|, 2, N Le, D)
  out = {f"encoderblock_{layer}": prompt_pool.prefix(e[:, j]) for j, layer in enumerate(e_layers)}
  for j, layer in enumerate(g_layers):
    g_tokens = pool["g_prompts"][j]  # (2, Lg, D), the same for every image
    g = prompt_pool.prefix(jnp.broadcast_to(g_tokens, (batch, *g_tokens.shape)))
    name = f"encoderblock_{layer}"
    out[name] = prompt_pool.concat_prefixes(out[name], g) if name in out else g
  return out


def learning_rate(block, batch_size: int) -> float:
  """The Adam learning rate: `learning_rate` scaled by `common.batch_scale` (the authors' code
  reads its configured rate as the rate of a batch of 256 and scales it linearly to the global
  batch, the rule every method with `lr_reference_batch` follows), or `learning_rate` itself when
  `lr_reference_batch` is 0."""
  return block.learning_rate * common.batch_scale(block, batch_size)


def task_rows(n_boundaries: jax.Array, pool_size: int, top_k: int) -> tuple[jax.Array, jax.Array]:
  """(rows (top_k,), free ()): the E-prompts of task t = `n_boundaries`, t * top_k ..
  (t + 1) * top_k - 1, and whether the pool has run out ((t + 1) * top_k > pool_size, the
  authors' test for dropping the task's prompt mask): then each image selects its own `top_k`
  by key match in training too, and `rows` is the last task's (unused)."""
  slots = pool_size // top_k
  t = jnp.minimum(n_boundaries, slots - 1)
  return t * top_k + jnp.arange(top_k), n_boundaries >= slots


def build(ctx: base.Context) -> base.Method:
  block = ctx.config.dualprompt
  tx = common.make_adam(learning_rate(block, ctx.batch_size), block.weight_decay,
                        block.clip_norm)
  apply = common.make_apply(ctx.model)
  g_layers, e_layers = tuple(block.g_layers), tuple(block.e_layers)
  k, m = block.top_k, block.pool_size
  task_mask = block.train_mask == "task"

  def init(key, params):
    state = common.init_state(key, params, block.trainable, ctx.spec, ctx.config.learner.rank,
                              tx, init_prompts=lambda k: init_pool(k, block, ctx.spec.width))
    state = {**state, "n_boundaries": jnp.zeros((), jnp.int32),
             "selection_count": jnp.zeros((m,), jnp.float32)}
    if task_mask:  # the classes seen since the last boundary
      state["task_classes"] = jnp.zeros((ctx.num_classes,), bool)
    return state

  def forward(frozen, params, images, idx):
    return apply(frozen, params, images,
                 prefixes=prefixes(params["prompt_pool"], idx, g_layers, e_layers))

  @common.train_step("dualprompt")
  def train_step(state, batch):
    queries = prompt_pool.query(apply, state["frozen"], batch["images"])
    rows, free = task_rows(state["n_boundaries"], m, k)
    matched = prompt_pool.select(
        prompt_pool.key_distance(queries, state["params"]["prompt_pool"]["keys"]), k)
    idx = jnp.where(free, matched, jnp.broadcast_to(rows, matched.shape))  # (B, top_k)
    if task_mask:
      task_classes = prompt_pool.task_classes(state, batch, ctx.num_classes)

    def loss_fn(params):
      logits = forward(state["frozen"], params, batch["images"], idx)
      if task_mask:
        logits = common.restrict_logits(logits, task_classes)
      ce = common.masked_mean(common.per_example_ce(logits, batch["labels"]), batch["mask"])
      distance = prompt_pool.key_distance(queries, params["prompt_pool"]["keys"])
      match = jnp.sum(jnp.take_along_axis(distance, idx, axis=1), axis=1)
      key_loss = common.masked_mean(match, batch["mask"])
      return ce + block.key_loss_weight * key_loss, dict(ce=ce, key_loss=key_loss)

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    counts = prompt_pool.count_selected(jnp.zeros((m,), jnp.float32), idx, batch["mask"])

    def freeze(updates):  # only the E-prompts (and keys) used in this step move
      pool = updates["prompt_pool"]
      return {**updates, "prompt_pool": {
          **pool, **prompt_pool.freeze_rows({n: pool[n] for n in ("e_prompts", "keys")},
                                            counts > 0)}}

    state = common.apply_gradients(state, grads, tx, freeze)
    state["selection_count"] = state["selection_count"] + counts
    if task_mask:
      state["task_classes"] = task_classes
    e_prompt = jnp.where(free, -1, rows[0])
    return state, {"loss": loss, **aux, "e_prompt": e_prompt}, {}

  def predict(state, images):
    queries = prompt_pool.query(apply, state["frozen"], images)
    distance = prompt_pool.key_distance(queries, state["params"]["prompt_pool"]["keys"])
    return forward(state["frozen"], state["params"], images, prompt_pool.select(
        prompt_pool.trained_only(distance, state["selection_count"]), k))

  def copy_previous(state, pool, old, new):
    """The new task's E-prompts start as copies of the previous task's (a no-op once the pool
    has run out)."""
    if not block.init_from_previous:
      return pool
    e = pool["e_prompts"]
    return {**pool, "e_prompts": e.at[new * k + jnp.arange(k)].set(e[old * k + jnp.arange(k)])}

  advance = prompt_pool.counter_hook(tx, m // k, block.reset_optimizer, copy_previous)
  return base.Method(name="dualprompt", init=init, train_step=train_step, predict=predict,
                     at_boundary=prompt_pool.forgetting_task_classes(advance) if task_mask
                     else advance)


def config():
  """The `dualprompt` block: the authors' ViT-B/16 Split ImageNet-R setting (their code's config;
  docs/methods/dualprompt.md); batch 24 in the authors' runs (ours: learner.batch_size)."""
  return common.baseline_block(
      trainable=Key("prompts", "'prompts', the only value: the G-prompt, the E-prompt pool with"
                    " its keys, plus the head, on the frozen backbone",
                    authors("prompts", f"{DUALPROMPT}, configs/imr_dualprompt.py: the frozen"
                                       " backbone")),
      learning_rate=Key(5e-3, "Adam's learning rate for a batch of lr_reference_batch, scaled"
                        " linearly to learner.batch_size, constant (> 0)",
                        authors(5e-3, f"{DUALPROMPT}, configs/imr_dualprompt.py: learning_rate"
                                " (scaled by batch / 256 in train_continual.py)", batch=256)),
      lr_reference_batch=Key(256, "the batch the learning rate is given for (the authors' 256);"
                             " 0 = learning_rate unscaled",
                             authors(256, f"{DUALPROMPT}, train_continual.py: the rate times the"
                                          " global batch / 256")),
      weight_decay=common.shared(0.0, authors(0.0, f"{DUALPROMPT}, configs/imr_dualprompt.py:"
                                                   " weight_decay")),
      clip_norm=Key(1.0, "the global gradient norm is clipped to this (>= 0; 0 = no clipping)",
                    authors(1.0, f"{DUALPROMPT}, configs/imr_dualprompt.py: grad_clip_max_norm")),
      g_layers=Key((0, 1), "blocks that take the G-prompt prefix, indices < model.depth (the"
                   " paper: 0-1 of ViT-B's 12)",
                   authors((0, 1), f"{DUALPROMPT}, configs/imr_dualprompt.py: g_prompt_layer_idx")),
      g_prompt_length=Key(5, "Lg, G-prompt tokens per block, for keys and for values each"
                          " (>= 1)",
                          authors(5, f"{DUALPROMPT}, configs/imr_dualprompt.py: g_prompt_length")),
      e_layers=Key((2, 3, 4), "blocks that take the E-prompt prefix, indices < model.depth (the"
                   " paper: 2-4)",
                   authors((2, 3, 4), f"{DUALPROMPT}, configs/imr_dualprompt.py:"
                                      " e_prompt_layer_idx")),
      prompt_length=Key(20, "Le, E-prompt tokens per block, for keys and for values each (>= 1)",
                        authors(20, f"{DUALPROMPT}, configs/imr_dualprompt.py: the E-prompts'"
                                    " length")),
      pool_size=Key(10, "M, E-prompts in the pool with one key each; task t trains prompts t k"
                    " .. (t + 1) k - 1 while they last (>= 1)",
                    authors(10, f"{DUALPROMPT}, configs/imr_dualprompt.py: pool_size")),
      top_k=Key(1, "k, E-prompts an image takes (in training, per task; at test, the nearest"
                " keys), in [1, pool_size]",
                authors(1, f"{DUALPROMPT}, configs/imr_dualprompt.py: top_k")),
      key_loss_weight=Key(1.0, "lambda of the key-matching loss sum (1 - cos(query, key)) (>= 0)",
                          authors(1.0, f"{DUALPROMPT}, configs/imr_dualprompt.py:"
                                       " pull_constraint_coeff")),
      init_from_previous=Key(True, "at a boundary the new task's E-prompts start as copies of the"
                             " previous task's (the authors' shared_prompt_pool)",
                             authors(True, f"{DUALPROMPT_PORT}, configs/imr_dualprompt.py:"
                                           " shared_prompt_pool (the authors' PyTorch port)")),
      reset_optimizer=Key(True, "Adam's state restarts at each boundary (the authors'"
                          " reinit_optimizer)",
                          authors(True, f"{DUALPROMPT}, configs/imr_dualprompt.py:"
                                        " reinit_optimizer")),
      train_mask=Key("none", "the classes of the training cross-entropy: 'none' every class |"
                     " 'task' the classes seen since the last boundary (the authors' task mask;"
                     " the others' logits left out of the softmax)",
                     authors("task", f"{DUALPROMPT_PORT}, configs/imr_dualprompt.py: train_mask"
                             " (the current task's classes)",
                             differs="'none': their mask reads the task structure; the task-free"
                             " default takes every class, as for L2P")))


METHODS = (base.MethodSpec(name="dualprompt", build=build, config=config,
                           report_name="DualPrompt", table_row=17),)
