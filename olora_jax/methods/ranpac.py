"""RanPAC (McDonnell et al., NeurIPS 2023, "RanPAC: random projections and pre-trained models for
continual learning"): a fixed random projection of the frozen pretrained features with a
nonlinearity, and a ridge-regression head solved from streamed second-order statistics.

Paper -> code. With phi(x) (D,) the frozen model's pooled class token (`common.frozen_features`),
W_rand (D, M) drawn once from N(0, 1) (`state["projection"]`, M = `ranpac.projection_dim`) and
y the one-hot label (C,):

    h(x) = ReLU(phi(x)^T W_rand)                       (M,)   `project`
    G    = sum_t h_t h_t^T      Q = sum_t h_t y_t^T    (M, M), (M, C), accumulated every step
    W    = (G + lambda I)^{-1} Q                       (M, C) `fit` (numpy.linalg.solve's system)
    logits(x) = h(x)^T W                                (C,)   over the classes seen so far

lambda from the grid 10^k, k = `log10_ridge_min` .. `log10_ridge_max` (-8 .. 8, the released
code's grid) by held-out mean squared error, as the released code does: it fits W on the first 80%
of a task's samples and keeps the lambda whose predictions of the last 20%'s one-hot labels have the
smallest MSE, then solves with that lambda on everything. Streaming reading (ours): every
`holdout_every`-th real sample of the stream (samples 5, 10, 15, ... with the default 5, i.e. 20%)
goes to held-out accumulators (G_val, Q_val, n_val), the others to (G_fit, Q_fit). The held-out SSE
of a lambda comes from the accumulators alone (`choose_ridge`): with G_fit = V diag(e) V^T,
Z = diag(1 / (e + lambda)) V^T Q_fit (so W_fit = V Z),

    SSE(lambda) = tr(Z^T V^T G_val V Z) - 2 tr(Z^T V^T Q_val) + n_val

(one eigendecomposition serves the whole grid; the released code's MSE is SSE / (n_val C), the same
argmin). The smallest SSE wins (the first on a tie, as numpy.argmin); with no held-out sample yet,
the largest lambda. Then W = (G_fit + G_val + lambda I)^{-1} (Q_fit + Q_val), refit on all.

When: at each evaluation (`eval_state`, so every evaluation predicts with a lambda chosen on all
that was seen), and every `refit_every` train steps inside the train step for the head the loss
reads (`state["head"]`, `state["ridge"]`; one compiled function either way).

Loss (logged; the plateau boundary rule reads it; nothing is trained on it): the prequential
cross-entropy of the batch's real items under logits h(x)^T W of the head as it stood before the
batch (the head of the last refit: within `refit_every` steps it is stale by design), over the
classes seen before and the batch's own (`common.prequential_loss`; a class not in the head scores
0, its column of Q being 0). The logits are the ridge outputs as they are (regression targets in
[0, 1]); no temperature.

Readings where paper and code differ: the released code chooses lambda on the current task's data
only, fits its 80/20 split in data-loader order, and refits at task ends; ours chooses it on a
deterministic 20% of everything seen and refits at evaluations, with no task boundary. Its head has
rows for the classes seen so far only; ours masks the classes with no sample, the same prediction.
The paper's optional first phase (a parameter-efficient adaptation of the ViT, AdaptFormer, SSF or
VPT, trained on the first task, then frozen) is not implemented: this is RanPAC without it (the
paper's ablation "no PETL"). The paper on ViT-B/16: M = 10,000 (the default), ReLU, the lambda
grid above.

Cost: G_fit and G_val are two M x M float32 matrices (800 MB at M = 10,000, in the checkpoints
too); a refit is one M x M eigendecomposition and one M x M solve.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from olora_jax import config_keys
from olora_jax.config_keys import Key, authors, ours
from olora_jax.methods import base, common

RANPAC = "RanPAC/RanPAC"  # the authors' released code, where the defaults come from

HIGHEST = jax.lax.Precision.HIGHEST


def ridge_grid(block) -> np.ndarray:
  """The lambda grid 10^k, k = log10_ridge_min .. log10_ridge_max (float32)."""
  return (10.0 ** np.arange(block.log10_ridge_min, block.log10_ridge_max + 1)).astype(np.float32)


def project(features: jax.Array, projection: jax.Array) -> jax.Array:
  """h = ReLU(phi W_rand): (N, D) x (D, M) -> (N, M)."""
  return jax.nn.relu(jnp.matmul(features, projection, precision=HIGHEST))


def holdout_rows(n_seen: jax.Array, mask: jax.Array, every: int) -> jax.Array:
  """(N,) bool: the batch's real items that go to the held-out accumulators: the stream's real
  samples numbered n_seen + 1, n_seen + 2, ... whose number is a multiple of `every`."""
  number = n_seen + jnp.cumsum(mask.astype(jnp.int32))
  return mask & (number % every == 0)


def choose_ridge(gram_fit, q_fit, gram_val, q_val, n_val, ridges):
  """(lambda, SSE of every lambda of the grid) by held-out error from the accumulators alone
  (module docstring)."""
  e, v = jnp.linalg.eigh(gram_fit)
  e = jnp.maximum(e, 0.0)  # G_fit is PSD; round-off may leave tiny negative eigenvalues
  p = jnp.matmul(v.T, q_fit, precision=HIGHEST)
  a = jnp.matmul(jnp.matmul(v.T, gram_val, precision=HIGHEST), v, precision=HIGHEST)
  b = jnp.matmul(v.T, q_val, precision=HIGHEST)

  def sse(ridge):
    z = p / (e + ridge)[:, None]
    return (jnp.sum(z * jnp.matmul(a, z, precision=HIGHEST)) - 2.0 * jnp.sum(z * b) + n_val)

  errors = jax.vmap(sse)(jnp.asarray(ridges))
  best = jnp.where(n_val > 0, jnp.argmin(errors), len(ridges) - 1)
  return jnp.asarray(ridges)[best], errors


def ridge_solution(gram, q, ridge):
  """W = (G + lambda I)^{-1} Q."""
  return jnp.linalg.solve(gram + ridge * jnp.eye(gram.shape[0], dtype=gram.dtype), q)


def fit(state: dict, ridges) -> tuple[jax.Array, jax.Array]:
  """(head W (M, C), lambda): lambda chosen on the held-out accumulators, W refit on all."""
  ridge, _ = choose_ridge(state["gram_fit"], state["q_fit"], state["gram_val"], state["q_val"],
                          state["n_val"], ridges)
  return ridge_solution(state["gram_fit"] + state["gram_val"], state["q_fit"] + state["q_val"],
                        ridge), ridge


def build(ctx: base.Context) -> base.Method:
  block = ctx.config.ranpac
  features = common.frozen_features(ctx.model)
  num_classes, dim, m = ctx.num_classes, ctx.spec.width, block.projection_dim
  ridges = ridge_grid(block)

  def init(key, params):
    zeros = lambda *shape: jnp.zeros(shape, jnp.float32)  # noqa: E731
    return {"frozen": common.backbone(params),
            "projection": jax.random.normal(key, (dim, m), jnp.float32),
            "gram_fit": zeros(m, m), "q_fit": zeros(m, num_classes),
            "gram_val": zeros(m, m), "q_val": zeros(m, num_classes), "n_val": zeros(),
            "counts": zeros(num_classes), "head": zeros(m, num_classes),
            "ridge": jnp.asarray(ridges[-1]),
            "n_seen": jnp.zeros((), jnp.int32), "step": jnp.zeros((), jnp.int32)}

  def logits(state, h):
    return jnp.matmul(h, state["head"], precision=HIGHEST)

  @common.train_step("ranpac")
  def train_step(state, batch):
    h = project(features(state["frozen"], batch["images"]), state["projection"])
    loss = common.prequential_loss(logits(state, h), state["counts"], batch)
    y = common.class_one_hot(batch["labels"], batch["mask"], num_classes)
    held = holdout_rows(state["n_seen"], batch["mask"], block.holdout_every)
    h_fit = h * (batch["mask"] & ~held)[:, None]
    h_val = h * held[:, None]
    state = {**state,
             "gram_fit": state["gram_fit"] + jnp.matmul(h_fit.T, h_fit, precision=HIGHEST),
             "q_fit": state["q_fit"] + jnp.matmul(h_fit.T, y, precision=HIGHEST),
             "gram_val": state["gram_val"] + jnp.matmul(h_val.T, h_val, precision=HIGHEST),
             "q_val": state["q_val"] + jnp.matmul(h_val.T, y, precision=HIGHEST),
             "n_val": state["n_val"] + jnp.sum(held.astype(jnp.float32)),
             "counts": state["counts"] + jnp.sum(y, axis=0),
             "n_seen": state["n_seen"] + jnp.sum(batch["mask"].astype(jnp.int32)),
             "step": state["step"] + 1}
    head, ridge = jax.lax.cond(state["step"] % block.refit_every == 0,
                               lambda s: fit(s, ridges), lambda s: (s["head"], s["ridge"]),
                               state)
    state = {**state, "head": head, "ridge": ridge}
    return state, {"loss": loss, "ridge": ridge, "n_classes": jnp.sum(state["counts"] > 0)}, {}

  def predict(state, images):
    h = project(features(state["frozen"], images), state["projection"])
    return common.restrict_logits(logits(state, h), state["counts"] > 0)

  def eval_state(state):
    """What the evaluator reads: lambda chosen and the head refit on everything seen."""
    common.TRACE_COUNTS["ranpac.eval_state"] += 1
    head, ridge = fit(state, ridges)
    return {"frozen": state["frozen"], "projection": state["projection"],
            "counts": state["counts"], "head": head, "ridge": ridge}

  return base.Method(name="ranpac", init=init, train_step=train_step, predict=predict,
                     eval_state=jax.jit(eval_state))


def config():
  """The `ranpac` block: nothing is trained (no `trainable`, no learning rate)."""
  return config_keys.block(
      "",
      projection_dim=Key(10000, "M, the width of the fixed random projection (>= 1; the paper:"
                         " 10,000)", authors(10000, f"{RANPAC}, args/cifar224_publish.csv: M")),
      log10_ridge_min=Key(-8, "the ridge lambda is chosen from the grid 10^min .. 10^max (integer;"
                          " the released code: -8)",
                          authors(-8, f"{RANPAC}, RanPAC.py: the ridge grid's lowest power")),
      log10_ridge_max=Key(8, "top of that grid (integer >= log10_ridge_min; the released code:"
                          " 8)",
                          authors(8, f"{RANPAC}, RanPAC.py: the ridge grid's highest power")),
      holdout_every=Key(5, "every holdout_every-th sample is held out to choose lambda (>= 2; 5:"
                        " 20%, the released code's split)",
                        authors(5, f"{RANPAC}, RanPAC.py: the 80/20 split that chooses lambda")),
      refit_every=Key(10, "train steps between refits of the head the logged loss reads (>= 1;"
                      " *ours*; evaluations always refit)",
                      ours("the authors refit at each task end; online, the logged loss needs a"
                           " head between evaluations")))


METHODS = (base.MethodSpec(name="ranpac", build=build, config=config, report_name="RanPAC",
                           table_row=16),)
