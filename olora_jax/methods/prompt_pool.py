"""The prompt pool of the prompt methods (L2P, MVP): keys, prompts, instance-wise selection.

A pool (Wang et al. 2022, L2P) is a trainable pytree, the `prompt_pool` entry of the trainable
tree next to the head (`common.split_trainable` with trainable='prompts'; the backbone stays
frozen):

    keys     (M, D)      one key per prompt
    prompts  (M, Lp, D)  M prompts of Lp tokens
    (MVP adds masks (M, C), its instance-wise logit masks; olora_jax/methods/mvp.py)

Selection is instance-wise and task-free: the query of an image is the frozen, prompt-free
model's class token (after the final LayerNorm; MVP's after block depth - 2), and an image takes
the `top_k` prompts whose keys lie nearest its query in cosine distance 1 - cos(q, k). Nothing but
the image (and the pool) reaches the selection: no label, no task id, no batch statistic. Each
method counts the training selections of every key in its state (`count_selected`); at
evaluation only keys selected in training are candidates (`trained_only`): a key that no training
step selected holds its initial value, as does its prompt.

DualPrompt and CODA-Prompt (dualprompt.py, coda_prompt.py) use the same query and key distance
with prefix-tuning instead of prompt tokens (`prefix`, `concat_prefixes`), and a boundary counter
in the state that says which part of their pool trains (`in_use`, `counter_hook`, `freeze_rows`).

All functions are pure.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olora_jax.config_keys import Constant, ours

COSINE_EPS = 1e-8  # lower bound of a norm in a cosine
CONSTANTS = {
    "COSINE_EPS": Constant("lower bound of the product of two norms in a query-key cosine",
                           ours("1e-8, a floor that keeps a zero vector's cosine 0, not NaN"
                                " (PyTorch's cosine_similarity default eps)")),
}


KEY_INITS = ("uniform", "normal")


def init(key: jax.Array, pool_size: int, length: int, width: int,
         key_init: str = "uniform") -> dict:
  """A fresh pool {"keys" (M, D), "prompts" (M, Lp, D)}, both uniform in [-1, 1] (L2P's
  initialisation); `key_init='normal'` draws the keys standard normal instead (MVP's code)."""
  if key_init not in KEY_INITS:
    raise ValueError(f"unknown key_init={key_init!r}; use one of {KEY_INITS}")
  key_key, prompt_key = jax.random.split(key)
  keys = (jax.random.normal(key_key, (pool_size, width), jnp.float32) if key_init == "normal"
          else jax.random.uniform(key_key, (pool_size, width), jnp.float32, -1.0, 1.0))
  return {"keys": keys,
          "prompts": jax.random.uniform(prompt_key, (pool_size, length, width), jnp.float32,
                                        -1.0, 1.0)}


def cosine(a: jax.Array, b: jax.Array) -> jax.Array:
  """Cosine similarity of the last axes, broadcast over the others: (..., D), (..., D) -> (...)."""
  norms = jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1)
  return jnp.sum(a * b, axis=-1) / jnp.maximum(norms, COSINE_EPS)


QUERIES = ("last_norm", "last", "penultimate")


def query(apply, frozen: dict, images: jax.Array, where: str = "last_norm",
          depth: int | None = None) -> jax.Array:
  """The query of each image (B, D): the frozen model's class token without prompts, no
  gradient, taken at `where`: 'last_norm' after the final LayerNorm (L2P's, DualPrompt's,
  CODA-Prompt's), 'last' after the last block, before that LayerNorm, or 'penultimate' after
  block depth - 2 (the ViT's blocks but the last; MVP's code as its script runs it; `depth`, the
  model's block count, is then needed). `apply` is `common.make_apply(model)`."""
  if where not in QUERIES:
    raise ValueError(f"unknown query {where!r}; use one of {QUERIES}")
  kwargs = {} if where == "last_norm" else {"final_norm": False}
  if where == "penultimate":
    if depth is None or depth < 2:
      raise ValueError(f"the 'penultimate' query needs a model of depth >= 2, got {depth}")
    kwargs["blocks"] = depth - 1
  return jax.lax.stop_gradient(apply(frozen, {}, images, pre_logits=True, **kwargs))


def key_distance(queries: jax.Array, keys: jax.Array) -> jax.Array:
  """1 - cos(q_b, k_j): (B, D), (M, D) -> (B, M)."""
  return 1.0 - cosine(queries[:, None, :], keys[None, :, :])


def select(score: jax.Array, top_k: int) -> jax.Array:
  """Indices (B, top_k) of the `top_k` smallest scores of each row of `score` (B, M); ties go to
  the lower index."""
  return jax.lax.top_k(-jax.lax.stop_gradient(score), top_k)[1]


def trained_only(score: jax.Array, counts: jax.Array) -> jax.Array:
  """`score` (B, M) with the keys never trained (`counts` (M,) <= 0: never selected in a training
  step) set to +inf, so that `select` takes trained keys only; unchanged while no key has been
  trained (before the first step). One training step trains at least `top_k` keys (each image
  selects `top_k` distinct ones), so from then on `select` never returns a key never trained."""
  never = (counts <= 0) & jnp.any(counts > 0)
  return jnp.where(never[None, :], jnp.inf, score)


def count_selected(counts: jax.Array, idx: jax.Array, valid: jax.Array) -> jax.Array:
  """`counts` (M,) plus the number of times each key occurs in `idx` (B, N) among the valid
  images `valid` (B,) (padded batch items select nothing)."""
  picked = jax.nn.one_hot(idx, counts.shape[0], dtype=counts.dtype) * valid[:, None, None]
  return counts + jnp.sum(picked, axis=(0, 1))


def prompt_tokens(pool: dict, idx: jax.Array) -> jax.Array:
  """The selected prompts as tokens to prepend: idx (B, N) -> (B, N * Lp, D), in rank order."""
  tokens = pool["prompts"][idx]  # (B, N, Lp, D)
  return tokens.reshape(idx.shape[0], -1, tokens.shape[-1])


def prefix(tokens: jax.Array) -> dict:
  """Prefix-tuning tokens (B, 2, Lp, D) -> a ViT block's {"key" (B, Lp, D), "value" (B, Lp, D)}
  (`VisionTransformer(prefixes=...)`)."""
  return {"key": tokens[:, 0], "value": tokens[:, 1]}


def concat_prefixes(*prefixes: dict) -> dict:
  """One block's prefixes from several sources (DualPrompt's E- and G-prompt in one layer),
  concatenated along the token axis in the given order."""
  return {name: jnp.concatenate([p[name] for p in prefixes], axis=1) for name in ("key", "value")}


def freeze_rows(tree: dict, trainable: jax.Array) -> dict:
  """Every leaf of `tree` times `trainable` (M,) over its first axis: the updates (or gradients)
  of the pool entries that are not trained this step become exactly 0."""
  return jax.tree.map(
      lambda x: x * trainable.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype), tree)


def in_use(state: dict, limit: int) -> jax.Array:
  """The pool part trained now, () int32: the boundary counter `n_boundaries` of the state (the
  boundaries the run's switch signalled so far), capped at `limit - 1` (DualPrompt's E-prompt,
  CODA-Prompt's component block)."""
  return jnp.minimum(state["n_boundaries"], limit - 1)


TRAIN_MASKS = ("none", "task")  # a prefix method's `train_mask`: the classes of its training CE


def task_classes(state: dict, batch: dict, num_classes: int) -> jax.Array:
  """(C,) bool: the classes seen since the last boundary, this batch's included: the classes of
  the training CE under `train_mask='task'` (the prefix methods' authors' code, GT-RIPL/CODA-Prompt:
  the current task's classes), kept in the state as "task_classes"."""
  from olora_jax.methods import common  # noqa: PLC0415 (prompt_pool stays importable alone)

  return state["task_classes"] | common.classes_in(batch["labels"], batch["mask"], num_classes)


def forgetting_task_classes(hook):
  """`Method.at_boundary` `hook`, then "task_classes" emptied: a new task has shown none yet."""

  def at_boundary(state, host):
    state, host = hook(state, host)
    return {**state, "task_classes": jnp.zeros_like(state["task_classes"])}, host

  return at_boundary


def counter_hook(tx, limit: int, reset_optimizer: bool, grow):
  """`Method.at_boundary` of a pool indexed by the boundary counter: the counter moves on, the
  pool becomes `grow(state, pool, old, new)` (old, new: `in_use` before and after; equal once
  capped) and, with `reset_optimizer`, the optimizer state restarts. Jitted, the host record is
  passed through."""

  @jax.jit
  def advance(state):
    old = in_use(state, limit)
    state = {**state, "n_boundaries": state["n_boundaries"] + 1}
    new = in_use(state, limit)
    params = {**state["params"],
              "prompt_pool": grow(state, state["params"]["prompt_pool"], old, new)}
    opt_state = tx.init(params) if reset_optimizer else state["opt_state"]
    return {**state, "params": params, "opt_state": opt_state}

  return lambda state, host: (advance(state), host)
