"""OnPro, online prototype learning (Wei et al., ICCV 2023), simplified for the shared loop.

Each step draws `onpro.replay_batch` stored samples uniformly. The incoming batch and the replay
draw each pass the network twice, as they are and as an augmented view (SCR's augmentation,
scr.py), to their features and a linear projection (`onpro.projection_dim`, L2-normalised). The
loss is the sum of
  OPE       online prototype equilibrium (`prototype_contrastive_loss`): per class, the mean
            projection of each view is a prototype; the 2K prototypes of the K classes present
            are contrasted (temperature `onpro.proto_temperature`), the positive of a class's
            prototype its other view's. Once over the incoming batch's classes, once over the
            replay draw's;
  instance  the supervised contrastive loss (scr.supervised_contrastive_loss, temperature
            `onpro.instance_temperature`) over the two views of the incoming batch, and once
            over those of the replay draw;
  CE        the classifier's cross-entropy on the replay draw after adaptive prototypical
            feedback (APF, `feedback_mix`), augmented: a share `onpro.mixup_base_rate` of the
            draw is mixed up with a random partner of the draw (with probability
            `onpro.mixup_p`, weight in [0, `onpro.mixup_upper`]); each remaining slot mixes two
            stored samples of a class pair drawn with probability softmax(1 / distance) between
            the classes' prototypes of the last replay draw (the closest classes most often;
            with probability mixup_p, weight ~ Beta(`onpro.mixup_alpha`, mixup_alpha)); the CE
            of a mixed sample is (1 - w) CE(first label) + w CE(second label). While the buffer
            is empty (the first step) the CE is the incoming batch's.
Then the batch enters the reservoir. Prediction: the linear head on the features.

Simplifications against the authors' code (weilllllls/OnPro), each in docs/methods/onpro.md:
no OCM rotations (16 rotated copies of every image as pseudo-classes), the instance-wise loss is
SupCon on the projections (not OCM's NT-Xent with its feature-slice term), the replay pair of the
instance loss is the unmixed draw, APF's class-pair draws are independent (not the rounded
expected counts), the first task's CE on the incoming batch is kept only while the buffer is
empty (no task id), and no class-per-task range bounds the prototypes (every class present).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from olora_jax import config_keys
from olora_jax.config_keys import Key, authors
from olora_jax.methods import base, common, replay, scr
from olora_jax.methods.pcr import normalise

ONPRO = "weilllllls/OnPro"  # the authors' released code, where the defaults come from


def class_prototypes(z: jax.Array, labels: jax.Array, mask: jax.Array, num_classes: int):
  """(mean projection of each class (C, d), zero for a class absent; classes present (C,)).
  Pure."""
  onehot = common.class_one_hot(labels, mask, num_classes)
  counts = jnp.sum(onehot, axis=0)
  return (onehot.T @ z) / jnp.maximum(counts, 1.0)[:, None], counts > 0


def prototype_contrastive_loss(z1, z2, labels, mask, num_classes: int, temperature: float):
  """OPE's loss: the normalised prototypes of the two views of the K classes present, 2K
  anchors; each anchor's positive is its class's prototype in the other view, its contrasts
  every other prototype (itself left out):
      loss = mean_i -[ p_i.p_i' / T - log sum_{j != i} exp(p_i.p_j / T) ].
  Also returns the mean of the two views' raw prototypes (C, d) and the classes present: APF's
  class means. Pure."""
  p1, present = class_prototypes(z1, labels, mask, num_classes)
  p2, _ = class_prototypes(z2, labels, mask, num_classes)
  p = jnp.concatenate([normalise(p1, -1), normalise(p2, -1)])
  valid = jnp.tile(present, 2)
  sim = (p @ p.T) / temperature
  others = ~jnp.eye(2 * num_classes, dtype=bool) & valid[None, :]
  lse = jax.nn.logsumexp(jnp.where(others, sim, common.ABSENT_LOGIT), axis=-1)
  partner = jnp.concatenate([jnp.arange(num_classes) + num_classes, jnp.arange(num_classes)])
  positive = sim[jnp.arange(2 * num_classes), partner]
  return common.masked_mean(lse - positive, valid), (p1 + p2) / 2, present


def pair_probabilities(means: jax.Array, present: jax.Array) -> jax.Array:
  """APF's class-pair distribution: (C, C) probabilities, softmax over the pairs a < b of
  present classes of 1 / ||mu_a - mu_b|| (closer prototypes, likelier); zero elsewhere. With
  fewer than two classes present, all zero. Pure."""
  c = means.shape[0]
  distance = jnp.sqrt(jnp.sum(jnp.square(means[:, None] - means[None]), axis=-1) + 1e-12)
  pairs = present[:, None] & present[None, :] & (jnp.arange(c)[:, None] < jnp.arange(c)[None])
  logits = jnp.where(pairs, 1.0 / distance, -jnp.inf)
  flat = jax.nn.softmax(jnp.where(jnp.any(pairs), logits, 0.0).reshape(-1))
  return jnp.where(pairs.reshape(-1), flat, 0.0).reshape(c, c)


def feedback_mix(key, mem: dict, buf: replay.ReplayBuffer, means, present, block, scale,
                 count: jax.Array):
  """APF: the first `count` items of the replay draw `mem` mixed up (module docstring); the rest
  of the draw's slots are masked. Returns (images, first labels, second labels, weights of the
  second, valid). Pure."""
  n = mem["labels"].shape[0]
  n_base = jnp.floor(count * block.mixup_base_rate).astype(jnp.int32)
  keys = jax.random.split(key, 8)
  # The base share: each item mixed with a random partner of the draw with probability mixup_p.
  partner = jax.random.permutation(keys[0], n)
  base_w = jax.random.uniform(keys[1], (n,), maxval=block.mixup_upper) * jax.random.bernoulli(
      keys[2], block.mixup_p, (n,))
  # The prototype-guided share: class pairs by proximity, one sample of each class from the
  # buffer, mixed (one coin for the whole share, as the code's) with weight ~ Beta.
  probs = pair_probabilities(means, present).reshape(-1)
  c = means.shape[0]
  drawn = jax.random.categorical(keys[3], jnp.log(jnp.maximum(probs, 1e-30)), shape=(n,))
  first, second = drawn // c, drawn % c
  have_pairs = jnp.sum(probs) > 0

  def pick(k, cls):  # a uniform buffer slot holding class `cls` (any valid slot if none)
    scores = jax.random.uniform(k, (buf.capacity,)) + 2.0 * (buf.labels == cls)
    return jnp.argmax(jnp.where(buf.valid, scores, -1.0))

  slot_a = jax.vmap(pick)(jax.random.split(keys[4], n), first)
  slot_b = jax.vmap(pick)(jax.random.split(keys[5], n), second)
  pair_w = jax.random.beta(keys[6], block.mixup_alpha, block.mixup_alpha, (n,)) * (
      jax.random.bernoulli(keys[7], block.mixup_p))
  stored_a = replay.gather(buf, slot_a, scale)
  stored_b = replay.gather(buf, slot_b, scale)
  drawn_slot = jnp.arange(n) < count
  guided = (jnp.arange(n) >= n_base) & drawn_slot & have_pairs
  x_a = jnp.where(guided[:, None, None, None], stored_a["images"], mem["images"])
  x_b = jnp.where(guided[:, None, None, None], stored_b["images"], mem["images"][partner])
  y_a = jnp.where(guided, stored_a["labels"], mem["labels"])
  y_b = jnp.where(guided, stored_b["labels"], mem["labels"][partner])
  w = jnp.where(guided, pair_w, base_w * mem["mask"][partner])
  valid = jnp.where(guided, stored_a["mask"] & stored_b["mask"], mem["mask"]) & drawn_slot
  images = (1.0 - w)[:, None, None, None] * x_a + w[:, None, None, None] * x_b
  return images, y_a, y_b, w, valid


def linear_projection(key: jax.Array, width: int, out: int) -> dict:
  """The projection's weights (width -> out), initialised as PyTorch's nn.Linear (uniform in
  +-1/sqrt(width))."""
  bound = 1.0 / np.sqrt(width)
  k1, k2 = jax.random.split(key)
  return {"kernel": jax.random.uniform(k1, (width, out), minval=-bound, maxval=bound),
          "bias": jax.random.uniform(k2, (out,), minval=-bound, maxval=bound)}


def draw_size(class_seen: jax.Array, n_replay: int, per_class: int) -> jax.Array:
  """How many stored samples a step replays: min(n_replay, per_class x classes seen so far),
  the authors' rule (their buffer_batch_size 64 and buffer_per_class 7), so that the replay's
  share of a step grows with the classes met instead of staying fixed. Pure."""
  return jnp.minimum(n_replay, per_class * jnp.sum(class_seen.astype(jnp.int32)))


def build(ctx: base.Context) -> base.Method:
  """OnPro from the `onpro` block."""
  block, scale, num_classes = ctx.config.onpro, ctx.config.data.input_scale, ctx.num_classes
  tx = common.make_adam(block.learning_rate, block.weight_decay)
  n_replay = common.replay_batch(ctx, block)
  features, init_network = scr.projected_network(
      ctx, block, tx, lambda key, width: linear_projection(key, width, block.projection_dim))

  def logits_of(params, f):
    return f @ params["head"]["kernel"] + params["head"]["bias"]

  def init(key, params):
    return {**init_network(key, params),
            "class_means": jnp.zeros((num_classes, block.projection_dim), jnp.float32),
            "class_means_present": jnp.zeros((num_classes,), bool),
            "class_seen": jnp.zeros((num_classes,), bool)}

  @common.train_step("onpro")
  def train_step(state, batch):
    keys = jax.random.split(common.step_key(state), 4)
    # The classes met so far, the batch's own included (the authors count them before the draw).
    state["class_seen"] = state["class_seen"] | common.classes_in(
        batch["labels"], batch["mask"], num_classes)
    count = draw_size(state["class_seen"], n_replay, block.draw_per_class)
    mem = replay.sample(state["buffer"], keys[0], n_replay, scale)
    mem["mask"] = mem["mask"] & (jnp.arange(n_replay) < count)  # a uniform subset of `count`
    has_mem = jnp.any(mem["mask"])
    mixed, y_a, y_b, w, mixed_valid = feedback_mix(
        keys[1], mem, state["buffer"], state["class_means"], state["class_means_present"], block,
        scale, count)
    b, r = batch["labels"].shape[0], n_replay
    # One augmentation call for every view (one program to compile, not three).
    augmented = scr.augment(keys[2], jnp.concatenate([batch["images"], mem["images"], mixed]),
                            scale, block.flip)
    images = jnp.concatenate([batch["images"], augmented[:b], mem["images"],
                              augmented[b:b + r], augmented[b + r:]])

    def loss_fn(params):
      f = features(state["frozen"], params, images)
      z = normalise(f @ params["projection"]["kernel"] + params["projection"]["bias"], -1)
      z_in, z_in_aug = z[:b], z[b:2 * b]
      z_mem, z_mem_aug = z[2 * b:2 * b + r], z[2 * b + r:2 * b + 2 * r]
      ope_new, _, _ = prototype_contrastive_loss(z_in, z_in_aug, batch["labels"], batch["mask"],
                                                 num_classes, block.proto_temperature)
      ope_seen, means, present = prototype_contrastive_loss(
          z_mem, z_mem_aug, mem["labels"], mem["mask"], num_classes, block.proto_temperature)
      instance = scr.supervised_contrastive_loss(
          jnp.concatenate([z_in, z_in_aug]), jnp.tile(batch["labels"], 2),
          jnp.tile(batch["mask"], 2), block.instance_temperature)
      instance = instance + scr.supervised_contrastive_loss(
          jnp.concatenate([z_mem, z_mem_aug]), jnp.tile(mem["labels"], 2),
          jnp.tile(mem["mask"], 2), block.instance_temperature)
      mixed_logits = logits_of(params, f[2 * b + 2 * r:])
      ce_mixed = common.masked_mean(
          (1.0 - w) * common.per_example_ce(mixed_logits, y_a)
          + w * common.per_example_ce(mixed_logits, y_b), mixed_valid)
      ce_first = common.masked_mean(
          common.per_example_ce(logits_of(params, f[b:2 * b]), batch["labels"]), batch["mask"])
      ce = jnp.where(has_mem, ce_mixed, ce_first)
      loss = ce + instance + ope_new + ope_seen
      return loss, dict(ce=ce, instance=instance, ope_new=ope_new, ope_seen=ope_seen,
                        means=jax.lax.stop_gradient(means), present=present)

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    state = common.apply_gradients(state, grads, tx)
    means, present = aux.pop("means"), aux.pop("present")
    state["class_means"] = jnp.where(has_mem, means, state["class_means"])
    state["class_means_present"] = jnp.where(has_mem, present, state["class_means_present"])
    state["buffer"] = replay.reservoir_update(state["buffer"], batch, keys[3], scale)
    return state, {"loss": loss, **aux}, {}

  def predict(state, images):
    return logits_of(state["params"], features(state["frozen"], state["params"], images))

  return base.Method(name="onpro", init=init, train_step=train_step, predict=predict)


def config():
  """The `onpro` block: the authors' CIFAR-100 settings (their main.py, README and training
  loop), their rate scaled to the learner's batch."""
  return common.baseline_block(
      learning_rate=Key(5e-4, "Adam's learning rate, constant (> 0; the authors' 5e-4)",
                        authors(5e-4, f"{ONPRO}, main.py: --lr (Adam in multi_runs.py)",
                                batch=10, unscaled=config_keys.ADAM_UNSCALED)),
      weight_decay=common.shared(1e-4, authors(1e-4, f"{ONPRO}, multi_runs.py: the Adam's"
                                               " weight_decay")),
      buffer_size=common.shared(500, authors(500, f"{ONPRO}, README: the CIFAR-100 command's"
                                             " --buffer_size")),
      replay_batch=Key(64, "the most stored samples drawn uniformly in a step (the draw is"
                       " min(replay_batch, draw_per_class x classes seen)), at most buffer_size;"
                       " 0 = learner.batch_size (the authors' 64)",
                       authors(64, f"{ONPRO}, main.py: --buffer_batch_size")),
      draw_per_class=Key(7, "stored samples drawn per class seen so far, up to replay_batch, so"
                         " the replay grows with the classes met (>= 1; the authors' 7)",
                         authors(7, f"{ONPRO}, train.py: buffer_per_class")),
      projection_dim=Key(128, "width of the linear projection whose normalised output the"
                         " contrastive losses compare (>= 1; the authors' 128)",
                         authors(128, f"{ONPRO}, models/Resnet18.py: the projection's width")),
      proto_temperature=Key(0.5, "tau of OPE's prototype contrastive loss (> 0; the authors'"
                            " 0.5)", authors(0.5, f"{ONPRO}, main.py: --proto_t")),
      instance_temperature=Key(0.07, "tau of the instance-wise contrastive loss (> 0; the"
                               " authors' 0.07)", authors(0.07, f"{ONPRO}, main.py: --ins_t")),
      mixup_base_rate=Key(0.9, "share of the replay draw mixed with random partners; the rest"
                          " mixes prototype-guided class pairs, in [0, 1] (the authors'"
                          " CIFAR-100 0.9)",
                          authors(0.9, f"{ONPRO}, README: the CIFAR-100 command's"
                                  " --mixup_base_rate (the parser's 0.75 is CIFAR-10's)")),
      mixup_p=Key(0.2, "probability that a sample (the base share) or the guided share is mixed"
                  " at all, in [0, 1] (the authors' CIFAR-100 0.2)",
                  authors(0.2, f"{ONPRO}, README: the CIFAR-100 command's --mixup_p (the"
                          " parser's 0.6 is CIFAR-10's)")),
      mixup_upper=Key(0.6, "the base share's mixing weight is uniform in [0, mixup_upper], in"
                      " [0, 1] (the authors' 0.6)",
                      authors(0.6, f"{ONPRO}, main.py: --mixup_upper")),
      mixup_alpha=Key(0.4, "the guided share's mixing weight ~ Beta(alpha, alpha) (> 0; the"
                      " authors' 0.4)", authors(0.4, f"{ONPRO}, main.py: --mixup_alpha")),
      flip=Key(True, "the augmented views mirror half of the images (False for data a mirror"
               " changes, as digits)",
               authors(True, f"{ONPRO}, train.py: the augmentation's horizontal flip")))


METHODS = (base.MethodSpec(name="onpro", build=build, config=config, report_name="OnPro",
                           table_row=6.6),)
