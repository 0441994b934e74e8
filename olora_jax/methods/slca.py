"""SLCA, slow learner with classifier alignment (Zhang et al., ICCV 2023, "SLCA: Slow Learner with
Classifier Alignment for Continual Learning on a Pre-trained Model"), online and task-free.

Paper -> code. The whole pretrained ViT is fine-tuned sequentially with the head (Seq FT), with
two changes:

  Slow learner (SL). One SGD step per batch (momentum 0.9, L2 weight decay 5e-4 added to the
  gradient, PyTorch's SGD) with two rates: the head's `slca.learning_rate` (0.01, the
  authors' at their batch of 128, scaled linearly to the learner's batch B: 0.01 x B / 128,
  `common.batch_scale`) and the backbone's `learning_rate * backbone_lr_scale` (1/100 of
  it). The loss is the cross-entropy over the CURRENT TASK's classes (the authors'
  `logits[:, known_classes:]`), and the head columns of earlier tasks' classes do not move (the
  authors freeze the earlier tasks' heads); `slca_loss`, `head_freeze`.

  Class statistics. For every class c, the mean mu_c and covariance Sigma_c of its features
  phi(x) (the model's pooled class token, `pre_logits`). The authors compute them after each task
  with the trained backbone, over the task's training images, and never recompute an old
  class's. Online there is no second pass: each sample's features enter its class's running
  mean and scatter matrix (Chan et al.'s pairwise update, `absorb_statistics`) in the step that
  trains on it, under the backbone as it stood before that step's update; the slow backbone is
  what keeps these early features close to the later ones.
      Sigma_c = M2_c / (n_c - 1) + covariance_shrinkage I        (torch.cov + 1e-4 I)
  (a class with one sample: covariance_shrinkage I).

  Classifier alignment (CA). A copy of the head is trained on features sampled from the class
  Gaussians: each of `alignment_epochs` (5) epochs draws `samples_per_class` (256) vectors
  from N(s_c mu_c, Sigma_c) for every class seen, shuffles them, and takes one SGD step
  (momentum 0.9, weight decay, fresh state) per `samples_per_class` of them, the rate
  annealed per epoch by a cosine, alignment_learning_rate (1 + cos(pi e / E)) / 2 for epoch e of
  E (PyTorch's CosineAnnealingLR stepped once per epoch). The mean's scale s_c = 0.9 + 0.1 (t_c +
  1) / (T + 1), t_c the task the class was first seen in and T the current task (the authors'
  decay of older classes' means). With `logit_norm_temperature` tau > 0 the logits are divided
  by the mean over tasks of each task's logit norm, then by tau (the authors' ca_with_logit_norm,
  0.1):  logits / mean_t ||logits[classes of t]|| / tau  (`normalised_logits`).
  The authors evaluate with the aligned head and then restore the head as it was before CA for
  the next task's training (`fc.backup()` / `fc.recall()`): CA only ever serves prediction. Ours
  is the same: CA runs in `eval_state`, on a copy, so the evaluator reads the aligned head and
  training goes on with the slow learner's own.

When alignment runs (`slca.alignment`): the authors align after every task but the first.
  'every_evaluation' (default, *ours*): at every evaluation once two classes are seen; on a
      task-free stream no evaluation knows whether a task ended, and the head a stream trains is
      biased towards its recent classes whether or not a boundary was signalled.
  'after_boundary' (the authors'): at evaluations after the run's boundary switch has signalled
      a boundary (`boundaries.rule` 'oracle' or 'plateau'); with rule 'none' never.
  'none': the slow learner alone (the paper's SL ablation).

Boundaries (`at_boundary`, from the run's switch, as for the other boundary methods): a boundary
ends the current task: its classes join the earlier tasks' (their head columns freeze and leave
the loss), the task counter moves on, and the SGD state restarts (the authors make a new optimiser
per task). With `boundaries.rule='none'` the whole stream is one task: the loss is over every class
seen so far (and the batch's), every column trains, and all classes share one task in CA's mean
scale (s_c = 1) and logit norm. A class seen again after a boundary (Si-Blurry) rejoins the
current task; its task index stays the one it was first seen in.

Readings (where ours differs from the authors' code; docs/methods/slca.md):
  - one pass instead of 20 epochs per task (the authors' rate drops by 10x at epoch 18, so one
    pass is their constant-rate first epoch); no data augmentation, as every method here.
  - the authors' heads are one linear head per task, grown at each task; ours is the ViT's one
    C-way head with the classes not seen yet left out of every softmax and prediction.
  - the class statistics are running ones under the backbone of each sample's step (above);
    the authors' second pass uses the backbone at the task's end.
  - `trainable='lora'` puts a LoRA of rank learner.rank on q and v in place of the whole
    backbone under the slow rate (SLCA++'s parameter-efficient form, without its symmetric
    cross-entropy); 'head' freezes the backbone (the authors' bcb_lrscale = 0).

Cost beyond fine-tuning: the per-class scatter matrices, C x D x D float32 (236 MB for ViT-B/16
and 100 classes; in the checkpoints too), and per evaluation C Cholesky factorisations of D x D
and E * C * samples_per_class sampled features through the head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from olora_jax.config_keys import Constant, Key, authors, ours
from olora_jax.methods import base, common

HIGHEST = jax.lax.Precision.HIGHEST
ALIGNMENTS = ("every_evaluation", "after_boundary", "none")
SLCA = "GengDavid/SLCA"  # the authors' released code, where the defaults come from
OLDEST_MEAN_SCALE = 0.9  # the authors' CA draws old classes around (0.9 + decay) mu_c
CONSTANTS = {
    "OLDEST_MEAN_SCALE": Constant("the alignment draws the oldest classes around this times"
                                  " their mean (rising to 1 for the newest)",
                                  authors(0.9, f"{SLCA}, models/slca.py: the alignment's"
                                          " 0.9 + decay of each class's mean")),
}


def slow_learner(block, batch_size: int) -> optax.GradientTransformation:
  """The slow learner's SGD: the head at `learning_rate`, everything else (the backbone, or its
  LoRA) at `learning_rate * backbone_lr_scale`, both set by the authors for a batch of
  `lr_reference_batch` and scaled to this run's `batch_size` (`common.batch_scale`)."""
  rate = block.learning_rate * common.batch_scale(block, batch_size)
  return optax.multi_transform(
      {"head": common.make_sgd(rate, block.weight_decay),
       "backbone": common.make_sgd(rate * block.backbone_lr_scale, block.weight_decay)},
      lambda params: {k: jax.tree.map(lambda _, group=("head" if k == "head" else "backbone"):
                                      group, v) for k, v in params.items()})


def absorb_statistics(counts, means, scatter, features, labels, mask):
  """Each class's running (count (C,), mean (C, D), scatter M2 = sum (z - mu)(z - mu)^T (C, D, D))
  with the batch's valid items added (Chan et al.'s pairwise update: the batch's own per-class
  mean and scatter, then the merge; one pass, no catastrophic cancellation of sum z z^T)."""
  num_classes = counts.shape[0]
  y = common.class_one_hot(labels, mask, num_classes)
  n_b = jnp.sum(y, axis=0)
  mean_b = jnp.matmul(y.T, features, precision=HIGHEST) / jnp.maximum(n_b, 1.0)[:, None]
  centred = (features - mean_b[labels]) * mask[:, None]
  scatter_b = jnp.zeros_like(scatter).at[labels].add(
      jnp.einsum("nd,ne->nde", centred, centred, precision=HIGHEST))
  n = counts + n_b
  delta = mean_b - means
  share = jnp.where(n > 0, n_b / jnp.maximum(n, 1.0), 0.0)
  means = means + delta * share[:, None]
  scatter = scatter + scatter_b + (jnp.einsum("cd,ce->cde", delta, delta, precision=HIGHEST)
                                   * (counts * share)[:, None, None])
  return n, means, scatter


def class_covariances(counts, scatter, shrinkage: float):
  """Sigma_c = M2_c / (n_c - 1) + shrinkage I (C, D, D); shrinkage I for a class with < 2
  samples."""
  dim = scatter.shape[-1]
  unbiased = scatter / jnp.maximum(counts - 1.0, 1.0)[:, None, None]
  return unbiased + shrinkage * jnp.eye(dim, dtype=scatter.dtype)


def mean_scales(class_task, task):
  """s_c = 0.9 + 0.1 (t_c + 1) / (T + 1): the authors' shrink of older classes' means in CA."""
  return OLDEST_MEAN_SCALE + (1.0 - OLDEST_MEAN_SCALE) * (class_task + 1.0) / (task + 1.0)


def normalised_logits(logits, seen, class_slot, n_slots: int, temperature: float):
  """logits / mean over tasks of ||logits of the task's classes|| / temperature (the authors'
  logit normalisation in CA), over the `seen` (C,) classes; `class_slot` (C,) is each class's
  task, capped to the `n_slots` the state allocates."""
  member = jax.nn.one_hot(class_slot, n_slots, dtype=jnp.float32) * seen[:, None]  # (C, T)
  squares = jnp.matmul(jnp.square(logits) * seen, member, precision=HIGHEST)  # (N, T)
  # sqrt's gradient at 0 (a task with no class seen) is inf; such a task's norm is masked anyway
  norms = jnp.where(squares > 0, jnp.sqrt(jnp.where(squares > 0, squares, 1.0)), 0.0) + 1e-7
  present = jnp.sum(member, axis=0) > 0
  mean_norm = jnp.sum(norms * present, axis=-1, keepdims=True) / jnp.maximum(
      jnp.sum(present), 1)
  return logits / mean_norm / temperature


def align_head(head, ce, key, centres, factors, seen, per_class: int, epochs: int,
               learning_rate: float, weight_decay: float):
  """`head` (any pytree) after classifier alignment: for each of `epochs` epochs, `per_class`
  features drawn for every `seen` (C,) class from N(centres_c, factors_c factors_c^T) (centres
  (C, D), factors (C, D, D) lower Cholesky factors), shuffled, one SGD step (momentum 0.9, L2
  `weight_decay`, fresh state) per `per_class` of them on `ce(head, features, labels, valid)`,
  the rate `learning_rate` annealed per epoch by a cosine, (1 + cos(pi e / epochs)) / 2. SLCA's
  alignment and HiDe-Prompt's (methods/hide_prompt.py)."""
  num_classes, dim = centres.shape
  n_seen = jnp.sum(seen.astype(jnp.int32))
  labels = jnp.repeat(jnp.arange(num_classes), per_class)
  valid = jnp.repeat(seen, per_class)
  ca_tx = common.make_sgd(1.0, weight_decay)  # the rate is applied per epoch below

  def epoch(e, carry):
    head, opt_state = carry
    draw_key, order_key = jax.random.split(jax.random.fold_in(key, e))
    z = jax.random.normal(draw_key, (num_classes, per_class, dim), jnp.float32)
    samples = centres[:, None, :] + jnp.einsum("cpd,ced->cpe", z, factors, precision=HIGHEST)
    samples = samples.reshape(-1, dim)
    # A shuffle of the seen classes' samples, first; the unseen classes' rows after them.
    u = jax.random.uniform(order_key, valid.shape)
    order = jnp.argsort(jnp.where(valid, u, 2.0 + u))
    rate = learning_rate * 0.5 * (1.0 + jnp.cos(jnp.pi * e / epochs))

    def one_step(i, carry):
      head, opt_state = carry
      rows = jax.lax.dynamic_slice_in_dim(order, i * per_class, per_class)
      grads = jax.grad(ce)(head, samples[rows], labels[rows], valid[rows])
      updates, opt_state = ca_tx.update(grads, opt_state, head)
      updates = jax.tree.map(lambda u: u * rate, updates)
      return optax.apply_updates(head, updates), opt_state

    # One step per `per_class` samples over the seen classes' (n_seen steps an epoch).
    return jax.lax.fori_loop(0, n_seen, one_step, (head, opt_state))

  head, _ = jax.lax.fori_loop(0, epochs, epoch, (head, ca_tx.init(head)))
  return head


def build(ctx: base.Context) -> base.Method:
  block = ctx.config.slca
  if block.alignment not in ALIGNMENTS:
    raise ValueError(f"unknown slca.alignment={block.alignment!r}; use one of {ALIGNMENTS}")
  tx = slow_learner(block, ctx.batch_size)
  apply = common.make_apply(ctx.model)
  num_classes, n_slots = ctx.num_classes, common.task_slots(ctx, block)
  per_class, epochs = block.samples_per_class, block.alignment_epochs

  def features_of(frozen, params, images):
    return apply(frozen, {k: v for k, v in params.items() if k != "head"}, images,
                 pre_logits=True)

  def head_logits(head, f):
    return jnp.matmul(f, head["kernel"].astype(f.dtype), precision=HIGHEST) + head["bias"]

  def init(key, params):
    state = common.init_state(key, params, block.trainable, ctx.spec, ctx.config.learner.rank, tx)
    dim = state["params"]["head"]["kernel"].shape[0]  # the pooled features' width
    return {**state, "counts": jnp.zeros((num_classes,), jnp.float32),
            "means": jnp.zeros((num_classes, dim), jnp.float32),
            "scatter": jnp.zeros((num_classes, dim, dim), jnp.float32),
            "class_task": jnp.zeros((num_classes,), jnp.int32),
            "current": jnp.zeros((num_classes,), bool),
            "n_boundaries": jnp.zeros((), jnp.int32)}

  def head_freeze(current):
    """Zeroes the head updates of the classes outside the current task (the authors' frozen
    earlier heads; weight decay and momentum would move them)."""

    def freeze(updates):
      head = updates["head"]
      return {**updates, "head": {"kernel": head["kernel"] * current[None, :],
                                  "bias": head["bias"] * current}}

    return freeze

  @common.train_step("slca")
  def train_step(state, batch):
    in_batch = common.classes_in(batch["labels"], batch["mask"], num_classes)
    current = state["current"] | in_batch

    def loss_fn(params):
      f = features_of(state["frozen"], params, batch["images"])
      logits = common.restrict_logits(head_logits(params["head"], f), current)
      ce = common.masked_mean(common.per_example_ce(logits, batch["labels"]), batch["mask"])
      return ce, jax.lax.stop_gradient(f)

    (loss, f), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    new = in_batch & (state["counts"] == 0)
    counts, means, scatter = absorb_statistics(state["counts"], state["means"], state["scatter"],
                                               f.astype(jnp.float32), batch["labels"],
                                               batch["mask"])
    state = common.apply_gradients(state, grads, tx, head_freeze(current.astype(jnp.float32)))
    state = {**state, "counts": counts, "means": means, "scatter": scatter, "current": current,
             "class_task": jnp.where(new, state["n_boundaries"], state["class_task"])}
    return state, {"loss": loss, "n_classes": jnp.sum(counts > 0),
                   "task_classes": jnp.sum(current)}, {}

  def align(state):
    """The aligned copy of the head: CA's SGD on features sampled from the class Gaussians."""
    seen = state["counts"] > 0
    factors = jnp.linalg.cholesky(class_covariances(state["counts"], state["scatter"],
                                                    block.covariance_shrinkage))
    centres = state["means"] * mean_scales(state["class_task"], state["n_boundaries"])[:, None]
    class_slot = jnp.minimum(state["class_task"], n_slots - 1)
    key = jax.random.fold_in(jax.random.fold_in(state["key"], state["step"]), 1)

    def ce(head, f, y, m):
      logits = head_logits(head, f)
      if block.logit_norm_temperature > 0:
        logits = normalised_logits(logits, seen, class_slot, n_slots,
                                   block.logit_norm_temperature)
      logits = common.restrict_logits(logits, seen)
      return common.masked_mean(common.per_example_ce(logits, y), m)

    return align_head(state["params"]["head"], ce, key, centres, factors, seen, per_class, epochs,
                      block.alignment_learning_rate, block.weight_decay)

  def aligns(state):
    enough = jnp.sum(state["counts"] > 0) >= 2
    if block.alignment == "after_boundary":
      return enough & (state["n_boundaries"] > 0)
    return enough

  def eval_state(state):
    """What the evaluator reads: the slow learner's state with its head aligned (a copy)."""
    common.TRACE_COUNTS["slca.eval_state"] += 1
    head = jax.lax.cond(aligns(state), align, lambda s: s["params"]["head"], state)
    return {"frozen": state["frozen"], "params": {**state["params"], "head": head},
            "counts": state["counts"]}

  def predict(state, images):
    f = features_of(state["frozen"], state["params"], images)
    return common.restrict_logits(head_logits(state["params"]["head"], f), state["counts"] > 0)

  @jax.jit
  def boundary(state):
    """The current task ends: its classes freeze with the earlier ones, the SGD state restarts."""
    common.TRACE_COUNTS["slca.at_boundary"] += 1
    return {**state, "n_boundaries": state["n_boundaries"] + 1,
            "current": jnp.zeros_like(state["current"]),
            "opt_state": tx.init(state["params"])}

  return base.Method(name="slca", init=init, train_step=train_step, predict=predict,
                     eval_state=None if block.alignment == "none" else jax.jit(eval_state),
                     eval_state_keys=("slca.alignment_learning_rate",),
                     at_boundary=lambda state, host: (boundary(state), host))


def config():
  """The `slca` block: the authors' ViT-B/16 settings (their configs and code)."""
  return common.baseline_block(
      trainable=Key("all", "what the slow learner trains: 'all' (the whole ViT and the head,"
                    " the paper's) | 'lora' (a LoRA of rank learner.rank on q and v, plus the"
                    " head) | 'head' (the head alone: the backbone frozen)",
                    ours("the paper's and the authors' setting (the whole ViT fine-tuned"
                         " slowly); 'lora' and 'head' are this project's variants")),
      learning_rate=Key(0.01, "the head's SGD learning rate for a batch of lr_reference_batch,"
                        " constant, scaled to learner.batch_size (> 0; the authors' 0.01 at"
                        " batch 128)",
                        authors(0.01, f"{SLCA}, models/slca.py: lrate", batch=128)),
      lr_reference_batch=Key(128, common.LR_REFERENCE_BATCH_MEANING + " (scales learning_rate,"
                             " and so the backbone's rate; not the alignment's, whose batch is"
                             " samples_per_class as the authors')",
                             authors(128, f"{SLCA}, models/slca.py: batch_size")),
      backbone_lr_scale=Key(0.01, "the backbone's (or its LoRA's) rate is learning_rate times"
                            " this (>= 0; the slow learner's 1/100)",
                            authors(0.01, f"{SLCA}, models/slca.py: bcb_lrscale (1/100 unless"
                                    " a config sets it)")),
      weight_decay=Key(5e-4, "L2 weight decay added to the gradient, in training and in the"
                       " alignment (>= 0; the authors' 5e-4)",
                       authors(5e-4, f"{SLCA}, models/slca.py: weight_decay")),
      alignment=Key("every_evaluation", "when the head is aligned for prediction:"
                    " 'every_evaluation' (*ours*: at each evaluation) | 'after_boundary' (the"
                    " authors': at evaluations after the first boundary the run's switch"
                    " signals) | 'none' (the slow learner alone)",
                    ours("online there is no task end to align at: an evaluation is when the"
                         " aligned head is read; 'after_boundary' is the authors' timing")),
      alignment_epochs=Key(5, "epochs of the alignment, each over freshly drawn features (>= 1;"
                           " the authors' ca_epochs 5)",
                           authors(5, f"{SLCA}, exps/slca/slca_cifar.json: ca_epochs")),
      samples_per_class=Key(256, "features drawn per class and epoch, and the alignment's batch"
                            " (>= 1; the authors' 256)",
                            authors(256, f"{SLCA}, models/slca.py: num_sampled_pcls")),
      alignment_learning_rate=Key(0.01, "the alignment's SGD rate at its first epoch, annealed by"
                                  " a cosine over the epochs (> 0; the authors' 0.01)",
                                  authors(0.01, f"{SLCA}, models/slca.py: the alignment's SGD"
                                          " at lrate", batch=256,
                                          unscaled="the alignment's batch is samples_per_class"
                                          " (256), the authors' own, at any learner batch")),
      logit_norm_temperature=Key(0.1, "tau of the alignment's logit normalisation (>= 0; the"
                                 " authors' 0.1; 0 = plain logits)",
                                 authors(0.1, f"{SLCA}, exps/slca/slca_cifar.json:"
                                         " ca_with_logit_norm (ImageNet-R's too)")),
      covariance_shrinkage=Key(1e-4, "added to each class covariance's diagonal (> 0; the"
                               " authors' 1e-4)",
                               authors(1e-4, f"{SLCA}, models/base.py: the identity added to"
                                       " torch.cov of a class's features")),
      n_tasks=Key(0, "task slots of the logit normalisation (tasks past them share the last);"
                  " 0 = data.n_tasks",
                  ours("read from the stream (data.n_tasks), as the authors' count of tasks is"
                       " read from their dataset split")))


METHODS = (base.MethodSpec(name="slca", build=build, config=config, report_name="SLCA",
                           table_row=21,
                           check=base.Check("step", "LAMDA-CL/LAMDA-PILOT",
                                            "tests/test_parity_pilot.py",
                                            "for the slow learner only: the alignment's"
                                            " random draws are not shared",
                                            settings={"boundaries.rule": "oracle",
                                                      "slca.alignment": "after_boundary",
                                                      "slca.trainable": "all"})),)
