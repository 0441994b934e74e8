"""SLDA, deep streaming linear discriminant analysis (Hayes & Kanan 2020, "Lifelong machine
learning with deep streaming linear discriminant analysis"), on the frozen pretrained ViT.

Paper -> code. With z_t = phi(x_t) the frozen model's pooled class token (`common.frozen_features`)
and y_t its label, each sample, one at a time in stream order (`absorb`, a scan over the batch's
real items), updates the shared covariance with the class mean as it stood BEFORE the sample, then
the mean and count of its class:

    Delta_t     = t / (t + 1) (z_t - mu_y)(z_t - mu_y)^T
    Sigma_{t+1} = (t Sigma_t + Delta_t) / (t + 1)                state["sigma"], t = state["n"]
    mu_y       <- (c_y mu_y + z_t) / (c_y + 1),  c_y <- c_y + 1  state["means"], state["counts"]

Prediction is the LDA rule with the shrunk covariance (epsilon = `slda.shrinkage`, 1e-4 in the
paper):

    Lambda = [(1 - epsilon) Sigma + epsilon I]^{-1}
    w_k    = Lambda mu_k,   b_k = -1/2 mu_k^T Lambda mu_k,   score_k(z) = w_k^T z + b_k

(`lda_head`; the solve runs once per evaluation, in `eval_state`, and once per step for the loss).
The scores are the log class posteriors of a shared-covariance Gaussian with equal priors up to one
constant per sample, so the softmax over them is LDA's posterior.

Loss (logged; the plateau boundary rule reads it; nothing is trained on it): the prequential
cross-entropy of the batch's real items under the scores BEFORE the batch was absorbed
(`common.prequential_loss`: over the classes seen before and the batch's own; a class met for the
first time has mu = 0 and scores 0, its value under the rule).

Readings where paper and code differ: the released code initialises Sigma to all ones, which its
first update multiplies by t = 0, so Sigma is the zero matrix after the first sample either way
(ours starts at zero). The code inverts with a pseudo-inverse; the shrunk matrix is positive
definite for epsilon > 0, so ours solves the linear system instead (the same inverse). The code
scores every class of the dataset, a class not seen yet with mu = 0 and score 0; ours leaves a
class with no sample out of the prediction (a class without a mean is not a hypothesis of the
model). The paper's base initialisation (means and an OAS covariance fitted offline on a first
batch of classes) is not used: the stream starts from nothing, as every method here does. The
paper's features are a frozen ImageNet ResNet-18's (D = 512); it reports no ViT-B/16 setting; its
only hyperparameter is epsilon = 1e-4, the default here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olora_jax import config_keys
from olora_jax.config_keys import Key, authors
from olora_jax.methods import base, common


def absorb(means: jax.Array, counts: jax.Array, sigma: jax.Array, n: jax.Array,
           features: jax.Array, labels: jax.Array, mask: jax.Array):
  """The paper's per-sample updates over one batch's real items in order; masked (padded) items
  change nothing. Returns (means (C, D), counts (C,), sigma (D, D), n ())."""

  def one(carry, item):
    means, counts, sigma, n = carry
    z, y, valid = item
    d = z - means[y]
    delta = jnp.outer(d, d) * (n / (n + 1.0))
    new = (means.at[y].add(d / (counts[y] + 1.0)), counts.at[y].add(1.0),
           (n * sigma + delta) / (n + 1.0), n + 1.0)
    return jax.tree.map(lambda a, b: jnp.where(valid, a, b), new, carry), None

  carry, _ = jax.lax.scan(one, (means, counts, sigma, n), (features, labels, mask))
  return carry


def lda_head(means: jax.Array, sigma: jax.Array, shrinkage: float):
  """(w (D, C), b (C,)) of the LDA rule with the shrunk covariance (module docstring)."""
  dim = sigma.shape[0]
  shrunk = (1.0 - shrinkage) * sigma + shrinkage * jnp.eye(dim, dtype=sigma.dtype)
  w = jnp.linalg.solve(shrunk, means.T)
  return w, -0.5 * jnp.sum(means.T * w, axis=0)


def build(ctx: base.Context) -> base.Method:
  block = ctx.config.slda
  features = common.frozen_features(ctx.model)
  num_classes, dim = ctx.num_classes, ctx.spec.width

  def scores(state, f):
    return jnp.matmul(f, state["w"], precision="highest") + state["b"]

  def init(key, params):
    del key  # nothing random
    return {"frozen": common.backbone(params),
            "means": jnp.zeros((num_classes, dim), jnp.float32),
            "counts": jnp.zeros((num_classes,), jnp.float32),
            "sigma": jnp.zeros((dim, dim), jnp.float32),
            "n": jnp.zeros((), jnp.float32),
            "step": jnp.zeros((), jnp.int32)}

  def head(state):
    w, b = lda_head(state["means"], state["sigma"], block.shrinkage)
    return {"frozen": state["frozen"], "counts": state["counts"], "w": w, "b": b}

  @common.train_step("slda")
  def train_step(state, batch):
    f = features(state["frozen"], batch["images"])
    loss = common.prequential_loss(scores(head(state), f), state["counts"], batch)
    means, counts, sigma, n = absorb(state["means"], state["counts"], state["sigma"], state["n"],
                                     f, batch["labels"], batch["mask"])
    state = {**state, "means": means, "counts": counts, "sigma": sigma, "n": n,
             "step": state["step"] + 1}
    return state, {"loss": loss, "n_classes": jnp.sum(counts > 0)}, {}

  def predict(state, images):
    return common.restrict_logits(scores(state, features(state["frozen"], images)),
                                  state["counts"] > 0)

  def eval_state(state):
    """What the evaluator reads: the LDA rule's weights, solved once per evaluation."""
    common.TRACE_COUNTS["slda.eval_state"] += 1
    return head(state)

  return base.Method(name="slda", init=init, train_step=train_step, predict=predict,
                     eval_state=jax.jit(eval_state))


def config():
  """The `slda` block: nothing is trained (no `trainable`, no learning rate)."""
  return config_keys.block(
      "",
      shrinkage=Key(1e-4, "epsilon of the shrunk covariance (1 - epsilon) Sigma + epsilon I, in"
                    " (0, 1] (the paper: 1e-4)",
                    authors(1e-4, "tyler-hayes/Deep_SLDA, SLDA_Model.py: shrinkage_param")))


METHODS = (base.MethodSpec(name="slda", build=build, config=config, report_name="SLDA",
                           table_row=15),)
