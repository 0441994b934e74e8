"""EASE, expandable subspace ensemble (Zhou et al., CVPR 2024, "Expandable Subspace Ensemble for
Pre-Trained Model-Based Class-Incremental Learning"), online and task-free.

Paper -> code. The pretrained ViT stays frozen; task t trains a lightweight module of its own,
which spans subspace t: phi_t(x), the pooled class token with module t in the ViT. The modules are
slots of one stacked tree (`state["params"]["adapters"]`, T slots; the live one is t =
min(boundaries signalled, T - 1)), each a LoRA of rank `ease.rank` on q and v (the project's
adapter, `models/lora.py`; the paper's is an AdaptFormer bottleneck MLP beside each block's MLP).
  1. Training (task t): the live module and a fresh cosine head over the task's classes (the
     authors' proxy_fc), sigma cos(phi_t(x), w_c), trained on the cross-entropy over the current
     task's classes (the classes seen since the last boundary, and the batch's); SGD with
     momentum 0.9 and L2 weight decay (the authors' CIFAR-100 values: 0.025 at batch 48, 5e-4;
     the rate scaled to the learner's batch, 0.025 x B / 48, `common.batch_scale`). The other
     slots do not move (their updates are zeroed).
  2. Prototypes: p_{c,j}, the mean of class c's features in subspace j. The authors compute
     them after each task over the task's data with every module so far; online each sample
     adds its features phi_j(x) for every live-or-earlier slot j <= t to its class's running
     sums in the step that trains on it (the live slot's under the module as it stood before
     the step's update; the earlier slots are frozen, so theirs are exact).
  3. Prototype complement: an old class c (first seen in task i) has no prototype in a later
     subspace j > i. It is estimated from the classes R that have prototypes in both i and j,
     weighted by their similarity to c in subspace i:
         p^_{c,j} = sum_{c' in R} softmax_{c'}(cos(p_{c,i}, p_{c',i})) p_{c',j}
     (`complement`; the authors' solve_sim_reset, recomputed with every class known now).
  4. Prediction: the cosine of x's feature in every subspace j <= t with each class's
     prototype there, weighted 1 in the class's own subspace and alpha / t in the others
     (the authors' forward_reweight, alpha = 0.1):
         logit_c(x) = sum_{j <= t} w_{c,j} cos(phi_j(x), p_{c,j})
     over the classes seen. The complement and the table run in `eval_state`.

Boundaries (`at_boundary`, from the run's switch): a boundary freezes the live slot and opens the
next (past T slots the last stays live, as SD-LoRA's), the proxy head and the SGD state restart,
and the classes met afterwards are the new task's. With `boundaries.rule='none'` the stream is
one task: one module, trained for the whole stream, and a prototype classifier in its subspace.

Readings (docs/methods/ease.md): one pass instead of 20 epochs per task with a cosine rate (one
pass runs at the first epoch's rate); a rank-r LoRA on q and v per task for the AdaptFormer
adapter (bottleneck 64 beside each MLP): the subspace a task's module spans is what the method
uses, and the LoRA is how this project's ViT takes a trainable module; running prototypes under
the module as it trains (above); a class that comes back after a boundary (Si-Blurry) keeps the
task it was first seen in and adds real prototypes in the subspaces it meets, which then replace
the complement there.

Cost: T forward passes per image to predict, T + 1 per train step (every slot's features for
the prototypes, the live one's with its gradient); the prototype sums are C x T x D.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olora_jax.config_keys import Key, authors, ours
from olora_jax.methods import base, common
from olora_jax.models import lora as lora_lib

EASE = "sun-hailong/CVPR24-Ease"  # the authors' released code, where the defaults come from

HIGHEST = jax.lax.Precision.HIGHEST


def unit(x: jax.Array) -> jax.Array:
  """x / ||x|| over the last axis (PyTorch's F.normalize: the norm floored at 1e-12)."""
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def init_proxy(key: jax.Array, width: int, num_classes: int) -> dict:
  """A fresh cosine head: rows uniform in +-1/sqrt(D), sigma 1 (the authors' CosineLinear)."""
  bound = 1.0 / width ** 0.5
  return {"kernel": jax.random.uniform(key, (width, num_classes), jnp.float32, -bound, bound),
          "sigma": jnp.ones((), jnp.float32)}


def complement(sums: jax.Array, counts: jax.Array, class_task: jax.Array) -> jax.Array:
  """The prototype table (C, T, D): p_{c,j} where class c has samples in subspace j, else the
  complement from the classes with prototypes in both c's own subspace and j (module docstring);
  zero where no class has both."""
  means = sums / jnp.maximum(counts, 1.0)[..., None]  # (C, T, D)
  has = counts > 0  # (C, T)
  normed = unit(means)
  # cos(p_{c,s}, p_{c',s}) for every subspace s, then at s = c's own task: (C, C)
  cosines = jnp.einsum("asd,bsd->sab", normed, normed, precision=HIGHEST)
  own = cosines[class_task, jnp.arange(counts.shape[0])]  # row c: cosines in c's subspace
  has_own = has[:, class_task].T  # (C, C'): c' has a prototype in c's subspace

  def slot(j):
    reference = has_own & has[:, j][None, :]
    weights = jax.nn.softmax(jnp.where(reference, own, -jnp.inf), axis=-1)
    weights = jnp.where(jnp.any(reference, axis=-1, keepdims=True), weights, 0.0)
    estimate = jnp.matmul(weights, means[:, j], precision=HIGHEST)
    return jnp.where(has[:, j][:, None], means[:, j], estimate)

  return jnp.moveaxis(jax.vmap(slot)(jnp.arange(counts.shape[1])), 0, 1)


def ensemble_logits(features: jax.Array, prototypes: jax.Array, class_task: jax.Array,
                    live: jax.Array, alpha: float) -> jax.Array:
  """sum_{j <= live} w_{c,j} cos(phi_j(x), p_{c,j}), features (T, N, D), prototypes (C, T, D):
  w = 1 in the class's own subspace, alpha / live in the others (the authors' reweighting)."""
  n_slots = prototypes.shape[1]
  cosines = jnp.einsum("tnd,ctd->nct", unit(features), unit(prototypes), precision=HIGHEST)
  slots = jnp.arange(n_slots)
  weight = jnp.where(slots[None, :] == class_task[:, None], 1.0,
                     alpha / jnp.maximum(live, 1).astype(jnp.float32))
  weight = weight * (slots <= live)[None, :]  # (C, T)
  return jnp.sum(cosines * weight[None], axis=-1)


def build(ctx: base.Context) -> base.Method:
  block = ctx.config.ease
  if not hasattr(ctx.spec, "lora_layers"):  # a backbone without attention projections
    raise ValueError(f"method='ease' puts a LoRA module per task on q and v of a ViT's (or"
                     f" Swin's) attention, which model.name={ctx.config.model.name!r} does not"
                     " have; use a ViT or Swin model.name, or another method")
  n_slots, num_classes = common.task_slots(ctx, block), ctx.num_classes
  apply = common.make_apply(ctx.model)
  tx = common.make_sgd(block.learning_rate * common.batch_scale(block, ctx.batch_size),
                       block.weight_decay)

  def features(frozen, adapter, images):
    return apply(frozen, {"lora": adapter}, images, pre_logits=True)

  def every_slot(frozen, adapters, images):
    """(T, N, D): the features of each slot's subspace, no gradient."""
    return jax.lax.stop_gradient(jax.vmap(lambda a: features(frozen, a, images))(adapters))

  def live_slot(state):
    return jnp.minimum(state["n_boundaries"], n_slots - 1)

  def init(key, params):
    adapter_key, proxy_key, key = jax.random.split(key, 3)
    adapters = jax.vmap(lambda k: lora_lib.init_lora(k, ctx.spec, block.rank))(
        jax.random.split(adapter_key, n_slots))
    backbone = common.backbone(params)
    width = params["head"]["kernel"].shape[0]
    trainable = {"adapters": adapters, "proxy": init_proxy(proxy_key, width, num_classes)}
    return {**common.state_of(trainable, backbone, tx, key),
            "sums": jnp.zeros((num_classes, n_slots, width), jnp.float32),
            "counts": jnp.zeros((num_classes, n_slots), jnp.float32),
            "class_task": jnp.zeros((num_classes,), jnp.int32),
            "current": jnp.zeros((num_classes,), bool),
            "n_boundaries": jnp.zeros((), jnp.int32)}

  @common.train_step("ease")
  def train_step(state, batch):
    t = live_slot(state)
    in_batch = common.classes_in(batch["labels"], batch["mask"], num_classes)
    current = state["current"] | in_batch

    def loss_fn(params):
      adapter = jax.tree.map(lambda x: x[t], params["adapters"])
      g = unit(features(state["frozen"], adapter, batch["images"]))
      logits = params["proxy"]["sigma"] * jnp.matmul(g, unit(params["proxy"]["kernel"].T).T,
                                                     precision=HIGHEST)
      logits = common.restrict_logits(logits, current)
      return common.masked_mean(common.per_example_ce(logits, batch["labels"]), batch["mask"])

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    f = every_slot(state["frozen"], state["params"]["adapters"], batch["images"])  # (T, N, D)
    y = common.class_one_hot(batch["labels"], batch["mask"], num_classes)  # (N, C)
    opened = (jnp.arange(n_slots) <= t).astype(jnp.float32)  # slots of this task and before

    def freeze(updates):  # only the live slot's module moves
      live = (jnp.arange(n_slots) == t).astype(jnp.float32)
      return {**updates, "adapters": jax.tree.map(
          lambda u: u * live.reshape((-1,) + (1,) * (u.ndim - 1)), updates["adapters"])}

    state = common.apply_gradients(state, grads, tx, freeze)
    new = in_batch & (jnp.sum(state["counts"], axis=1) == 0)
    state = {**state,
             "sums": state["sums"] + jnp.einsum("nc,tnd->ctd", y, f, precision=HIGHEST)
             * opened[None, :, None],
             "counts": state["counts"] + jnp.sum(y, axis=0)[:, None] * opened[None, :],
             "class_task": jnp.where(new, t, state["class_task"]), "current": current}
    return state, {"loss": loss, "n_classes": jnp.sum(jnp.sum(state["counts"], axis=1) > 0),
                   "task_classes": jnp.sum(current)}, {}

  def eval_state(state):
    """What the evaluator reads: the modules and the complemented prototype table."""
    common.TRACE_COUNTS["ease.eval_state"] += 1
    return {"frozen": state["frozen"], "params": {"adapters": state["params"]["adapters"]},
            "prototypes": complement(state["sums"], state["counts"], state["class_task"]),
            "class_task": state["class_task"], "seen": jnp.sum(state["counts"], axis=1) > 0,
            "live": live_slot(state)}

  def predict(state, images):
    f = every_slot(state["frozen"], state["params"]["adapters"], images)
    logits = ensemble_logits(f, state["prototypes"], state["class_task"], state["live"],
                             block.alpha)
    return common.restrict_logits(logits, state["seen"])

  @jax.jit
  def boundary(state):
    """The live module freezes, the next slot opens; the proxy head and SGD restart."""
    common.TRACE_COUNTS["ease.at_boundary"] += 1
    key = jax.random.fold_in(state["key"], state["n_boundaries"] + 1)
    width = state["params"]["proxy"]["kernel"].shape[0]
    params = {**state["params"], "proxy": init_proxy(key, width, num_classes)}
    return {**state, "params": params, "opt_state": tx.init(params),
            "n_boundaries": state["n_boundaries"] + 1,
            "current": jnp.zeros_like(state["current"])}

  return base.Method(name="ease", init=init, train_step=train_step, predict=predict,
                     eval_state=jax.jit(eval_state),
                     at_boundary=lambda state, host: (boundary(state), host),
                     trainable=lambda s: {k: s[k] for k in ("params", "prototypes")})


def config():
  """The `ease` block: the authors' ViT-B/16 CIFAR-100 settings (their config)."""
  return common.baseline_block(
      trainable=Key("lora", "'lora', the only value: one module per task (a LoRA of rank"
                    " ease.rank on q and v) and the task's cosine head",
                    ours("the authors train one adapter module per task and its head; a LoRA"
                         " on q and v is this project's adapter")),
      learning_rate=Key(0.025, "SGD's learning rate (momentum 0.9) for a batch of"
                        " lr_reference_batch, constant, scaled to learner.batch_size (> 0; the"
                        " authors' CIFAR-100 0.025)",
                        authors(0.025, f"{EASE}, exps/ease_cifar.json: init_lr, later_lr",
                                batch=48)),
      lr_reference_batch=Key(48, common.LR_REFERENCE_BATCH_MEANING + " (scales learning_rate)",
                             authors(48, f"{EASE}, exps/ease_cifar.json: batch_size")),
      weight_decay=Key(5e-4, "L2 weight decay added to the gradient (>= 0; the authors'"
                       " CIFAR-100 5e-4)",
                       authors(5e-4, f"{EASE}, exps/ease_cifar.json: weight_decay")),
      rank=Key(16, "r of each task's LoRA module, in [1, model width] (*ours*; the paper's"
               " adapter has a bottleneck of 64)",
               ours("16, small beside the authors' 64-wide adapter bottleneck (ffn_num 64 in"
                    " their configs), for which a LoRA stands")),
      alpha=Key(0.1, "weight of the other subspaces' cosines, alpha / t, against 1 in a class's"
                " own (>= 0; the authors' 0.1)",
                authors(0.1, f"{EASE}, exps/ease_cifar.json: alpha")),
      n_tasks=Key(0, "T, the module slots (one per task; past T boundaries the last stays"
                  " live); 0 = data.n_tasks",
                  ours("read from the stream (data.n_tasks), as the authors' count of tasks is"
                       " read from their dataset split")))


METHODS = (base.MethodSpec(name="ease", build=build, config=config, report_name="EASE",
                           table_row=22),)
