"""SimpleCIL (Zhou et al. 2023, "Revisiting class-incremental learning with pre-trained models"):
a prototype classifier on the frozen pretrained ViT, no gradient step; and, as an option, its APER
variant (a first phase adapted, until the run's first boundary).

Paper -> code. With phi(x) the frozen model's pooled class token (`common.frozen_features`,
`pre_logits=True`), the prototype of class c is the mean of the features of its samples seen so far,

    p_c = (1 / n_c) sum_{i: y_i = c} phi(x_i)          state["sums"][c] / state["counts"][c]

kept as running sums and counts, so that one pass in any order, batch by batch, gives the class
means of everything seen (the paper computes them once per task over the task's data; on a
one-pass stream the running mean is the same mean). The classifier is the cosine similarity,

    logits_c(x) = cos(phi(x), p_c) / temperature         `scores` below

over the classes seen so far (a class with no sample has no prototype and is left out of the
prediction, as the paper's classifier grows by the classes of each task). The argmax is that of the
cosine; `simplecil.temperature` scales the logits only for the loss the run logs.

Loss (logged, and what a plateau boundary rule reads; nothing is trained on it): the prequential
cross-entropy of the batch's real items under the prototypes as they stood BEFORE the batch was
added (`common.prequential_loss`: over the classes seen before and the batch's own; a class met for
the first time scores 0, the cosine with an empty prototype).

Where the paper's code differs: PILOT's SimpleCIL replaces the head's rows by the prototypes and
evaluates a cosine head with scale sigma = 1; with the same argmax, our temperature (0.1, *ours*)
only changes the logged loss. The paper's setting on ViT-B/16: ImageNet-21K or ImageNet-1K
pretrained ViT-B/16, its class token as phi, no training at all (SimpleCIL has no hyperparameter).

APER (the same paper's "ADAM"): `simplecil.first_phase` = 'lora' or 'all' adapts a copy of the
model in a first phase, then freezes it; the embedding becomes the concatenation
[phi(x), phi_adapted(x)] (2D) and the prototypes are class means of it. The paper tunes the
adapted model (adapter, SSF, VPT or full fine-tuning) for several epochs on the first task's data,
then computes every prototype with both models. Online reading (ours): the first phase lasts until
the run's boundary switch first calls `at_boundary` (`boundaries.rule`: 'oracle' at the first true
task end, 'plateau' when the plateau rule fires on this method's loss, which during the phase is
the adapted model's CE; with 'none' the phase never ends and the adapted half keeps training).
Each step of the phase takes one optimiser step on the CE of the adapted model's head
(`first_phase_ce`; the trainable part is `common.split_trainable`'s: 'lora', a rank-learner.rank
LoRA on q and v plus the head, Online-LoRA's budget, or 'all', the whole ViT).

The first phase as the authors' code (RevisitingCIL, `aper_finetune`) trains it, by default:

    head      `first_phase_head='cosine'`: logits_c(x) = sigma cos(g(x), w_c), g the adapted
              model's pooled features, w_c a trainable row per class (uniform in
              +-1/sqrt(D) at first), sigma one trainable scale (1 at first); the softmax runs
              over the classes of the first phase, here the classes seen so far (the stream's
              up to this batch: the first task's classes when the phase ends at the first true
              task end, which is the authors' head); `cosine_head_logits`
    update    `first_phase_optimizer='sgd'`: v <- 0.9 v + (grad + weight_decay theta),
              theta <- theta - lr v (PyTorch's SGD with momentum and L2 weight decay);
              learning_rate 0.01, weight_decay 5e-4 (the authors' configs)
    schedule  the authors anneal the rate by a cosine stepped once per epoch over 5 epochs, so
              their first pass over the task runs at the initial rate throughout; one pass,
              as here, is that first epoch: `first_phase_cosine_steps=0` keeps the rate
              constant. A value N > 0 anneals it per step, lr_t = lr (1 + cos(pi min(t, N) /
              N)) / 2 for the phase's update t (a phase longer than N steps runs on at 0):
              the authors' whole anneal squeezed into N steps, for a user who knows the first
              task's length (a task-free method does not)
    epochs    the authors' 5 passes over the first task become one: the stream is seen once

`first_phase_head='linear'` with `first_phase_optimizer='adam'` (learning_rate 1e-4,
weight_decay 1e-4) is our earlier reading: the ViT's fresh C-way linear head over every class,
trained with the baselines' Adam; on the demo its adapted half barely moved and APER scored as
SimpleCIL (docs/methods/simplecil.md). The stream is not seen again, so the prototypes of the
samples met during the phase are accumulated from the adapted model as it stood when each sample
arrived (before the step it was trained on), not recomputed with the final adapted model as the
paper does; after the boundary the adapted model is fixed and every later sample's prototype uses
it. `state["adapting"]` switches the phase off inside the one compiled train step;
host["adapted_until_step"] records the step it ended. The logged `loss` is the first phase's CE
while adapting, the prequential prototype loss after (`prototype_loss` and `first_phase_ce` are
logged beside it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from olora_jax import config_keys
from olora_jax.config_keys import Constant, Key, authors, ours
from olora_jax.methods import base, common

APER = "zhoudw-zdw/RevisitingCIL"  # the authors' released code (SimpleCIL and APER)


def cosine_scores(features: jnp.ndarray, sums: jnp.ndarray, counts: jnp.ndarray,
                  temperature: float) -> jnp.ndarray:
  """cos(phi(x), p_c) / temperature, (N, D) x prototypes -> (N, C); 0 for a class with no sample
  (p_c = 0)."""
  prototypes = sums / jnp.maximum(counts, 1.0)[:, None]
  f = features / jnp.maximum(jnp.linalg.norm(features, axis=-1, keepdims=True), 1e-12)
  p = prototypes / jnp.maximum(jnp.linalg.norm(prototypes, axis=-1, keepdims=True), 1e-12)
  return jnp.matmul(f, p.T, precision="highest") / temperature


FIRST_PHASES = ("none", "lora", "all")
FIRST_PHASE_HEADS = ("cosine", "linear")
FIRST_PHASE_OPTIMIZERS = ("sgd", "adam")
SGD_MOMENTUM = 0.9  # the authors' optimiser: torch.optim.SGD(momentum=0.9, weight_decay=...)
CONSTANTS = {
    "SGD_MOMENTUM": Constant("the first phase's SGD momentum",
                             authors(0.9, f"{APER}, models/aper_finetune.py: SGD with momentum"
                                     " 0.9")),
}


def cosine_head_logits(features: jnp.ndarray, head: dict) -> jnp.ndarray:
  """APER's first-phase head: sigma cos(g(x), w_c), (N, D) x {"kernel" (D, C), "sigma" ()} ->
  (N, C) (PyTorch's F.normalize: each norm floored at 1e-12)."""
  g = features / jnp.maximum(jnp.linalg.norm(features, axis=-1, keepdims=True), 1e-12)
  w = head["kernel"]
  w = w / jnp.maximum(jnp.linalg.norm(w, axis=0, keepdims=True), 1e-12)
  return head["sigma"] * jnp.matmul(g, w, precision="highest")


def init_cosine_head(key: jax.Array, width: int, num_classes: int) -> dict:
  """A fresh cosine head: rows uniform in +-1/sqrt(D), sigma 1 (as the authors' CosineLinear)."""
  bound = 1.0 / width ** 0.5
  return {"kernel": jax.random.uniform(key, (width, num_classes), jnp.float32, -bound, bound),
          "sigma": jnp.ones((), jnp.float32)}


def first_phase_learning_rate(block, batch_size: int):
  """The first phase's rate lr = `learning_rate` scaled from the authors' batch to `batch_size`
  (`common.batch_scale`): constant, or with `first_phase_cosine_steps` N > 0
  lr (1 + cos(pi min(t, N) / N)) / 2 at the phase's update t (0 from step N on)."""
  rate = block.learning_rate * common.batch_scale(block, batch_size)
  if block.first_phase_cosine_steps == 0:
    return rate
  return optax.cosine_decay_schedule(rate, block.first_phase_cosine_steps)


def first_phase_optimizer(block, batch_size: int) -> optax.GradientTransformation:
  """SGD with momentum 0.9 and L2 weight decay added to the gradient (the authors'), or the
  baselines' Adam (`common.make_adam`), at `first_phase_learning_rate` for a batch of
  `batch_size`."""
  lr = first_phase_learning_rate(block, batch_size)
  if block.first_phase_optimizer == "adam":
    return common.make_adam(lr, block.weight_decay)
  parts = [optax.add_decayed_weights(block.weight_decay)] if block.weight_decay > 0 else []
  return optax.chain(*parts, optax.sgd(lr, momentum=SGD_MOMENTUM))


def build(ctx: base.Context) -> base.Method:
  block = ctx.config.simplecil
  if block.first_phase not in FIRST_PHASES:
    raise ValueError(f"unknown simplecil.first_phase={block.first_phase!r}; use one of"
                     f" {FIRST_PHASES}")
  if block.first_phase_head not in FIRST_PHASE_HEADS:
    raise ValueError(f"unknown simplecil.first_phase_head={block.first_phase_head!r}; use one of"
                     f" {FIRST_PHASE_HEADS}")
  if block.first_phase_optimizer not in FIRST_PHASE_OPTIMIZERS:
    raise ValueError(f"unknown simplecil.first_phase_optimizer={block.first_phase_optimizer!r};"
                     f" use one of {FIRST_PHASE_OPTIMIZERS}")
  adapt = block.first_phase != "none"  # APER: a first phase adapted, until the first boundary
  cosine_head = block.first_phase_head == "cosine"
  frozen_features = common.frozen_features(ctx.model)
  apply = common.make_apply(ctx.model)
  tx = first_phase_optimizer(block, ctx.batch_size)
  num_classes, width = ctx.num_classes, ctx.spec.width * (2 if adapt else 1)

  def pretrained(state):
    """The frozen pretrained backbone (with first_phase 'all' the split's frozen part is empty)."""
    return state.get("pretrained", state["frozen"])

  def embed(state, images):
    """phi(x) (N, D); with a first phase [phi(x), phi_adapted(x)] (N, 2D), no gradient."""
    f = frozen_features(pretrained(state), images)
    if not adapt:
      return f
    g = adapted_features(state["frozen"], state["params"], images)
    return jnp.concatenate([f, jax.lax.stop_gradient(g)], axis=-1)

  def adapted_features(frozen, params, images):
    """g(x) (N, D): the adapted model's pooled features (its head is applied apart)."""
    return apply(frozen, {k: v for k, v in params.items() if k != "head"}, images,
                 pre_logits=True)

  def init(key, params):
    state = {"sums": jnp.zeros((num_classes, width), jnp.float32),
             "counts": jnp.zeros((num_classes,), jnp.float32)}
    if not adapt:
      return {**state, "frozen": common.backbone(params), "step": jnp.zeros((), jnp.int32)}
    if cosine_head:  # the authors' cosine head in place of the ViT's fresh linear one
      head_key, key = jax.random.split(key)
      params = {**params, "head": init_cosine_head(head_key, ctx.spec.width, num_classes)}
    state = {**state, **common.init_state(key, params, block.first_phase, ctx.spec,
                                          ctx.config.learner.rank, tx),
             "adapting": jnp.ones((), bool)}
    if block.first_phase == "all":
      state["pretrained"] = common.backbone(params)
    return state

  def first_phase_ce(params, frozen, batch, seen):
    """CE of the adapted model with its head: the cosine head over the classes `seen` so far
    (C,) bool, or the linear head over every class."""
    g = adapted_features(frozen, params, batch["images"])
    if cosine_head:
      logits = common.restrict_logits(cosine_head_logits(g, params["head"]), seen)
    else:
      logits = g @ params["head"]["kernel"] + params["head"]["bias"]
    return common.masked_mean(common.per_example_ce(logits, batch["labels"]), batch["mask"])

  @common.train_step("simplecil")
  def train_step(state, batch):
    f = embed(state, batch["images"])
    loss = common.prequential_loss(
        cosine_scores(f, state["sums"], state["counts"], block.temperature), state["counts"],
        batch)
    y = common.class_one_hot(batch["labels"], batch["mask"], num_classes)
    scalars = {"prototype_loss": loss}
    if adapt:  # one optimiser step on the first phase's CE while adapting; frozen after

      def step(state):
        seen = (state["counts"] > 0) | common.classes_in(batch["labels"], batch["mask"],
                                                         num_classes)
        ce, grads = jax.value_and_grad(first_phase_ce)(state["params"], state["frozen"], batch,
                                                       seen)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return optax.apply_updates(state["params"], updates), opt_state, ce

      params, opt_state, ce = jax.lax.cond(
          state["adapting"], step,
          lambda s: (s["params"], s["opt_state"], jnp.zeros((), jnp.float32)), state)
      scalars.update(first_phase_ce=ce, adapting=state["adapting"].astype(jnp.int32))
      loss = jnp.where(state["adapting"], ce, loss)
      state = {**state, "params": params, "opt_state": opt_state}
    state = {**state, "sums": state["sums"] + jnp.matmul(y.T, f, precision="highest"),
             "counts": state["counts"] + jnp.sum(y, axis=0), "step": state["step"] + 1}
    return state, {"loss": loss, **scalars, "n_classes": jnp.sum(state["counts"] > 0)}, {}

  def predict(state, images):
    scores = cosine_scores(embed(state, images), state["sums"], state["counts"],
                           block.temperature)
    return common.restrict_logits(scores, state["counts"] > 0)

  def at_boundary(state, host):
    """APER's end of the first phase: the first boundary freezes the adapted model for good."""
    if "adapted_until_step" not in host:
      host = {**host, "adapted_until_step": int(state["step"])}
    # Placed from the host where the flag lives: an eager jnp.zeros_like compiles a program.
    stopped = jax.device_put(np.zeros((), bool), state["adapting"].sharding)
    return {**state, "adapting": stopped}, host

  return base.Method(name="simplecil", init=init, train_step=train_step, predict=predict,
                     at_boundary=at_boundary if adapt else None,
                     # the prototypes' sums and counts, and the adapted weights (first_phase)
                     trainable=lambda s: {k: s[k] for k in ("params", "sums", "counts") if k in s})


def config():
  """The `simplecil` block: SimpleCIL, or with `first_phase` APER's adapted first phase (module
  docstring); the first phase's keys take the authors' values by default."""
  return config_keys.block(
      "",
      temperature=Key(0.1, "the cosine logits are cos / temperature (> 0): the argmax does not"
                      " depend on it, it scales the logged prequential loss (*ours*)",
                      ours("prediction is the argmax, which no temperature moves; it only sets"
                           " the scale of the logged loss")),
      first_phase=Key("none", "'none' (SimpleCIL: nothing is trained) | 'lora' (APER: a LoRA of"
                      " rank learner.rank on q and v, plus the head) | 'all' (APER's finetune:"
                      " the whole ViT), trained until the boundary switch first calls the"
                      " method",
                      ours("SimpleCIL trains nothing; APER's first phase is an option")),
      first_phase_head=Key("cosine", "the first phase's head: 'cosine' (sigma cos over the"
                           " classes seen; the authors') | 'linear' (the ViT's linear head over"
                           " every class)",
                           authors("cosine", f"{APER}, models/aper_finetune.py:"
                                   " SimpleCosineIncrementalNet")),
      first_phase_optimizer=Key("sgd", "'sgd' (momentum 0.9; the authors') | 'adam' (the"
                                " baselines' Adam)",
                                authors("sgd", f"{APER}, models/aper_finetune.py: SGD with"
                                        " momentum 0.9")),
      learning_rate=Key(0.01, "the first phase's learning rate for a batch of"
                        " lr_reference_batch, scaled to learner.batch_size (> 0)",
                        authors(0.01, f"{APER}, exps/aper_finetune/"
                                "cifar224_5_5_vit-b_finetune.json: init_lr", batch=128)),
      lr_reference_batch=Key(128, common.LR_REFERENCE_BATCH_MEANING + " (scales learning_rate;"
                             " the authors' adapter configs set the same 0.01 at batch 48)",
                             authors(128, f"{APER}, exps/aper_finetune/"
                                     "cifar224_5_5_vit-b_finetune.json: batch_size")),
      weight_decay=Key(5e-4, "the first phase's L2 weight decay, added to the gradient (>= 0)",
                       authors(5e-4, f"{APER}, exps/aper_finetune/"
                               "cifar224_5_5_vit-b_finetune.json: weight_decay")),
      first_phase_cosine_steps=Key(0, "0 = a constant learning rate (the authors' first"
                                   " epoch); N > 0 = a cosine anneal to 0 over the phase's first"
                                   " N steps",
                                   ours("one pass runs at the first epoch's rate of the"
                                        " authors' per-epoch cosine")))


METHODS = (base.MethodSpec(name="simplecil", build=build, config=config,
                           report_name="SimpleCIL", table_row=14,
                           check=base.Check("step", "LAMDA-CL/LAMDA-PILOT",
                                            "tests/test_parity_pilot.py",
                                            settings={"simplecil.first_phase": "none"},
                                            variants=(base.Variant(
                                                "APER", {"simplecil.first_phase": "all",
                                                         "boundaries.rule": "oracle",
                                                         "simplecil.first_phase_head": "cosine",
                                                         "simplecil.first_phase_optimizer":
                                                             "sgd"},
                                                "except for the first task's prototypes, by"
                                                " its stated online reading"),))),)
