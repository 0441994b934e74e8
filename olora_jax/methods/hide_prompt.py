"""HiDe-Prompt (Wang et al., NeurIPS 2023, "Hierarchical Decomposition of Prompt-Based Continual
Learning: Rethinking Obscured Sub-optimality"), with its task index taken from the boundary switch.

The paper splits class-incremental prediction into three parts, each of which lives here on the
frozen pretrained ViT:

  Within-task prediction (WTP). One E-prompt per task (prefix-tuning as DualPrompt's E-prompts:
  per block of `hide_prompt.e_layers`, Lp key and Lp value tokens prepended to attention's keys
  and values; `top_k` prompts a task, rows t k .. (t + 1) k - 1 of the pool for task t), trained
  with the head on the cross-entropy over the current task's classes, plus the contrastive
  regulariser against the old tasks' class prototypes:
      f = the prompted model's class token (after the final LayerNorm), for each image of the batch
      Z = [mu_c for every class c of an earlier task; f_1 .. f_B]      (prototypes, no gradient)
      L_con = mean_i CE(softmax_j(z_i . z_j / temperature), i)          (`contrastive_loss`)
      L_WTP = CE(head(f), y) + contrastive_weight * L_con
  (the authors' regulariser: every row is pushed from every other; with no earlier task, the
  batch alone). From the second task on, the live prompt enters the forward pass as
  (1 - m) e_t + m mean(e_0 .. e_{t-1}) (the earlier prompts without gradient; m =
  `prompt_momentum`), and at the task's end e_t is overwritten by that mixture
  (`effective_prompts`).

  Task-identity inference (TII). An auxiliary output layer on the frozen, prompt-free pretrained
  representation q(x) (the query of the prompt methods): a residual MLP (D -> r D -> D, GELU,
  then LayerNorm) and a C-way linear layer, trained on the current task's classes (`tii_logits`).
  At test time its class prediction over the classes seen names the task (the task the class was
  first seen in), whose prompt the image takes. Its alignment on the stored class statistics of
  q(x) (below) is what makes it compare old tasks' classes with new ones.

  Task-adaptive prediction (TAP). Each class's mean and covariance of the prompted features f
  (under its task's prompt) are stored; the head is re-aligned on features drawn from every seen
  class's Gaussian N(mu_c, Sigma_c + 1e-4 I): SGD (momentum 0.9, weight decay 5e-4) for
  `tap_epochs` epochs of `tap_samples_per_class` draws per class, the rate cosine-annealed
  (`slca.align_head`, SLCA's alignment without its logit normalisation and mean decay). The TII
  layer is aligned the same way on the statistics of q(x) (`tii_alignment_*`).

Online: the class statistics are running ones (SLCA's pairwise merge, `slca.absorb_statistics`),
each sample's entering in the step that trains on it, the prompted features under the live prompt
as it stood before the step's update; those of q(x) are exact (the backbone is frozen). Both
alignments run in `eval_state` on copies (`align='every_evaluation'`, once two classes are
seen), so the evaluator reads the aligned layers and training goes on with its own.

Boundaries (`at_boundary`, from the run's switch, as DualPrompt's): a boundary ends task t: its
prompt takes the momentum mixture, the next task's prompt starts as a copy of it
(`init_from_previous`, the authors' shared_prompt_pool), the classes met afterwards are the new
task's and Adam restarts (`reset_optimizer`). Past the pool's pool_size // top_k tasks the last
task's prompt stays live. With `boundaries.rule='none'` the stream is one task: one prompt, the
head and the TII layer over every class seen, and TII has one task to name.

Readings (docs/methods/hide_prompt.md lists them with the paper and the authors' code): one pass
with the authors' first-epoch rates (their WTP runs 50 epochs, their TII 20); the TII layer
trained in the same step as the prompts (the authors train it first, in a separate run); full
covariances (the authors' default keeps 10 k-means centroids per class with diagonal variances);
running statistics; a class's task is the one it was first seen in.

Cost: 2 forward passes per image to predict and per train step (the query and the prompted
pass); the statistics are 2 x C x D x D float32; an evaluation factors 2 C covariances and runs
(tap_epochs + tii_alignment_epochs) x (classes seen) SGD steps on drawn features.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from olora_jax.config_keys import Constant, Key, authors, ours
from olora_jax.methods import base, common, dualprompt, prompt_pool, slca

HIDE = "thu-ml/HiDe-Prompt"  # the authors' released code, where the defaults come from
HIGHEST = jax.lax.Precision.HIGHEST
ALIGNMENTS = ("every_evaluation", "none")
INIT_BOUND = 1.0  # prompts start uniform in [-1, 1] (the authors' initialiser)
MLP_INIT_STD = 0.02  # the TII layer's weights: truncated normal, std 0.02 (timm's), biases 0
LAYER_NORM_EPS = 1e-6  # timm's ViT LayerNorm
CONSTANTS = {
    "INIT_BOUND": Constant("E-prompts start uniform in [-INIT_BOUND, INIT_BOUND]",
                           authors(1.0, f"{HIDE}: the prompts' uniform initialiser in [-1, 1]")),
    "MLP_INIT_STD": Constant("the TII layer's weights: truncated normal with this std",
                             authors(0.02, f"{HIDE}: timm's linear initialisation, std 0.02")),
    "LAYER_NORM_EPS": Constant("the TII layer's LayerNorm eps",
                               authors(1e-6, f"{HIDE}: timm's ViT LayerNorm, eps 1e-6")),
}


def init_prompts(key: jax.Array, block, width: int) -> dict:
  """{"e_prompts" (M, |e_layers|, 2, Lp, D)} uniform in [-1, 1]."""
  return {"e_prompts": jax.random.uniform(
      key, (block.pool_size, len(block.e_layers), 2, block.prompt_length, width), jnp.float32,
      -INIT_BOUND, INIT_BOUND)}


def init_tii(key: jax.Array, width: int, hidden_ratio: int, head: dict) -> dict:
  """The TII output layer: {"mlp": {"hidden", "out", "norm"}, "head"} (the residual MLP of
  `hidden_ratio` * D hidden units; none when 0) and a C-way linear head starting as `head`."""
  layer = {"head": jax.tree.map(jnp.array, head)}
  if hidden_ratio == 0:
    return layer
  h_key, o_key = jax.random.split(key)
  hidden = hidden_ratio * width

  def normal(k, shape):
    return MLP_INIT_STD * jax.random.truncated_normal(k, -2.0, 2.0, shape, jnp.float32)

  layer["mlp"] = {"hidden": {"kernel": normal(h_key, (width, hidden)),
                             "bias": jnp.zeros((hidden,), jnp.float32)},
                  "out": {"kernel": normal(o_key, (hidden, width)),
                          "bias": jnp.zeros((width,), jnp.float32)},
                  "norm": {"scale": jnp.ones((width,), jnp.float32),
                           "bias": jnp.zeros((width,), jnp.float32)}}
  return layer


def linear(layer: dict, x: jax.Array) -> jax.Array:
  return jnp.matmul(x, layer["kernel"].astype(x.dtype), precision=HIGHEST) + layer["bias"]


def tii_logits(layer: dict, features: jax.Array) -> jax.Array:
  """The TII layer's class logits (N, C) of frozen features (N, D): the residual MLP
  x + W2 gelu(W1 x), LayerNorm, then the linear head."""
  x = features
  if "mlp" in layer:
    mlp = layer["mlp"]
    h = x + linear(mlp["out"], jax.nn.gelu(linear(mlp["hidden"], x), approximate=False))
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
    x = (h - mean) * jax.lax.rsqrt(var + LAYER_NORM_EPS) * mlp["norm"]["scale"]
    x = x + mlp["norm"]["bias"]
  return linear(layer["head"], x)


def effective_prompts(e_prompts: jax.Array, live: jax.Array, top_k: int,
                      momentum: float) -> jax.Array:
  """The pool (M, ...) with task `live`'s rows as the forward pass sees them: for live > 0,
  (1 - m) e_row + m mean of the earlier tasks' rows (no gradient through the mean); unchanged for
  task 0 or m = 0 (the authors' prompt momentum)."""
  if momentum == 0:
    return e_prompts
  rows = jnp.arange(e_prompts.shape[0])
  before = (rows < live * top_k).astype(e_prompts.dtype)
  shape = (-1,) + (1,) * (e_prompts.ndim - 1)
  mean = jax.lax.stop_gradient(jnp.sum(e_prompts * before.reshape(shape), axis=0)
                               / jnp.maximum(jnp.sum(before), 1.0))
  mixed = (rows >= live * top_k) & (rows < (live + 1) * top_k) & (live > 0)
  return jnp.where(mixed.reshape(shape), (1.0 - momentum) * e_prompts + momentum * mean,
                   e_prompts)


def contrastive_loss(features: jax.Array, mask: jax.Array, prototypes: jax.Array,
                     old: jax.Array, temperature: float) -> jax.Array:
  """The WTP regulariser: Z = [prototypes of the `old` (C,) classes; the batch's valid features],
  mean over Z's rows i of CE(softmax_j(z_i . z_j / temperature), i) (the prototypes carry no
  gradient; masked rows and columns take no part)."""
  z = jnp.concatenate([jax.lax.stop_gradient(prototypes), features], axis=0)
  valid = jnp.concatenate([old, mask.astype(bool)])
  sim = jnp.matmul(z, z.T, precision=HIGHEST) / temperature
  sim = common.restrict_logits(sim, valid[None, :])
  ce = common.per_example_ce(sim, jnp.arange(z.shape[0]))
  return common.masked_mean(ce, valid)


def task_of(tii_scores: jax.Array, seen: jax.Array, class_task: jax.Array) -> jax.Array:
  """(N,) int32: the task TII names for each image, the task of its best-scoring seen class."""
  return class_task[jnp.argmax(common.restrict_logits(tii_scores, seen), axis=-1)]


def task_rows(task: jax.Array, top_k: int) -> jax.Array:
  """The pool rows (N, top_k) of each image's task (N,)."""
  return task[:, None] * top_k + jnp.arange(top_k)[None, :]


def optimizer(block, batch_size: int) -> optax.GradientTransformation:
  """Two Adams, each clipped to `clip_norm` on its own gradient (the authors train two models):
  WTP's, over the prompts at `learning_rate` and the head at `learning_rate * head_lr_scale`,
  and TII's at `tii_learning_rate`, the rates given for a batch of `lr_reference_batch`."""
  scale = common.batch_scale(block, batch_size)
  clip = [optax.clip_by_global_norm(block.clip_norm)] if block.clip_norm > 0 else []
  decay = [optax.add_decayed_weights(block.weight_decay)] if block.weight_decay > 0 else []
  wtp = optax.chain(*clip, *decay, optax.multi_transform(
      {"prompts": optax.adam(block.learning_rate * scale),
       "head": optax.adam(block.learning_rate * block.head_lr_scale * scale)},
      {"prompt_pool": "prompts", "head": "head"}))
  tii = common.make_adam(block.tii_learning_rate * scale, 0.0, block.clip_norm)

  def parts(tree):
    return {"prompt_pool": tree["prompt_pool"], "head": tree["head"]}, tree["tii"]

  def init(params):
    w, t = parts(params)
    return {"wtp": wtp.init(w), "tii": tii.init(t)}

  def update(grads, state, params=None):
    (gw, gt), (pw, pt) = parts(grads), parts(params)
    uw, sw = wtp.update(gw, state["wtp"], pw)
    ut, st = tii.update(gt, state["tii"], pt)
    return {**uw, "tii": ut}, {"wtp": sw, "tii": st}

  return optax.GradientTransformation(init, update)


def build(ctx: base.Context) -> base.Method:
  block = ctx.config.hide_prompt
  if block.align not in ALIGNMENTS:
    raise ValueError(f"unknown hide_prompt.align={block.align!r}; use one of {ALIGNMENTS}")
  tx = optimizer(block, ctx.batch_size)
  apply = common.make_apply(ctx.model)
  e_layers, k, m = tuple(block.e_layers), block.top_k, block.pool_size
  n_slots, num_classes = m // k, ctx.num_classes

  def live_task(state):
    return jnp.minimum(state["n_boundaries"], n_slots - 1)

  def features(frozen, e_prompts, images, idx):
    """The prompted model's class token (N, D) with the prompts of rows idx (N, top_k)."""
    return apply(frozen, {}, images, pre_logits=True, prefixes=dualprompt.prefixes(
        {"e_prompts": e_prompts}, idx, (), e_layers))

  def init(key, params):
    prompt_key, tii_key, key = jax.random.split(key, 3)
    trainable, frozen = common.split_trainable(
        params, "prompts", prompt_key, ctx.spec, ctx.config.learner.rank,
        init_prompts=lambda kk: init_prompts(kk, block, ctx.spec.width))
    dim = params["head"]["kernel"].shape[0]
    trainable["tii"] = init_tii(tii_key, dim, block.tii_hidden_ratio, params["head"])
    state = common.state_of(trainable, frozen, tx, key)
    stats = {"counts": jnp.zeros((num_classes,), jnp.float32)}
    for name in ("", "tii_"):
      stats[f"{name}means"] = jnp.zeros((num_classes, dim), jnp.float32)
      stats[f"{name}scatter"] = jnp.zeros((num_classes, dim, dim), jnp.float32)
    return {**state, **stats, "class_task": jnp.zeros((num_classes,), jnp.int32),
            "current": jnp.zeros((num_classes,), bool),
            "n_boundaries": jnp.zeros((), jnp.int32)}

  @common.train_step("hide_prompt")
  def train_step(state, batch):
    t = live_task(state)
    images, labels, mask = batch["images"], batch["labels"], batch["mask"]
    queries = prompt_pool.query(apply, state["frozen"], images)
    idx = jnp.broadcast_to(task_rows(t[None], k), (images.shape[0], k))
    in_batch = common.classes_in(labels, mask, num_classes)
    current = state["current"] | in_batch
    old = (state["counts"] > 0) & (state["class_task"] < t)  # the earlier tasks' classes

    def loss_fn(params):
      e = effective_prompts(params["prompt_pool"]["e_prompts"], t, k, block.prompt_momentum)
      f = features(state["frozen"], e, images, idx)
      ce = common.masked_mean(common.per_example_ce(
          common.restrict_logits(linear(params["head"], f), current), labels), mask)
      con = contrastive_loss(f, mask, state["means"], old, block.contrastive_temperature)
      tii_ce = common.masked_mean(common.per_example_ce(
          common.restrict_logits(tii_logits(params["tii"], queries), current), labels), mask)
      loss = ce + block.contrastive_weight * con + tii_ce
      return loss, (dict(ce=ce, contrastive=con, tii_ce=tii_ce), jax.lax.stop_gradient(f))

    (loss, (aux, f)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    live_rows = (jnp.arange(m) // k == t).astype(jnp.float32)

    def freeze(updates):  # only the live task's prompts move
      return {**updates, "prompt_pool": prompt_pool.freeze_rows(updates["prompt_pool"],
                                                                live_rows)}

    new = in_batch & (state["counts"] == 0)
    counts, means, scatter = slca.absorb_statistics(
        state["counts"], state["means"], state["scatter"], f.astype(jnp.float32), labels, mask)
    _, tii_means, tii_scatter = slca.absorb_statistics(
        state["counts"], state["tii_means"], state["tii_scatter"], queries.astype(jnp.float32),
        labels, mask)
    state = common.apply_gradients(state, grads, tx, freeze)
    state = {**state, "counts": counts, "means": means, "scatter": scatter,
             "tii_means": tii_means, "tii_scatter": tii_scatter, "current": current,
             "class_task": jnp.where(new, t, state["class_task"])}
    return state, {"loss": loss, **aux, "e_prompt": t, "n_classes": jnp.sum(counts > 0)}, {}

  def aligned(state, layer, means, factors, logits_fn, salt, per_class, epochs, rate):
    """`layer` after alignment on features drawn from every seen class's Gaussian N(means_c,
    factors_c factors_c^T)."""
    seen = state["counts"] > 0
    key = jax.random.fold_in(jax.random.fold_in(state["key"], state["step"]), salt)

    def ce(layer, f, y, valid):
      logits = common.restrict_logits(logits_fn(layer, f), seen)
      return common.masked_mean(common.per_example_ce(logits, y), valid)

    return slca.align_head(layer, ce, key, means, factors, seen, per_class, epochs, rate,
                           block.alignment_weight_decay)

  def eval_state(state):
    """What the evaluator reads: the state with its head (TAP) and TII layer aligned (copies)."""
    common.TRACE_COUNTS["hide_prompt.eval_state"] += 1
    params = state["params"]

    def align_both(state):
      # Both sets of covariances in ONE factorisation: two Cholesky kernels running at once can
      # each hold a thread of XLA:CPU's pool while waiting for the other's (a hang on 2 cores).
      covariances = jnp.concatenate([
          slca.class_covariances(state["counts"], scatter, block.covariance_shrinkage)
          for scatter in (state["scatter"], state["tii_scatter"])])
      factors = jnp.split(jnp.linalg.cholesky(covariances), 2)
      scale = common.batch_scale(block, ctx.batch_size)
      head = aligned(state, params["head"], state["means"], factors[0], linear, 1,
                     block.tap_samples_per_class, block.tap_epochs, block.tap_learning_rate)
      tii = aligned(state, params["tii"], state["tii_means"], factors[1], tii_logits, 2,
                    block.tii_samples_per_class, block.tii_alignment_epochs,
                    block.tii_alignment_learning_rate * scale)
      return head, tii

    enough = jnp.sum(state["counts"] > 0) >= 2
    head, tii = jax.lax.cond(enough, align_both, lambda s: (params["head"], params["tii"]), state)
    return {"frozen": state["frozen"], "params": {**params, "head": head, "tii": tii},
            **{name: state[name] for name in ("counts", "class_task", "n_boundaries")}}

  def predict(state, images):
    params, seen = state["params"], state["counts"] > 0
    queries = prompt_pool.query(apply, state["frozen"], images)
    task = task_of(tii_logits(params["tii"], queries), seen, state["class_task"])
    e = effective_prompts(params["prompt_pool"]["e_prompts"], live_task(state), k,
                          block.prompt_momentum)
    f = features(state["frozen"], e, images, task_rows(task, k))
    return common.restrict_logits(linear(params["head"], f), seen)

  @jax.jit
  def boundary(state):
    """Task t ends: its prompt keeps the momentum mixture, the next task's starts as a copy of it,
    the next classes are the new task's; Adam restarts."""
    common.TRACE_COUNTS["hide_prompt.at_boundary"] += 1
    old = live_task(state)
    state = {**state, "n_boundaries": state["n_boundaries"] + 1}
    new = live_task(state)
    e = effective_prompts(state["params"]["prompt_pool"]["e_prompts"], old, k,
                          block.prompt_momentum)
    if block.init_from_previous:
      e = e.at[new * k + jnp.arange(k)].set(e[old * k + jnp.arange(k)])
    params = {**state["params"], "prompt_pool": {"e_prompts": e}}
    opt_state = tx.init(params) if block.reset_optimizer else state["opt_state"]
    return {**state, "params": params, "opt_state": opt_state,
            "current": jnp.zeros_like(state["current"])}

  return base.Method(name="hide_prompt", init=init, train_step=train_step, predict=predict,
                     eval_state=None if block.align == "none" else jax.jit(eval_state),
                     eval_state_keys=("hide_prompt.tap_learning_rate",
                                      "hide_prompt.tii_alignment_learning_rate"),
                     at_boundary=lambda state, host: (boundary(state), host))


def config():
  """The `hide_prompt` block: the authors' ViT-B/16 Split CIFAR-100 script (their
  train_cifar100_vit.sh and config; docs/methods/hide_prompt.md)."""
  return common.baseline_block(
      trainable=Key("prompts", "'prompts', the only value: the task prompts, the head and the TII"
                    " layer, on the frozen backbone",
                    authors("prompts", f"{HIDE}, trainers/hideprompt_trainer.py: the frozen"
                                       " backbone")),
      learning_rate=Key(0.03, "Adam's rate of the prompts for a batch of lr_reference_batch,"
                        " scaled linearly to learner.batch_size, constant (> 0; the authors'"
                        " 0.03)",
                        authors(0.03, f"{HIDE}, configs/cifar100_hideprompt_5e.py: --lr (times"
                                      " the per-device batch / 256)", batch=256)),
      head_lr_scale=Key(0.1, "the head's Adam rate is learning_rate times this (> 0; the"
                        " authors' larger_prompt_lr: 0.1)",
                        authors(0.1, f"{HIDE}, trainers/hideprompt_trainer.py: larger_prompt_lr")),
      lr_reference_batch=Key(256, "the batch every Adam rate (and tii_alignment_learning_rate)"
                             " is given for (the authors' 256); 0 = the rates unscaled",
                             authors(256, f"{HIDE}, trainers/hideprompt_trainer.py: the rate"
                                          " times the batch / 256 (unscale_lr)")),
      weight_decay=common.shared(0.0, authors(0.0, f"{HIDE}, configs/cifar100_hideprompt_5e.py:"
                                                   " --weight-decay")),
      clip_norm=Key(1.0, "each of the two models' gradients (WTP's, TII's) is clipped to this"
                    " global norm (>= 0; 0 = no clipping; the authors' 1.0)",
                    authors(1.0, f"{HIDE}, configs/cifar100_hideprompt_5e.py: --clip-grad")),
      e_layers=Key((0, 1, 2, 3, 4), "blocks that take the task prompt's prefix, indices <"
                   " model.depth (the authors': 0-4 of ViT-B's 12)",
                   authors((0, 1, 2, 3, 4), f"{HIDE}, configs/cifar100_hideprompt_5e.py:"
                                            " --e_prompt_layer_idx")),
      prompt_length=Key(5, "Lp, prompt tokens per block, for keys and for values each (>= 1;"
                        " the authors' script: 5)",
                        authors(5, f"{HIDE}, training_scripts/train_cifar100_vit.sh: --length")),
      pool_size=Key(10, "M, prompts in the pool; task t trains prompts t k .. (t + 1) k - 1,"
                    " past M // k tasks the last task's (>= 1)",
                    authors(10, f"{HIDE}, configs/cifar100_hideprompt_5e.py: --size")),
      top_k=Key(1, "k, prompts a task takes, in [1, pool_size] (the authors' 1)",
                authors(1, f"{HIDE}, configs/cifar100_hideprompt_5e.py: --top_k")),
      init_from_previous=Key(True, "at a boundary the new task's prompt starts as a copy of the"
                             " previous task's (the authors' shared_prompt_pool)",
                             authors(True, f"{HIDE}, configs/cifar100_hideprompt_5e.py:"
                                           " shared_prompt_pool")),
      reset_optimizer=Key(True, "both Adams' states restart at each boundary (the authors'"
                          " reinit_optimizer)",
                          authors(True, f"{HIDE}, configs/cifar100_hideprompt_5e.py:"
                                        " reinit_optimizer")),
      prompt_momentum=Key(0.01, "m: from the second task the live prompt enters as (1 - m) e_t +"
                          " m mean of the earlier prompts, and keeps that at the task's end, in"
                          " [0, 1) (the authors' 0.01)",
                          authors(0.01, f"{HIDE}, configs/cifar100_hideprompt_5e.py:"
                                        " --prompt_momentum")),
      contrastive_weight=Key(0.1, "weight of WTP's contrastive regulariser against the earlier"
                             " tasks' prototypes (>= 0; the authors' script: 0.1)",
                             authors(0.1, f"{HIDE}, training_scripts/train_cifar100_vit.sh:"
                                     " --reg")),
      contrastive_temperature=Key(0.8, "temperature of the regulariser's dot products (> 0; the"
                                  " authors' 0.8)",
                                  authors(0.8, f"{HIDE},"
                                               " engines/hide_promtp_wtp_and_tap_engine.py: the"
                                               " similarities divided by 0.8")),
      tii_learning_rate=Key(5e-4, "Adam's rate of the TII layer for a batch of"
                            " lr_reference_batch, constant (> 0; the authors' 5e-4)",
                            authors(5e-4, f"{HIDE}, training_scripts/train_cifar100_vit.sh: the"
                                    " TII stage's --lr (times the batch / 256)", batch=256)),
      tii_hidden_ratio=Key(2, "the TII layer's residual MLP has this times the model width"
                           " hidden units; 0 = a linear layer alone (the authors' 2)",
                           authors(2, f"{HIDE}, configs/cifar100_hideprompt_5e.py:"
                                      " --original_model_mlp_structure")),
      align=Key("every_evaluation", "when the head (TAP) and the TII layer are aligned on"
                    " the class statistics: 'every_evaluation' (*ours*: at each evaluation once"
                    " two classes are seen, on copies) | 'none' (never)",
                ours("online there is no task end to align at: an evaluation is when the aligned"
                     " head and TII layer are read")),
      tap_epochs=Key(30, "epochs of the head's alignment (>= 1; the authors' crct_epochs 30)",
                     authors(30, f"{HIDE}, training_scripts/train_cifar100_vit.sh: --crct_epochs")),
      tap_samples_per_class=Key(120, "features drawn per class and epoch for the head's"
                                " alignment, and its batch (>= 1; the authors' 5 x batch 24)",
                                authors(120, f"{HIDE}, engines/hide_promtp_wtp_and_tap_engine.py:"
                                             " five times the batch (24) drawn per class")),
      tap_learning_rate=Key(0.005, "SGD rate of the head's alignment, cosine-annealed over its"
                            " epochs (> 0; the authors' ca_lr 0.005)",
                            authors(0.005, f"{HIDE}, training_scripts/train_cifar100_vit.sh:"
                                    " --ca_lr, unscaled in the prompt stage", batch=24,
                                    unscaled="the alignment's batch is tap_samples_per_class,"
                                    " the authors' own, at any learner batch")),
      tii_alignment_epochs=Key(30, "epochs of the TII layer's alignment (>= 1; the authors' 30)",
                               authors(30, f"{HIDE}, training_scripts/train_cifar100_vit.sh:"
                                           " --crct_epochs")),
      tii_samples_per_class=Key(24, "features drawn per class and epoch for the TII layer's"
                                " alignment, and its batch (>= 1; the authors' batch 24)",
                                authors(24, f"{HIDE}, engines/hide_tii_engine.py: the batch (24)"
                                            " drawn per class")),
      tii_alignment_learning_rate=Key(0.005, "SGD rate of the TII layer's alignment for a batch"
                                      " of lr_reference_batch, cosine-annealed (> 0; the"
                                      " authors' ca_lr 0.005, scaled as their TII run scales"
                                      " it)",
                                      authors(0.005, f"{HIDE}, trainers/tii_trainer.py: ca_lr"
                                                     " times the batch / 256", batch=256)),
      alignment_weight_decay=Key(0.0, "L2 weight decay of both alignments' SGD (>= 0; the"
                                 " authors' resolves to 0.0: the 5e-4 their parser also"
                                 " declares never takes effect)",
                                 authors(0.0, f"{HIDE}, configs/cifar100_hideprompt_5e.py:"
                                         " --weight-decay (default 0.0, line 27) and"
                                         " --weight_decay (default 5e-4, line 144) share the"
                                         " destination weight_decay; argparse keeps the first"
                                         " default")),
      covariance_shrinkage=Key(1e-4, "added to each class covariance's diagonal (> 0; the"
                               " authors' 1e-4)",
                               authors(0.0001, f"{HIDE},"
                                               " engines/hide_promtp_wtp_and_tap_engine.py: the"
                                               " identity added to each class covariance")))


METHODS = (base.MethodSpec(name="hide_prompt", build=build, config=config,
                           report_name="HiDe-Prompt", table_row=17.5),)
