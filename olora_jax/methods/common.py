"""What the baselines share: the trainable/frozen split, the forward pass, Adam with weight decay,
masked cross-entropy, and the state every gradient baseline starts from.

State of a gradient baseline (a dict pytree; methods add their own entries, e.g. "buffer"):

    params     the trainable tree (`method.trainable`, `split_trainable`)
    frozen     the frozen tree (the backbone for 'head', 'lora' and 'prompts'; empty for 'all')
    opt_state  optax state of `params`
    step       int32 (): train steps taken
    key        PRNG key of the run; step s draws from fold_in(key, s) (a resumed run draws the same)

All functions are pure; none takes a task id.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_collections
import optax

from olora_jax import config_keys
from olora_jax.config_keys import Constant, Key
from olora_jax.learner.online_lora import masked_mean  # noqa: F401 (shared: mean over a mask)
from olora_jax.methods import base
from olora_jax.models import lora as lora_lib
from olora_jax.models import resnet

TRAINABLE = ("all", "head", "lora", "prompts")
# Trainable entries that are not ViT weights: inputs of the forward pass (LoRA factors; the prompt
# pool of L2P and MVP, olora_jax/methods/prompt_pool.py).
ADAPTERS = ("lora", "prompt_pool")


# The meaning of a key many baseline blocks share, for a block that gives the key as a bare value;
# a block whose key means something else (a schedule's peak, a scaled rate, a class-balanced
# memory) or takes fewer values declares its own `Key(default, meaning)`.
SHARED_MEANINGS = {
    "trainable": "what the method trains: 'all' (the whole ViT with its fresh head, as the"
                 " original code) | 'head' (the head only) | 'lora' (a LoRA of rank learner.rank"
                 " on q and v, plus the head: Online-LoRA's budget)",
    "learning_rate": "Adam's learning rate, constant (> 0)",
    "weight_decay": "L2 weight added to the gradient before Adam, as PyTorch's"
                    " Adam(weight_decay=...) (>= 0; 0 = none)",
    "buffer_size": "replay memory, in samples, filled by reservoir sampling (>= 1)",
}


# The source of `trainable`'s default 'all' where a block does not declare its own.
TRAINABLE_ALL = config_keys.ours(
    "the whole network trains, as in the method's own code; 'head' and 'lora' are this"
    " project's variants at Online-LoRA's budget")
# The paper's shared training settings: buffer 500 for every replay method.
PAPER_BUFFER = config_keys.paper(500, config_keys.PAPER_SETTINGS)


def shared(value, source: config_keys.Source) -> Key:
  """A key of `SHARED_MEANINGS` with its shared meaning and the `source` of its default."""
  return Key(value, "", source)


def baseline_block(**keys) -> ml_collections.ConfigDict:
  """A baseline's config block (its module's `config()`): `trainable` ('all' unless given), then
  `keys`, each `name=Key(default, meaning, source)` (olora_jax/config_keys.py) or, for a key of
  `SHARED_MEANINGS`, `shared(default, source)` (or a bare default), taking the shared meaning.
  `trainable`: what the method trains; `weight_decay` is L2 added to the gradient before Adam
  (PyTorch's Adam(weight_decay=...)). Most defaults are the Online-LoRA paper's (appendix,
  hyperparameter table for ViT-B/16; buffer 500, Adam); each key's source says."""
  keys = {"trainable": Key("all", SHARED_MEANINGS["trainable"], TRAINABLE_ALL), **keys}
  out = {}
  for name, value in keys.items():
    if name in SHARED_MEANINGS and not isinstance(value, Key):
      value = Key(value, SHARED_MEANINGS[name])
    elif name in SHARED_MEANINGS and not value.meaning:
      value = value._replace(meaning=SHARED_MEANINGS[name])
    out[name] = value
  return config_keys.block("", **out)


LR_REFERENCE_BATCH_MEANING = (
    "the batch size the authors set their learning rates at; every rate this block says is"
    " scaled is multiplied by learner.batch_size / lr_reference_batch (the linear scaling rule,"
    " the same for every method; 0 = the rates as given, unscaled)")


def batch_scale(block, batch_size: int) -> float:
  """The factor a learning rate set by a method's authors at a batch of `lr_reference_batch` is
  multiplied by at this run's `batch_size` (the learner's global batch): batch_size /
  lr_reference_batch, the linear scaling rule (Goyal et al., 2017), for every SGD rate set at
  another batch (SLCA, EASE, SimpleCIL's first phase) and the Adam rates whose authors' code
  scales them itself (DualPrompt, HiDe-Prompt); 1.0 when `lr_reference_batch` is 0 (rates as
  given). The rule is `olora_jax.config_keys.ADAM_UNSCALED`'s note."""
  return batch_size / block.lr_reference_batch if block.lr_reference_batch else 1.0


# How often each jitted function of a baseline has been traced, by "method.function".
TRACE_COUNTS: collections.Counter = collections.Counter()


def split_trainable(params: dict, mode: str, key: jax.Array, spec, rank: int,
                    init_prompts=None) -> tuple[dict, dict]:
  """(trainable, frozen) of a full ViT tree: 'all' trains every weight (the fresh head included),
  'head' the head alone, 'lora' a fresh rank-`rank` LoRA on q and v (models/lora.py) plus the
  head, 'prompts' a fresh prompt pool `init_prompts(key)` (prompt_pool.py) plus the head. The
  trees own copies of their arrays (the train step donates the state)."""
  if mode not in TRAINABLE:
    raise ValueError(f"unknown trainable={mode!r}; use one of {TRAINABLE}")
  if (mode == "prompts") != (init_prompts is not None):
    raise ValueError(f"trainable={mode!r}: 'prompts' is the prompt methods' (l2p, mvp) split and"
                     " theirs only; use 'all', 'head' or 'lora' for the other methods")
  params = jax.tree.map(jnp.array, params)
  backbone = {k: v for k, v in params.items() if k != "head"}
  if mode == "all":  # BatchNorm's running statistics (a from-scratch ResNet) are never trained
    return ({k: v for k, v in params.items() if k != resnet.BATCH_STATS},
            {k: v for k, v in params.items() if k == resnet.BATCH_STATS})
  if mode == "head":
    return {"head": params["head"]}, backbone
  if mode == "prompts":
    return {"prompt_pool": init_prompts(key), "head": params["head"]}, backbone
  return {"lora": lora_lib.init_lora(key, spec, rank), "head": params["head"]}, backbone


def make_apply(model):
  """`apply(frozen, trainable, images, **model_kwargs) -> logits (N, C)`, whatever the split;
  `model_kwargs` go to the ViT (`prompts`, `pool`, `pre_logits`)."""

  def apply(frozen, trainable, images, **model_kwargs):
    weights = {k: v for k, v in trainable.items() if k not in ADAPTERS}
    return model.apply({"params": {**frozen, **weights}}, images, lora=trainable.get("lora"),
                       **model_kwargs)

  return apply


def with_batch_statistics(method: base.Method, model) -> base.Method:
  """`method` on a model with BatchNorm (olora_jax/models/resnet.py), or `method` itself on any
  other model. Each train step first moves the running statistics (the frozen tree's
  `batch_stats`) by a training-mode forward pass of the step's valid stream samples with the
  weights before the step, as PyTorch's BatchNorm2d does during the training forward pass (theirs
  also sees the replayed samples concatenated to the batch); every forward pass of the method's
  own step normalises with its batch's statistics. `predict` (the evaluator's) normalises with
  the running statistics."""
  if not isinstance(model, resnet.ReducedResNet):
    return method
  inner_step, inner_predict = method.train_step, method.predict

  def train_step(state, batch):
    frozen = moved_batch_statistics(model, state["frozen"], state["params"], batch["images"],
                                    batch["mask"])
    return inner_step({**state, "frozen": frozen}, batch)

  def predict(state, images):
    with resnet.running_statistics():
      return inner_predict(state, images)

  return dataclasses.replace(method, train_step=train_step, predict=predict)


def reset_batch_statistics(frozen: dict) -> dict:
  """`frozen` with BatchNorm's running statistics, if it holds any, back at their initial values
  (mean 0, variance 1): a model trained afresh (GDumb) starts from them."""
  if resnet.BATCH_STATS not in frozen:
    return frozen
  fresh = jax.tree_util.tree_map_with_path(
      lambda path, x: (jnp.ones_like(x) if path[-1].key == "var" else jnp.zeros_like(x)),
      frozen[resnet.BATCH_STATS])
  return {**frozen, resnet.BATCH_STATS: fresh}


def moved_batch_statistics(model, frozen: dict, params: dict, images, mask) -> dict:
  """`frozen` with its running statistics moved by one training-mode forward pass of `images`'
  valid rows (`mask`) with `params`; `frozen` itself when it holds none."""
  if resnet.BATCH_STATS not in frozen:
    return frozen
  weights = {k: v for k, v in params.items() if k not in ADAPTERS}
  _, moved = model.apply({"params": {**frozen, **weights}}, images, pre_logits=True,
                         update_statistics=True, mask=mask)  # the head moves no statistics
  return {**frozen, resnet.BATCH_STATS: moved}


def task_slots(ctx: base.Context, block) -> int:
  """The number of tasks a boundary-aware method allocates for (its branches, directions or
  prompts, indexed by a boundary counter in its state): `block.n_tasks`, or data.n_tasks when
  that is 0 (the default)."""
  return block.n_tasks or ctx.config.data.n_tasks


def make_adam(learning_rate, weight_decay: float, clip_norm: float = 0.0
              ) -> optax.GradientTransformation:
  """Adam with L2 weight decay added to the gradient before the moments, as PyTorch's
  `Adam(weight_decay=...)` that the baselines' original code uses (not AdamW's decoupled decay);
  optional clipping of the raw gradient's global norm first. `learning_rate` may be a schedule."""
  parts = [optax.clip_by_global_norm(clip_norm)] if clip_norm > 0 else []
  if weight_decay > 0:
    parts.append(optax.add_decayed_weights(weight_decay))
  parts.append(optax.adam(learning_rate))
  return optax.chain(*parts)


def make_sgd(learning_rate, weight_decay: float, momentum: float = 0.9
             ) -> optax.GradientTransformation:
  """PyTorch's SGD with momentum and L2 weight decay added to the gradient (SLCA's and EASE's
  authors' optimiser): v <- momentum v + (grad + weight_decay theta), theta <- theta - lr v.
  `momentum` 0: plain SGD, theta <- theta - lr (grad + weight_decay theta)."""
  parts = [optax.add_decayed_weights(weight_decay)] if weight_decay > 0 else []
  return optax.chain(*parts, optax.sgd(learning_rate, momentum=momentum or None))


OPTIMIZERS = ("adam", "sgd")  # a block's `optimizer` key, where it has one


def optimizer_and_apply(ctx, block) -> tuple[optax.GradientTransformation, object]:
  """(tx, apply) of a baseline: Adam with its block's `learning_rate` and `weight_decay`
  (`make_adam`), or plain SGD (`make_sgd`, no momentum) where the block has `optimizer='sgd'`,
  and the split-aware forward pass of the run's model (`make_apply`)."""
  if block.get("optimizer", "adam") == "sgd":
    return make_sgd(block.learning_rate, block.weight_decay, momentum=0.0), make_apply(ctx.model)
  return make_adam(block.learning_rate, block.weight_decay), make_apply(ctx.model)


def train_step(name: str):
  """A decorator for a method's train step `(state, batch) -> (state, metrics, report)`; the
  decorated step is the same function, but each trace is counted in
  TRACE_COUNTS["<name>.train_step"] and a batch carrying anything but images, labels and mask is
  refused (base.check_batch: the learner is task-free)."""

  def decorate(step):
    @functools.wraps(step)
    def checked(state, batch):
      TRACE_COUNTS[f"{name}.train_step"] += 1
      base.check_batch(batch)
      return step(state, batch)

    return checked

  return decorate


ABSENT_LOGIT = -1e9  # the logit of a class left out of a softmax (exp underflows to exactly 0)


def restrict_logits(logits: jax.Array, classes: jax.Array) -> jax.Array:
  """logits (N, C) with the classes outside `classes` (C,) bool set to ABSENT_LOGIT: a softmax
  over the result is the softmax over `classes` alone; finite, so no inf reaches a gradient."""
  return jnp.where(classes, logits, ABSENT_LOGIT)


def classes_in(labels: jax.Array, mask: jax.Array, num_classes: int) -> jax.Array:
  """(C,) bool: the classes of the valid items (labels (N,), mask (N,))."""
  return jnp.any(jax.nn.one_hot(labels, num_classes, dtype=bool) & mask[:, None], axis=0)


def per_example_ce(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """(N,) float32 softmax cross-entropy of each item's logits (N, C) against its integer label
  (padded items included: mask them with `masked_mean`)."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def cosine_logits(features: jax.Array, kernel: jax.Array, scale: float, eps: float) -> jax.Array:
  """A cosine classifier without bias (ER-ACE's authors' `distLinear`): features (N, D), kernel
  (D, C) -> scale * (features / (norm(features) + eps)) @ (kernel / (norm(kernel column) + eps)),
  (N, C), with norm the L2 norm; `eps` is added to each norm (not a floor), as theirs. A zero
  vector (a padded row's features) has norm 0 and gradient 0 through it, as PyTorch's
  `torch.norm`, not NaN."""
  f = features / (_l2_norm(features, axis=-1) + eps)
  w = kernel / (_l2_norm(kernel, axis=0) + eps)
  return scale * (f @ w)


def _l2_norm(x: jax.Array, axis: int) -> jax.Array:
  """sqrt(sum x^2) along `axis` (kept), with a zero gradient where it is 0."""
  squares = jnp.sum(x * x, axis=axis, keepdims=True)
  positive = squares > 0
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, squares, 1.0)), 0.0)


AS_LEARNER_BATCH = 0  # `replay_batch` = 0: replay as many samples per step as the learner's batch
CONSTANTS = {
    "ABSENT_LOGIT": Constant("the logit of a class left out of a softmax",
                             config_keys.ours("-1e9, low enough that its exp underflows to"
                                              " exactly 0 in float32 beside any real logit")),
    "AS_LEARNER_BATCH": Constant("the replay_batch that replays the learner's batch size",
                                 config_keys.ours("0, a count no replay takes otherwise")),
}


def replay_batch(ctx: base.Context, block) -> int:
  """The replay samples per draw of a replay baseline: `block.replay_batch`, or the learner's
  batch size (`learner.batch_size`) when it is AS_LEARNER_BATCH (0), as Mammoth's DER++ does
  (its replay batch defaults to the batch size)."""
  return ctx.batch_size if block.replay_batch == AS_LEARNER_BATCH else block.replay_batch


def init_state(key: jax.Array, params: dict, mode: str, spec, rank: int,
               tx: optax.GradientTransformation, init_prompts=None) -> dict:
  """The common state of a gradient baseline (module docstring)."""
  lora_key, key = jax.random.split(key)
  trainable, frozen = split_trainable(params, mode, lora_key, spec, rank, init_prompts)
  return state_of(trainable, frozen, tx, key)


def state_of(trainable: dict, frozen: dict, tx: optax.GradientTransformation,
             key: jax.Array) -> dict:
  """The common state (module docstring) of given trainable and frozen trees, before step 0."""
  return {"params": trainable, "frozen": frozen, "opt_state": tx.init(trainable),
          "step": jnp.zeros((), jnp.int32), "key": key}


def step_key(state: dict) -> jax.Array:
  """This step's key: fold_in(run key, step)."""
  return jax.random.fold_in(state["key"], state["step"])


def apply_gradients(state: dict, grads: dict, tx: optax.GradientTransformation,
                    freeze=None) -> dict:
  """One optimizer step on `state["params"]`; counts the step. `freeze(updates) -> updates`, if
  given, zeroes the updates of what must not move this step (DualPrompt's other E-prompts,
  CODA-Prompt's earlier component blocks: weight decay or Adam's moments would move them)."""
  updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
  if freeze is not None:
    updates = freeze(updates)
  return {**state, "params": optax.apply_updates(state["params"], updates),
          "opt_state": opt_state, "step": state["step"] + 1}


def tree_dot(a, b) -> jax.Array:
  """Sum over every leaf of a * b (the dot product of two flattened pytrees)."""
  return sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


# What the training-free methods on frozen pretrained features share (simplecil, slda, ranpac).


def backbone(params: dict) -> dict:
  """The ViT tree without its head, as owned copies: the frozen feature extractor of a method that
  never trains the network (the features are `model.apply(..., pre_logits=True)`)."""
  return {k: jax.tree.map(jnp.array, v) for k, v in params.items() if k != "head"}


def frozen_features(model):
  """`features(frozen, images) -> (N, D)` float32: the frozen ViT's pooled class token (after the
  final LayerNorm), no gradient."""

  def features(frozen, images):
    return jax.lax.stop_gradient(model.apply({"params": frozen}, images, pre_logits=True))

  return features


def class_one_hot(labels: jax.Array, mask: jax.Array, num_classes: int) -> jax.Array:
  """(N, C) float32 one-hot of the labels, rows of masked (padded) items all zero."""
  return jax.nn.one_hot(labels, num_classes, dtype=jnp.float32) * mask[:, None]


def prequential_loss(scores: jax.Array, class_counts: jax.Array, batch: dict) -> jax.Array:
  """Masked mean CE of the batch under `scores` (N, C), the classifier's raw scores BEFORE the batch
  updated it: over the classes seen before (`class_counts` > 0) and the batch's own classes (a
  class met for the first time enters with the score of an empty class, 0, so the loss stays
  finite and a new class costs about the best seen score)."""
  live = (class_counts > 0) | classes_in(batch["labels"], batch["mask"], scores.shape[-1])
  return masked_mean(per_example_ce(restrict_logits(scores, live), batch["labels"]),
                     batch["mask"])
