"""Online-LoRA's numerics: the train step, importance, and the merge at a plateau.

Every function here is pure and jitted once per run (`make_learner`); the host loop in
`olora_jax.trainer` decides *when* to call them. Notation follows the paper (eqs. 4-7):

    L = CE(F(X), Y) + CE(F(X_B), Y_B) + L_LoRA,
    L_LoRA = lambda/2 * sum_l sum(Omega^{A,l} * (W^{A,l})^2) + sum(Omega^{B,l} * (W^{B,l})^2)

with (X, Y) the current batch, (X_B, Y_B) the hard buffer, W^{A,l}, W^{B,l} the *current*
trainable LoRA factors (`lora_a`, `lora_b`), and Omega the running mean of the importance
measured at every plateau so far. Only the LoRA factors and the classifier head are trained;
the backbone, with every previous LoRA merged into it, is `frozen` and is an argument of every
function (it changes at each merge), never a closure constant.

Where the paper and the authors' released code differ (docs/fidelity.md), `LearnerConfig`
has one field per difference (set from `config.fidelity` by `olora_jax.fidelity.resolve`):
`buffer_unit` (K samples or K whole batches), `window_value` (CE(buffer) as a mean over valid
samples or a sum over the K entries), `importance` (empirical Fisher or one squared gradient of a
flattened softmax), `merge` (exact W += BA, or factor sums into a frozen pair kept in
`frozen[FROZEN_LORA]`), `new_lora_init` and `reset_opt_state_at_merge`.

The hard-buffer update (paper step 5) is its own jitted function, `update_buffer`, called by the
host after the plateau decision: at a plateau, `consolidate` measures importance on the buffer
this very step trained on (step 4 before step 5, docs/method.md), and only then does the
buffer take in the step's hardest items. The buffer never leaves the device.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax

from olora_jax import fidelity
from olora_jax.learner import buffer as buffer_lib
from olora_jax.learner import optim
from olora_jax.models import lora as lora_lib
from olora_jax.models.vit import VisionTransformer, ViTSpec

# How often each jitted function has been traced, by name (tests assert one trace per run).
TRACE_COUNTS: collections.Counter = collections.Counter()


# Key of the `factor_sum` merge's frozen LoRA pair (A_old, B_old) inside the frozen tree.
FROZEN_LORA = "frozen_lora"

BATCH_KEYS = frozenset({"images", "labels", "mask"})


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  """Numerics of the learner. Defaults are the paper's; `reference` values in comments."""

  rank: int = 4
  reg_lambda: float = 2000.0  # the paper's lambda
  hard_loss: bool = True  # include CE(hard buffer) in the objective (paper eq. 6)
  reset_opt_state_at_merge: bool = True  # fresh optimizer state for each new LoRA (ref: False)
  buffer_unit: str = "sample"  # K samples | 'batch': K whole batches
  window_value: str = "mean"  # CE(buffer) mean over valid samples | 'sum' over the K entries
  importance: str = "fisher"  # per-sample Fisher | 'flat_softmax': entry 0, flattened softmax
  merge: str = "exact"  # W += B A | 'factor_sum': A_old += A, B_old += B
  new_lora_init: str = "kaiming"  # A kaiming-uniform, B = 0 | 'zeros': A = B = 0

  def __post_init__(self):
    for name in ("buffer_unit", "window_value", "importance", "merge", "new_lora_init"):
      allowed = fidelity.ALLOWED_VALUES[("learner", name)]
      if getattr(self, name) not in allowed:
        raise ValueError(f"unknown learner.{name}={getattr(self, name)!r}; use one of {allowed}")


@flax.struct.dataclass
class TrainState:
  """Everything the jitted functions update, apart from the frozen weights and the buffer."""

  trainable: dict  # {"lora": LoRATree, "head": {"kernel" (D, C), "bias" (C,)}}
  opt_state: dict  # {"lora": ..., "head": ...}: one optax state per trainable group
  omega: dict  # LoRATree of importance weights (paper's Omega^{A,l}, Omega^{B,l})
  n_plateaus: jax.Array  # int32 (): the paper's k, plateaus consolidated so far
  step: jax.Array  # int32 (): train steps taken
  key: jax.Array  # PRNG key; new LoRA k is initialised from fold_in(key, k)


class Learner(NamedTuple):
  """The jitted functions of one run. None of them takes a task id or a task boundary: the
  stream reaches the learner only as batches {"images", "labels", "mask"}."""

  train_step: Callable  # (state, frozen, buffer, batch) -> (state, scalars, scores)
  update_buffer: Callable  # (buffer, batch, scores) -> buffer
  consolidate: Callable  # (state, frozen, buffer) -> (state, frozen)
  predict: Callable  # (state, frozen, images) -> logits


def split_params(params: dict) -> tuple[dict, dict]:
  """Splits a full ViT param tree into (frozen backbone, head)."""
  frozen = {k: v for k, v in params.items() if k != "head"}
  return frozen, params["head"]


def init_frozen(backbone: dict, spec: ViTSpec, config: LearnerConfig,
                frozen_lora: lora_lib.LoRATree | None = None) -> dict:
  """The frozen tree of a run: the backbone, plus the frozen LoRA pair of `factor_sum` (zeros,
  or `frozen_lora`, e.g. read from the authors' checkpoint). With the `exact` merge a given
  `frozen_lora` is merged into the backbone (W += B_old A_old: the same function)."""
  if config.merge == "factor_sum":
    if frozen_lora is None:
      frozen_lora = lora_lib.zeros_like_lora(spec, config.rank)
    return {**backbone, FROZEN_LORA: jax.tree.map(jnp.array, frozen_lora)}
  if frozen_lora is not None:
    return lora_lib.merge_into_backbone(backbone, frozen_lora)
  return backbone


def init_buffer(config: LearnerConfig, size: int, batch_size: int,
                image_shape: tuple[int, ...]) -> buffer_lib.Buffer:
  """An empty hard buffer of K = `size` samples or K whole batches (`config.buffer_unit`)."""
  if config.buffer_unit == "batch":
    return buffer_lib.init_batch_buffer(size, batch_size, image_shape)
  return buffer_lib.init_buffer(size, image_shape)


def init_train_state(key: jax.Array, head: dict, spec: ViTSpec, config: LearnerConfig,
                     tx: optax.GradientTransformation,
                     lora: lora_lib.LoRATree | None = None) -> TrainState:
  """The learner's state before step 0: the first LoRA drawn from `key` (kaiming `lora_a`
  (D, r), zero `lora_b` (r, D) for q and v of every block), or the given `lora`
  (`learner.initial_lora`; the later LoRAs still come from `key`, as without it); a copy of
  `head` ({"kernel" (D, C), "bias" (C,)}), `tx`'s state for both, Omega = 0, k = 0, step 0.
  Pure."""
  lora_key, key = jax.random.split(key)
  if lora is None:
    lora = lora_lib.init_lora(lora_key, spec, config.rank)
  lora = jax.tree.map(jnp.array, lora)
  # The state owns its arrays (train_step donates it): copy the head instead of aliasing it.
  trainable = {"lora": lora, "head": jax.tree.map(jnp.array, head)}
  return TrainState(
      trainable=trainable,
      opt_state={name: tx.init(tree) for name, tree in trainable.items()},
      omega=jax.tree.map(jnp.zeros_like, lora),
      n_plateaus=jnp.zeros((), jnp.int32),
      step=jnp.zeros((), jnp.int32),
      key=key,
  )


def lora_regulariser(lora: dict, omega: dict, reg_lambda: float) -> jax.Array:
  """L_LoRA = lambda/2 * sum(Omega * W^2) over every current LoRA factor (anchor 0)."""
  terms = jax.tree.map(lambda o, w: jnp.sum(o * jnp.square(w)), omega, lora)
  return 0.5 * reg_lambda * sum(jax.tree.leaves(terms))


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean over `mask`; 0 when nothing is valid (an empty hard buffer adds no loss)."""
  mask = mask.astype(values.dtype)
  return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def buffer_items(buf: buffer_lib.Buffer) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The buffer's samples as one flat batch: images (N, H, W, 3), labels (N,), mask (N,), with
  N = K (sample unit) or K * B (batch unit); the mask drops empty slots and padding."""
  if isinstance(buf, buffer_lib.BatchBuffer):
    k, b = buf.labels.shape
    mask = buf.mask & buf.valid[:, None]
    return (buf.images.reshape(k * b, *buf.images.shape[2:]), buf.labels.reshape(k * b),
            mask.reshape(k * b))
  return buf.images, buf.labels, buf.valid


def buffer_entry_losses(per_example: jax.Array, buf: buffer_lib.Buffer) -> jax.Array:
  """The score of each buffer entry, (K,): its own CE (sample unit) or its batch-mean CE."""
  if isinstance(buf, buffer_lib.BatchBuffer):
    k, b = buf.labels.shape
    per_item = per_example.reshape(k, b)
    return jax.vmap(masked_mean)(per_item, buf.mask)
  return per_example


def _check_batch(batch: dict) -> None:
  if set(batch) != BATCH_KEYS:
    raise ValueError(
        f"a learner batch has exactly the keys {sorted(BATCH_KEYS)}, got {sorted(batch)}; the"
        " learner is task-free and must not receive task ids or boundaries")


def make_learner(model: VisionTransformer, tx: optax.GradientTransformation,
                 config: LearnerConfig) -> Learner:
  """Online-LoRA's four jitted, pure functions for `model`, optimizer `tx` and `config`.

  With B the batch size, K the buffer size, C the classes, (H, W) the image size:
    train_step(state, frozen, buffer, batch) -> (state, scalars, scores): one Adam step on
      CE(batch) + CE(buffer) + L_LoRA (eq. 6); `batch` = {"images" (B, H, W, 3) float32,
      "labels" (B,) int32, "mask" (B,) bool}; `scalars` = {loss, window_value, ce_current,
      ce_buffer, reg} (float32 ()); `scores` the pre-update losses of the buffer candidates,
      (B + K,) for the sample unit or (1 + K,) for the batch unit. Donates `state`.
    update_buffer(buffer, batch, scores) -> buffer: keeps the K highest-scoring candidates.
    consolidate(state, frozen, buffer) -> (state, frozen): at a plateau, importance on the
      buffer (eqs. 4-5), Omega running mean over plateaus, merge, new LoRA. Donates both.
    predict(state, frozen, images (N, H, W, 3)) -> logits (N, C). Reads only.
  Each is traced once per run (shapes are static); none takes a task id.
  """
  spec = model.spec
  buffer_type = buffer_lib.BatchBuffer if config.buffer_unit == "batch" else buffer_lib.HardBuffer

  def check_buffer(buf):
    if not isinstance(buf, buffer_type):
      raise ValueError(
          f"learner.buffer_unit={config.buffer_unit!r} needs a {buffer_type.__name__}, got a"
          f" {type(buf).__name__}; build it with online_lora.init_buffer(config, ...)")

  def apply(frozen, trainable, images):
    lora = trainable["lora"]
    if FROZEN_LORA in frozen:  # factor_sum merge: the frozen pair runs beside the current LoRA
      frozen = dict(frozen)
      lora = lora_lib.concat_adapters(lora, frozen.pop(FROZEN_LORA))
    params = {**frozen, "head": trainable["head"]}
    return model.apply({"params": params}, images, lora=lora)

  def loss_fn(trainable, frozen, omega, batch, buf):
    # ONE forward pass over the current batch and every buffer item together (B + K or
    # B + K * B images): per-example losses are independent, so each batch mean below equals
    # the loss of a separate pass over that batch alone.
    n = batch["labels"].shape[0]
    buf_images, buf_labels, buf_mask = buffer_items(buf)
    images = jnp.concatenate([batch["images"], buf_images])
    labels = jnp.concatenate([batch["labels"], buf_labels])
    logits = apply(frozen, trainable, images)
    per_example = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    ce_current = masked_mean(per_example[:n], batch["mask"])
    entry_losses = buffer_entry_losses(per_example[n:], buf)  # (K,)
    if config.window_value == "sum":  # released code: CE(current) + sum of K entry CEs
      ce_buffer = jnp.sum(jnp.where(buf.valid, entry_losses, 0.0))
    else:  # paper: mean over the valid buffer samples
      ce_buffer = masked_mean(per_example[n:], buf_mask)
    objective = ce_current + ce_buffer if config.hard_loss else ce_current
    reg = lora_regulariser(trainable["lora"], omega, config.reg_lambda)
    if config.buffer_unit == "batch":  # candidates: the current batch, then the K entries
      scores = jnp.concatenate([ce_current[None], entry_losses])  # (1 + K,)
    else:  # candidates: the B current samples, then the K entries
      scores = per_example  # (B + K,)
    aux = dict(window_value=objective, ce_current=ce_current, ce_buffer=ce_buffer, reg=reg,
               scores=scores)
    return objective + reg, aux

  def train_step(state: TrainState, frozen, buf, batch):
    TRACE_COUNTS["train_step"] += 1
    _check_batch(batch)
    check_buffer(buf)
    grads, aux = jax.grad(loss_fn, has_aux=True)(state.trainable, frozen, state.omega, batch, buf)
    trainable, opt_state = {}, {}
    for name, params in state.trainable.items():
      updates, opt_state[name] = tx.update(grads[name], state.opt_state[name], params)
      trainable[name] = optax.apply_updates(params, updates)
    scores = jax.lax.stop_gradient(aux.pop("scores"))  # pre-update losses, buffer ranking
    aux["loss"] = aux["window_value"] + aux["reg"]
    state = state.replace(trainable=trainable, opt_state=opt_state, step=state.step + 1)
    return state, aux, scores

  def fisher_importance(trainable, frozen, buf):
    """Empirical Fisher diagonal (paper eq. 3): mean over valid buffer samples of the squared
    per-sample gradient of log p(y|x) w.r.t. the current LoRA factors, y the stored label."""

    def log_likelihood(lora, image, label):
      logits = apply(frozen, {**trainable, "lora": lora}, image[None])[0]
      return jax.nn.log_softmax(logits)[label]

    images, labels, mask = buffer_items(buf)
    per_sample = jax.vmap(jax.grad(log_likelihood), in_axes=(None, 0, 0))(
        trainable["lora"], images, labels)  # each leaf (N, ...)
    weights = mask.astype(jnp.float32) / jnp.maximum(jnp.sum(mask), 1)
    return jax.tree.map(lambda g: jnp.tensordot(weights, jnp.square(g), axes=1), per_sample)

  def flat_softmax_importance(trainable, frozen, buf):
    """The released code's importance: buffer entry 0 only (a sample, or a whole batch); its
    (n, C) logits are flattened into ONE softmax over n * C values, the "label" is the argmax of
    that flat vector, and the importance is the square of the one gradient of its log-probability
    w.r.t. the current LoRA factors. Zero while entry 0 is empty (a plateau at step 0)."""
    if isinstance(buf, buffer_lib.BatchBuffer):
      images, mask, entry_valid = buf.images[0], buf.mask[0], buf.valid[0]  # (B, ...), (B,)
    else:
      images, mask, entry_valid = buf.images[:1], buf.valid[:1], buf.valid[0]  # (1, ...), (1,)

    def flat_log_likelihood(lora):
      logits = apply(frozen, {**trainable, "lora": lora}, images)  # (n, C)
      # Padded items take no part; with an empty entry keep every logit so nothing is -inf.
      keep = mask[:, None] | ~entry_valid
      flat = jnp.where(keep, logits, -jnp.inf).reshape(-1)  # (n * C,)
      target = jax.lax.stop_gradient(jnp.argmax(flat))
      return jax.nn.log_softmax(flat)[target]

    g = jax.grad(flat_log_likelihood)(trainable["lora"])
    return jax.tree.map(lambda x: jnp.where(entry_valid, jnp.square(x), 0.0), g)

  importance = (flat_softmax_importance if config.importance == "flat_softmax"
                else fisher_importance)

  def consolidate(state: TrainState, frozen, buf):
    """At a plateau: importance, Omega running mean, merge, new LoRA (paper 3.2-3.3)."""
    TRACE_COUNTS["consolidate"] += 1
    check_buffer(buf)
    g = importance(state.trainable, frozen, buf)
    k = (state.n_plateaus + 1).astype(jnp.float32)
    omega = jax.tree.map(lambda o, gk: gk / k + (1.0 - 1.0 / k) * o, state.omega, g)
    if config.merge == "factor_sum":
      frozen = {**frozen, FROZEN_LORA: lora_lib.merge_factor_sum(frozen[FROZEN_LORA],
                                                                   state.trainable["lora"])}
    else:
      frozen = lora_lib.merge_into_backbone(frozen, state.trainable["lora"])
    if config.new_lora_init == "zeros":  # released code: moves only through kept Adam state
      new_lora = lora_lib.zeros_like_lora(spec, config.rank)
    else:
      new_lora = lora_lib.init_lora(jax.random.fold_in(state.key, state.n_plateaus + 1),
                                    spec, config.rank)
    opt_state = dict(state.opt_state)
    if config.reset_opt_state_at_merge:
      opt_state["lora"] = tx.init(new_lora)
    state = state.replace(trainable={**state.trainable, "lora": new_lora}, opt_state=opt_state,
                          omega=omega, n_plateaus=state.n_plateaus + 1)
    return state, frozen

  def predict(state: TrainState, frozen, images):
    TRACE_COUNTS["predict"] += 1
    return apply(frozen, state.trainable, images)

  def update_buffer(buf, batch, scores):
    TRACE_COUNTS["update_buffer"] += 1
    _check_batch(batch)
    check_buffer(buf)
    if isinstance(buf, buffer_lib.BatchBuffer):
      return buffer_lib.update_batch_buffer(buf, batch, scores)
    return buffer_lib.update_buffer(buf, batch, scores)

  return Learner(
      train_step=jax.jit(train_step, donate_argnums=(0,)),
      update_buffer=jax.jit(update_buffer, donate_argnums=(0,)),
      consolidate=jax.jit(consolidate, donate_argnums=(0, 1)),
      predict=jax.jit(predict),
  )


def make_optimizer(learning_rate: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                   bias_correction: str = "float32") -> optax.GradientTransformation:
  """Adam with a constant learning rate, no weight decay, no clipping (paper section 4).

  `bias_correction` ('float32': `optax.adam`; 'exact': PyTorch's, `optim.adam_exact`) is the
  fidelity key `learner.adam_bias_correction`.
  """
  return optim.adam(learning_rate, bias_correction, b1=b1, b2=b2, eps=eps)
