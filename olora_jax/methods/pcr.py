"""PCR, proxy-based contrastive replay (Lin et al. 2023).

The classifier is a set of class proxies, the head's weight columns; a sample's logits are the
cosine similarities between its class-token feature and every proxy, divided by a temperature.
Each step replays `pcr.replay_batch` stored samples drawn uniformly (from step
`pcr.warmup_batches` on: the buffer warms up first) and takes one Adam step on the proxy-based
contrastive loss of the current and replayed samples together, as the authors' code computes it:
each sample is an anchor and the combined batch brings one proxy per sample, the proxy of its
class (so a class weighs by its count in the denominator); the anchor's own class is the positive
(`proxy_contrastive_loss`). Then the batch enters the reservoir.
Paper: buffer 500, 10 memory samples per batch, temperature 0.09, 4 warm-up batches, LR 1e-4,
WD 1e-4. The original code also augments the combined batch; that is left out here.

Settings that express the authors' code (FelixHuiweiLin/PCR), defaults unchanged: `optimizer='sgd'`
(their parser's plain SGD), `replay_pass='separate'` (the batch and the replayed samples in two
forward passes, in that order, as their `train_learner` does: on a model with BatchNorm each pass
normalises with its own rows and moves the running statistics), `train_alone=False` (their step
contrasts only when it replays: with nothing replayed its loss is zero, so the first batch, with
the buffer empty, only enters it). `data.replay_draws`: the reservoir decisions and replay draws
of every step are read from a file (another codebase's, olora_jax/methods/replay.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olora_jax import config_keys
from olora_jax.config_keys import Key, ours, paper
from olora_jax.methods import base, common, er


def normalise(x: jax.Array, axis: int) -> jax.Array:
  """x / max(||x||, 1e-12) along `axis`; an all-zero vector (no direction) stays zero, with a zero
  gradient. Plain jnp.linalg.norm has gradient 0/0 = NaN at a zero vector, and a zero feature
  vector is ordinary: a randomly initialised Swin (zero patch-embedding bias, no class token or
  position embedding) maps an all-zero image, as a padded row or an empty replay slot, to
  exactly zero features, and the NaN would reach every weight through the masked rows (0 * NaN).
  The zero vectors are swapped for ones before the norm and their result for zeros after, so
  every other vector goes through the same operations as before. Pure."""
  zero = jnp.all(x == 0, axis=axis, keepdims=True)
  nonzero = jnp.where(zero, 1.0, x)
  unit = nonzero / jnp.linalg.norm(nonzero, axis=axis, keepdims=True).clip(1e-12)
  return jnp.where(zero, 0.0, unit)


def cosine_logits(features: jax.Array, head: dict, temperature: float) -> jax.Array:
  """(N, D) features, head {"kernel" (D, C)} -> (N, C) cos(feature, proxy) / temperature; a zero
  feature or proxy scores 0 (`normalise`). Pure."""
  return (normalise(features, -1) @ normalise(head["kernel"], 0)) / temperature


def proxy_contrastive_loss(logits: jax.Array, labels: jax.Array, mask: jax.Array) -> jax.Array:
  """The authors' proxy-based contrastive loss. Each valid anchor i is contrasted with one proxy
  per valid sample j of the combined batch, the proxy of j's class, so a class present n_c times
  counts n_c times in the denominator; the positives are the samples of i's class, all sharing
  its proxy:
      loss_i = -log( exp(s_{i,y_i}) / sum_c n_c exp(s_{i,c}) ),   s = cosine / temperature,
  i.e. lse_c(s_{i,c} + log n_c) - s_{i,y_i} over the classes present. Mean over the valid anchors.
  logits (N, C) = s, labels (N,), mask (N,). Pure."""
  counts = jnp.sum(jax.nn.one_hot(labels, logits.shape[-1]) * mask[:, None], axis=0)
  weighted = common.restrict_logits(logits + jnp.log(jnp.maximum(counts, 1.0)), counts > 0)
  positive = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
  return common.masked_mean(jax.nn.logsumexp(weighted, axis=-1) - positive, mask)


def build(ctx: base.Context) -> base.Method:
  block = ctx.config.pcr
  tx, apply = common.optimizer_and_apply(ctx, block)

  def logits_of(frozen, params, images, **model_kwargs):
    features = apply(frozen, params, images, pre_logits=True, **model_kwargs)
    return cosine_logits(features, params["head"], block.temperature)

  forward = er.replay_forward(ctx, block, logits_of)

  @common.train_step("pcr")
  def train_step(state, batch):
    retrieve_key, update_key = jax.random.split(common.step_key(state))
    step = state["step"]
    mem = er.draw(ctx, block, state, retrieve_key)
    mem = {**mem, "mask": mem["mask"] & (step >= block.warmup_batches)}
    labels = jnp.concatenate([batch["labels"], mem["labels"]])
    mask = jnp.concatenate([batch["mask"], mem["mask"]])
    # train_alone=False: a step that replays nothing takes a zero gradient (the authors' code).
    weight = jnp.where(block.train_alone | jnp.any(mem["mask"]), 1.0, 0.0)

    def loss_fn(params):
      logits = jnp.concatenate(forward(params, state["frozen"], batch, mem))
      return weight * proxy_contrastive_loss(logits, labels, mask)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    frozen = er.replay_statistics(ctx, block, state, mem)
    state = {**common.apply_gradients(state, grads, tx), "frozen": frozen}
    state["buffer"] = er.store(ctx, state, step, batch, update_key)
    return state, {"loss": loss, "replayed": jnp.sum(mem["mask"].astype(jnp.int32))}, {}

  init = er.with_given_draws(ctx, block, er.init_with_buffer(ctx, block, tx))
  return base.Method(name="pcr", init=init, train_step=train_step,
                     predict=lambda s, x: logits_of(s["frozen"], s["params"], x))


def config():
  """The `pcr` block: each key with its meaning (the paper's appendix values)."""
  return common.baseline_block(
      learning_rate=common.shared(1e-4, paper(1e-4, rate=True)),
      weight_decay=common.shared(1e-4, paper(1e-4)),
      buffer_size=common.shared(500, common.PAPER_BUFFER),
      replay_batch=Key(10, "stored samples drawn uniformly and replayed with each batch"
                       " (\"episode memory per batch\"), at most buffer_size; 0 ="
                       " learner.batch_size",
                       paper(10, config_keys.PAPER_TABLE + ": episode memory per batch")),
      temperature=Key(0.09, "the cosine logits between features and class proxies are divided"
                      " by it (> 0)", paper(0.09, config_keys.PAPER_TABLE + ": temperature (the"
                                            " authors' cosLinear scale, FelixHuiweiLin/PCR)")),
      warmup_batches=Key(4, "steps before the first replay, while the buffer warms up (>= 0)",
                         paper(4, config_keys.PAPER_TABLE + ": warmup of buffer before"
                               " retrieve (the authors' --warmup, which their random retrieval"
                               " never reads)")),
      **er.optimizer_keys(paper("adam", config_keys.PAPER_SETTINGS), ours(er.ONE_PASS),
                          authors=AUTHORS_PCR),
      train_alone=Key(True, "a step that replays nothing (the buffer empty, or warming up)"
                      " trains on the batch alone (True) or takes a zero gradient (False: the"
                      f" authors' code, {AUTHORS_PCR[0]}, whose loss is zero without a replayed"
                      " sample)", ours("True, the warm-up the Online-LoRA paper's appendix"
                                       " states (4 batches before the first retrieval) read as"
                                       " steps on the batch alone")))


# The PCR authors' code (`er.optimizer_keys`): (the code, its learning rate, its forward passes).
AUTHORS_REPOSITORY = "FelixHuiweiLin/PCR"
AUTHORS_PCR = (f"the PCR authors' code, {AUTHORS_REPOSITORY}", "0.1", "two passes")


PAPER_RESULTS = {
    "table1": {
        "cifar100 disjoint/10 vit_b16": ((48.48, 0.15), (46.23, 1.29)),
        "imagenet_r disjoint/10 vit_b16": ((46.11, 3.03), (25.5, 0.41)),
        "imagenet_sketch disjoint/10 vit_b16": ((38.75, 0.22), (35.01, 2.12)),
        "caltech_birds2011 disjoint/5 vit_b16": ((41.11, 1.43), (29.64, 1.2)),
        "cifar100 disjoint/10 vit_s16": ((32.89, 1.47), (39.9, 2.51)),
        "imagenet_r disjoint/10 vit_s16": ((21.96, 0.27), (45.12, 0.08)),
        "imagenet_sketch disjoint/10 vit_s16": ((14.37, 0.95), (43.96, 0.48)),
        "caltech_birds2011 disjoint/5 vit_s16": ((22.28, 2.73), (29.87, 0.04)),
    },
}

METHODS = (base.MethodSpec(name="pcr", build=build, config=config, report_name="PCR",
                           table_row=6, paper_results=PAPER_RESULTS,
                           check=base.Check("step", AUTHORS_REPOSITORY, "tests/test_parity_pcr.py",
                                            "with the authors' other settings (SGD at 0.001, 100"
                                            " slots) and replay draws, their augmentation off"
                                            " (ours has none): 40 steps, 5 task ends, float32",
                                            settings={"model.name": "resnet18_reduced",
                                                      "pcr.optimizer": "sgd",
                                                      "pcr.replay_pass": "separate",
                                                      "pcr.train_alone": False,
                                                      "pcr.warmup_batches": 0,
                                                      "pcr.trainable": "all"})),)
