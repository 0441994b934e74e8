"""ER-ACE, experience replay with asymmetric cross-entropy (Caccia et al., ICLR 2022).

ER's reservoir buffer and uniform replay draw, with the incoming batch's cross-entropy taken over
fewer classes: the classes present in the incoming batch, and the classes never seen so far; the
logits of every class seen before but absent from the batch leave its softmax, so the new samples
do not push the old classes' logits down (the abrupt change of their representation the paper
measures at a task switch). The replayed samples keep the full cross-entropy over every class.
Each step: one optimiser step on ACE(batch) + CE(replayed), then the batch enters the reservoir.
`class_seen` (C,) bool in the state marks the classes met so far (the batch's own included
before its loss, as the authors' code updates it first). Task-free: no task id or boundary is
used; the authors' code forces its task-free mode for ER-ACE.

The classifier (`head`): 'cosine', the authors' (pclucas14/AML, model.py `distLinear`, switched
on for ACE in main.py): logits = 10 * cos(features, w_c), a bias-free layer on the model's pooled
features (`pre_logits`) divided by their L2 norm + 1e-5, with each class's weight divided by its
L2 norm + 1e-5, drawn fresh as nn.Linear draws a weight; or 'linear', the model's own head (ER's).
Settings otherwise ER's of the Online-LoRA paper (buffer 500, 10 replayed, Adam, LR 1e-4, WD
1e-4); the authors' (SGD at LR 0.1, batch 10, 10 replayed, the replayed samples in a forward pass
of their own) are keys: `optimizer`, `learning_rate`, `replay_pass` (docs/parity.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olora_jax.config_keys import Constant, Key, authors
from olora_jax.methods import base, common, er


def asymmetric_ce(logits: jax.Array, labels: jax.Array, mask: jax.Array,
                  seen: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(masked mean ACE of the incoming batch, the classes seen after it). ACE is the cross-entropy
  over the classes of the batch's valid items and the classes not in `seen` (C,) bool (never met
  before the batch); a seen class absent from the batch gets `common.ABSENT_LOGIT`. Pure."""
  present = common.classes_in(labels, mask, logits.shape[-1])
  seen = seen | present
  ce = common.per_example_ce(common.restrict_logits(logits, present | ~seen), labels)
  return common.masked_mean(ce, mask), seen


AML = "pclucas14/AML"  # the authors' released code
# Why ER-ACE runs ER's optimiser and memory rather than the authors' plain SGD at 0.1 with 20
# slots per class: the two rows then differ in what ER-ACE adds (the loss and the cosine head).
ER_SETTINGS = ("ER's setting of the Online-LoRA paper (Adam 1e-4, WD 1e-4, buffer 500), so that"
               " ER-ACE's row differs from ER's in the loss and the head alone")
HEADS = ("cosine", "linear")  # `er_ace.head`
COSINE_SCALE = 10.0  # the authors' distLinear: scale_factor = 10
COSINE_EPS = 1e-5  # added to each norm before dividing (theirs)
CONSTANTS = {  # the module's numbers, each with its source (tests/test_key_sources.py)
    "COSINE_SCALE": Constant("the cosine head's logits are the cosines times it",
                             authors(10.0, f"{AML}, model.py: distLinear's scale_factor")),
    "COSINE_EPS": Constant("added to each L2 norm (features, class weights) before dividing",
                           authors(1e-5, f"{AML}, model.py: distLinear's norm + 0.00001")),
}


def cosine_head(key: jax.Array, width: int, num_classes: int) -> dict:
  """A fresh bias-free head {"kernel" (D, C)} drawn as PyTorch's nn.Linear draws a weight
  (uniform in +-1/sqrt(D)), the authors' distLinear's."""
  bound = 1.0 / width ** 0.5
  return {"kernel": jax.random.uniform(key, (width, num_classes), jnp.float32, -bound, bound)}


def head_logits(apply, cosine: bool):
  """`logits(frozen, params, images, **model_kwargs)`: the model with its linear head, or with the
  cosine classifier on its pooled features (`common.cosine_logits`, the authors' scale and eps)."""
  if not cosine:
    return apply

  def logits(frozen, params, images, **model_kwargs):
    features = apply(frozen, params, images, pre_logits=True, **model_kwargs)
    return common.cosine_logits(features, params["head"]["kernel"], COSINE_SCALE, COSINE_EPS)

  return logits


def build(ctx: base.Context) -> base.Method:
  """ER-ACE from the `er_ace` block."""
  block = ctx.config.er_ace
  tx, apply = common.optimizer_and_apply(ctx, block)
  cosine = block.head == "cosine"
  logits = head_logits(apply, cosine)
  forward = er.replay_forward(ctx, block, logits)
  init_buffered = er.init_with_buffer(ctx, block, tx)

  def init(key, params):
    if cosine:  # the authors' bias-free cosine head in place of the model's linear one
      head_key, key = jax.random.split(key)
      params = {**params, "head": cosine_head(head_key, ctx.spec.width, ctx.num_classes)}
    return {**init_buffered(key, params), "class_seen": jnp.zeros((ctx.num_classes,), bool)}

  def loss_fn(params, frozen, batch, mem, seen):
    """ACE(batch) + CE(replayed); (loss, (terms, seen after)). Pure."""
    current, replayed = forward(params, frozen, batch, mem)
    ce_current, seen = asymmetric_ce(current, batch["labels"], batch["mask"], seen)
    ce_replay = common.masked_mean(common.per_example_ce(replayed, mem["labels"]), mem["mask"])
    return ce_current + ce_replay, (dict(ace_current=ce_current, ce_replay=ce_replay), seen)

  @common.train_step("er_ace")
  def train_step(state, batch):
    retrieve_key, update_key = jax.random.split(common.step_key(state))
    step = state["step"]
    mem = er.draw(ctx, block, state, retrieve_key)
    (loss, (terms, seen)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state["params"], state["frozen"], batch, mem, state["class_seen"])
    frozen = er.replay_statistics(ctx, block, state, mem)
    state = {**common.apply_gradients(state, grads, tx), "frozen": frozen}
    state["class_seen"] = seen
    state["buffer"] = er.store(ctx, state, step, batch, update_key)
    return state, {"loss": loss, **terms}, {}

  return base.Method(name="er_ace", init=er.with_given_draws(ctx, block, init),
                     train_step=train_step,
                     predict=lambda s, x: logits(s["frozen"], s["params"], x))


def config():
  """The `er_ace` block: the authors' cosine head, on ER's settings (the Online-LoRA paper's for
  ER), each key with its meaning and the source of its default."""
  return common.baseline_block(
      head=Key("cosine", "the classifier: 'cosine' (the authors': a bias-free linear layer on the"
               " L2-normalised features with L2-normalised class weights, times 10) | 'linear'"
               " (the model's own head, with bias)",
               authors("cosine", f"{AML}, main.py: dist_linear, on for every method named"
                       " *ace*")),
      **er.optimizer_keys(
          authors("sgd", f"{AML}, methods/base.py: plain SGD",
                  differs="'adam', " + ER_SETTINGS),
          authors("separate", f"{AML}, methods/er_ace.py: the batch and the replay in two"
                  " passes", differs=er.ONE_PASS)),
      learning_rate=Key(1e-4, "the optimiser's learning rate, constant (> 0)",
                        authors(0.1, f"{AML}, main.py: --lr (plain SGD)", batch=10,
                                differs="1e-4, " + ER_SETTINGS,
                                unscaled="1e-4, ER's Adam rate, from the Online-LoRA paper's"
                                " table")),
      weight_decay=common.shared(1e-4, authors(0.0, f"{AML}, methods/base.py: no weight decay",
                                               differs="1e-4, " + ER_SETTINGS)),
      buffer_size=common.shared(500, authors(20, f"{AML}, main.py: --mem_size, per class",
                                             differs="500, " + ER_SETTINGS)),
      replay_batch=Key(10, "stored samples drawn uniformly and replayed with each batch (full"
                       " cross-entropy), at most buffer_size; 0 = learner.batch_size (the"
                       " authors' buffer_batch_size, 10)",
                       authors(10, f"{AML}, main.py: --buffer_batch_size")))


METHODS = (base.MethodSpec(name="er_ace", build=build, config=config, report_name="ER-ACE",
                           table_row=2.5,
                           check=base.Check("step", AML, "tests/test_parity_aml.py",
                                            "and the authors' other settings and replay draws",
                                            settings={**er.aml_settings("er_ace"),
                                                      "er_ace.head": "cosine"})),)
