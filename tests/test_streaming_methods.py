"""The streaming pretrained-model baselines against NumPy: SimpleCIL's prototypes are class means,
SLDA's per-sample updates and LDA rule, RanPAC's streamed G and Q, its ridge solution and its
held-out choice of lambda; each method's logged loss is prequential (the classifier before the
batch); their config blocks are checked before any compute."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tiny_methods
from numerics import assert_close

from configs import tiny
from olora_jax import validation
from olora_jax.methods import common, ranpac, simplecil, slda
from olora_jax.models.vit import ViTSpec

SPEC = ViTSpec(width=16, depth=1, num_heads=2, mlp_dim=32, patch_size=4, image_size=16)
C = 5
SHAPE = (16, 16, 3)


def build(module, **block):
  """(method, its initial state, model) on a random tiny ViT."""
  return tiny_methods.build(module, SPEC, C, **block)


def stream(n_batches=4, n=8, classes=(0, 1, 2, 3)):
  """Batches whose last two items of every other batch are padding; the classes arrive in order
  (two per batch, the second batch brings a new one, ...)."""
  rng = np.random.default_rng(0)
  out = []
  for i in range(n_batches):
    lo = min(i, len(classes) - 2)
    labels = rng.choice(classes[lo:lo + 2], n).astype(np.int32)
    mask = np.arange(n) < (n - 2 * (i % 2))
    images = rng.integers(0, 256, (n, *SHAPE)).astype(np.float32) / 255.0
    out.append({"images": images, "labels": labels, "mask": mask})
  return out


def run(method, state, batches):
  """(final state, the logged loss of each step)."""
  step = jax.jit(method.train_step)
  losses = []
  for b in batches:
    state, scalars, _ = step(state, b)
    losses.append(float(scalars["loss"]))
  return state, losses


def features(model, state, batches):
  """(Z (N, D) float64, labels (N,)) of the real items, in stream order."""
  f = jax.jit(lambda x: model.apply({"params": state["frozen"]}, x, pre_logits=True))
  z = np.concatenate([np.asarray(f(b["images"]))[b["mask"]] for b in batches]).astype(np.float64)
  return z, np.concatenate([b["labels"][b["mask"]] for b in batches])


def ce(logits, labels):
  logits = logits - logits.max(axis=1, keepdims=True)
  log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
  return float(-log_p[np.arange(len(labels)), labels].mean())


def cosine(a, b):
  return (a / np.linalg.norm(a, axis=1, keepdims=True)) @ (
      b / np.linalg.norm(b, axis=1, keepdims=True)).T


def test_simplecil_prototypes_are_the_class_means_and_the_loss_is_prequential():
  method, state, model = build(simplecil, temperature=0.25)
  batches = stream()
  state, losses = run(method, state, batches)
  z, y = features(model, state, batches)
  seen = np.unique(y)
  means = np.stack([z[y == c].mean(0) for c in seen])
  assert_close(np.asarray(state["sums"])[seen] / np.asarray(state["counts"])[seen, None], means)
  assert_close(state["counts"], np.bincount(y, minlength=C))
  # Predictions: cosine to the prototypes / temperature over the seen classes only.
  x = batches[0]["images"]
  zx, _ = features(model, state, [{**batches[0], "mask": np.ones(len(x), bool)}])
  logits = np.asarray(method.predict(state, x))
  assert_close(logits[:, seen], cosine(zx, means) / 0.25, rtol=1e-4)
  assert (logits[:, [c for c in range(C) if c not in seen]] < -1e8).all()
  # Step 2's loss: its items under the prototypes of step 1 alone (a new class scores 0).
  n1 = batches[0]["mask"].sum()
  z1, y1, z2, y2 = z[:n1], y[:n1], z[n1:n1 + batches[1]["mask"].sum()], y[n1:]
  classes = sorted(set(y1) | set(y2[: len(z2)]))
  scores = np.stack([cosine(z2, z1[y1 == c].mean(0)[None])[:, 0] if c in y1
                     else np.zeros(len(z2)) for c in classes], axis=1) / 0.25
  assert_close(losses[1], ce(scores, np.searchsorted(classes, y2[: len(z2)])), rtol=1e-4)


@pytest.mark.parametrize("head, optimizer", [("cosine", "sgd"), ("linear", "adam")])
def test_aper_adapts_until_the_first_boundary_then_freezes(head, optimizer):
  common.TRACE_COUNTS.clear()
  method, state, model = build(simplecil, first_phase="lora", learning_rate=1e-2,
                               first_phase_head=head, first_phase_optimizer=optimizer)
  assert method.at_boundary is not None and build(simplecil)[0].at_boundary is None
  apply = common.make_apply(model)
  step = jax.jit(method.train_step)
  batches = stream(n_batches=4)
  sums = np.zeros((C, 2 * SPEC.width))
  host = {}
  for i, b in enumerate(batches):
    if i == 2:  # the boundary switch's call: the first phase ends here, for good
      state, host = method.at_boundary(state, host)
      state, host = method.at_boundary(state, host)
      assert host == {"adapted_until_step": 2}
    before = jax.tree.map(np.asarray, state["params"])
    z = np.concatenate([apply(state["frozen"], {}, b["images"], pre_logits=True),
                        apply(state["frozen"], {"lora": state["params"]["lora"]}, b["images"],
                              pre_logits=True)],
                       axis=1)
    state, scalars, _ = step(state, b)
    sums += np.eye(C)[b["labels"]][b["mask"]].T @ z[b["mask"]]
    moved = any(np.any(a != np.asarray(c)) for a, c in zip(
        jax.tree.leaves(before), jax.tree.leaves(state["params"]), strict=True))
    assert moved == (i < 2) == bool(scalars["adapting"])
    assert float(scalars["loss"]) == float(
        scalars["first_phase_ce"] if i < 2 else scalars["prototype_loss"])
  assert_close(state["sums"], sums, rtol=1e-5)  # each sample embedded as the model stood then
  assert common.TRACE_COUNTS["simplecil.train_step"] == 1  # the switch did not recompile


def test_aper_first_phase_trains_the_authors_cosine_head_over_the_classes_seen():
  """The first phase's CE, step by step, is NumPy's over sigma cos(g(x), w_c) restricted to the
  classes seen up to the batch, g the adapted model's features before the step; the head starts
  as the authors' (rows uniform in +-1/sqrt(D), sigma 1) and every part of it trains."""
  method, state, model = build(simplecil, first_phase="lora")
  head = jax.tree.map(np.asarray, state["params"]["head"])
  assert set(head) == {"kernel", "sigma"} and head["kernel"].shape == (SPEC.width, C)
  assert float(head["sigma"]) == 1.0
  assert 0 < np.abs(head["kernel"]).max() <= 1 / np.sqrt(SPEC.width)
  apply = common.make_apply(model)
  step = jax.jit(method.train_step)
  seen = set()
  for b in stream(n_batches=4):
    params = jax.tree.map(np.asarray, state["params"])
    g = np.asarray(apply(state["frozen"], {"lora": params["lora"]}, b["images"],
                         pre_logits=True), np.float64)[b["mask"]]
    y = b["labels"][b["mask"]]
    seen |= set(y.tolist())
    live = sorted(seen)
    logits = float(params["head"]["sigma"]) * cosine(g, params["head"]["kernel"].T[live])
    state, scalars, _ = step(state, b)
    assert_close(float(scalars["first_phase_ce"]), ce(logits, np.searchsorted(live, y)),
                 rtol=1e-4)
  after = jax.tree.map(np.asarray, state["params"]["head"])
  assert float(after["sigma"]) != 1.0
  assert np.any(after["kernel"][:, sorted(seen)] != head["kernel"][:, sorted(seen)])


@pytest.mark.parametrize("cosine_steps", [0, 3])
def test_aper_first_phase_optimizer_is_sgd_with_momentum_l2_and_the_schedule(cosine_steps):
  """`first_phase_optimizer` on given gradients against PyTorch's SGD rule transcribed in NumPy
  (v <- 0.9 v + g + wd theta, theta <- theta - lr_t v) with lr_t constant, or the cosine
  lr (1 + cos(pi min(t, N) / N)) / 2 over N = 3 steps (0 after)."""
  block = simplecil.config()
  block.first_phase_cosine_steps = cosine_steps
  assert (block.learning_rate, block.weight_decay) == (0.01, 5e-4)  # the authors' configs
  tx = simplecil.first_phase_optimizer(block, block.lr_reference_batch)  # their batch: 0.01
  rng = np.random.default_rng(0)
  theta = rng.normal(size=(3, 2)).astype(np.float32)
  params, opt_state = {"w": jnp.asarray(theta)}, tx.init({"w": jnp.asarray(theta)})
  expected, v = theta.astype(np.float64), np.zeros((3, 2))
  for t in range(5):
    grad = rng.normal(size=(3, 2)).astype(np.float32)
    updates, opt_state = tx.update({"w": jnp.asarray(grad)}, opt_state, params)
    params = optax.apply_updates(params, updates)
    v = 0.9 * v + grad + 5e-4 * expected
    lr = 0.01 if cosine_steps == 0 else 0.01 * (1 + np.cos(np.pi * min(t, 3) / 3)) / 2
    expected = expected - lr * v
    assert_close(params["w"], expected, rtol=1e-6)


def slda_numpy(z, y, num_classes):
  """The paper's per-sample rule, transcribed sample by sample in float64."""
  means, counts = np.zeros((num_classes, z.shape[1])), np.zeros(num_classes)
  sigma, t = np.zeros((z.shape[1],) * 2), 0
  for zi, yi in zip(z, y, strict=True):
    d = zi - means[yi]
    sigma = (t * sigma + t / (t + 1) * np.outer(d, d)) / (t + 1)
    means[yi] += d / (counts[yi] + 1)
    counts[yi] += 1
    t += 1
  return means, counts, sigma


def test_slda_updates_match_a_batch_computation_and_numpy_lda():
  method, state0, model = build(slda, shrinkage=0.05)
  # One class: the streamed covariance is the (biased) covariance of the batch, the mean its mean.
  one = [{**b, "labels": np.full_like(b["labels"], 2)} for b in stream()]
  state, _ = run(method, state0, one)
  z, _ = features(model, state, one)
  assert_close(state["means"][2], z.mean(0))
  assert_close(state["sigma"], np.cov(z.T, bias=True), rtol=1e-4)
  assert float(state["n"]) == len(z)
  # Several classes, padding: the class means are the batch means; Sigma the paper's rule.
  batches = stream()
  state, losses = run(method, state0, batches)
  z, y = features(model, state, batches)
  means, counts, sigma = slda_numpy(z, y, C)
  assert_close(state["means"], means, rtol=1e-5)
  seen = np.unique(y)
  assert_close(np.asarray(state["means"])[seen], np.stack([z[y == c].mean(0) for c in seen]))
  assert_close(state["counts"], counts)
  assert_close(state["sigma"], sigma, rtol=1e-4)
  # The LDA rule with the shrunk covariance, against NumPy's pseudo-inverse (as the paper's code).
  precision = np.linalg.pinv(0.95 * sigma + 0.05 * np.eye(len(sigma)))
  w = precision @ means.T
  expected = z @ w - 0.5 * np.sum(means.T * w, axis=0)
  logits = np.asarray(method.predict(method.eval_state(state), jnp.asarray(
      np.concatenate([b["images"][b["mask"]] for b in batches]))))
  assert_close(logits[:, seen], expected[:, seen], rtol=1e-3)
  assert (logits[:, [c for c in range(C) if c not in seen]] < -1e8).all()
  # The last step's loss: its items under the model of the steps before it.
  n_before = sum(int(b["mask"].sum()) for b in batches[:-1])
  m, _, s = slda_numpy(z[:n_before], y[:n_before], C)
  p = np.linalg.pinv(0.95 * s + 0.05 * np.eye(len(s)))
  y_last = y[n_before:]
  live = sorted(set(y[:n_before]) | set(y_last))
  scores = (z[n_before:] @ (p @ m.T) - 0.5 * np.sum(m.T * (p @ m.T), axis=0))[:, live]
  assert_close(losses[-1], ce(scores, np.searchsorted(live, y_last)), rtol=1e-3)


def ridge_numpy(h, y, held, ridges):
  """The released code's rule on the held-out split: fit on the rest, lowest held-out MSE."""
  fit, val = ~held, held
  errors = [np.mean((h[val] @ np.linalg.solve(h[fit].T @ h[fit] + r * np.eye(h.shape[1]),
                                              h[fit].T @ y[fit]) - y[val]) ** 2)
            for r in ridges]
  return ridges[int(np.argmin(errors))], np.array(errors)


def test_ranpac_streams_g_and_q_and_solves_the_ridge_as_numpy():
  method, state, model = build(ranpac, projection_dim=12, holdout_every=3, refit_every=2,
                               log10_ridge_min=-3, log10_ridge_max=4)
  batches = stream(n_batches=8)
  state, _ = run(method, state, batches)
  z, y = features(model, state, batches)
  h = np.maximum(z @ np.asarray(state["projection"], np.float64), 0.0)
  onehot = np.eye(C)[y]
  held = np.arange(1, len(y) + 1) % 3 == 0  # the 3rd, 6th, ... real sample of the stream
  assert_close(state["gram_fit"], h[~held].T @ h[~held], rtol=1e-5)
  assert_close(state["gram_val"], h[held].T @ h[held], rtol=1e-5)
  assert_close(state["q_fit"], h[~held].T @ onehot[~held], rtol=1e-5)
  assert_close(state["q_val"], h[held].T @ onehot[held], rtol=1e-5)
  assert float(state["n_val"]) == held.sum()
  # lambda: the held-out rule from the accumulators alone equals NumPy's on the samples.
  ridges = 10.0 ** np.arange(-3, 5)
  assert_close(ranpac.ridge_grid(tiny.get_config().ranpac), 10.0 ** np.arange(-8, 9))
  expected_ridge, expected_mse = ridge_numpy(h, onehot, held, ridges)
  ridge, sse = ranpac.choose_ridge(state["gram_fit"], state["q_fit"], state["gram_val"],
                                   state["q_val"], state["n_val"], ridges.astype(np.float32))
  assert_close(np.asarray(sse) / (held.sum() * C), expected_mse, rtol=1e-3)
  assert float(ridge) == pytest.approx(expected_ridge)
  # The evaluated head: numpy.linalg.solve on all the samples with that lambda.
  evaluated = method.eval_state(state)
  assert float(evaluated["ridge"]) == pytest.approx(expected_ridge)
  assert_close(evaluated["head"], np.linalg.solve(h.T @ h + expected_ridge * np.eye(12),
                                                  h.T @ onehot), rtol=1e-3)
  seen = np.unique(y)
  logits = np.asarray(method.predict(evaluated, jnp.asarray(batches[0]["images"])))
  zx, _ = features(model, state, [{**batches[0], "mask": np.ones(8, bool)}])
  hx = np.maximum(zx @ np.asarray(state["projection"], np.float64), 0.0)
  assert_close(logits[:, seen], (hx @ np.asarray(evaluated["head"], np.float64))[:, seen],
               rtol=1e-4)
  # No held-out sample yet: the largest lambda.
  none, _ = ranpac.choose_ridge(state["gram_fit"], state["q_fit"], 0 * state["gram_val"],
                                0 * state["q_val"], 0.0, ridges.astype(np.float32))
  assert float(none) == pytest.approx(1e4)


def test_ranpac_loss_reads_the_head_of_the_last_refit():
  method, state, model = build(ranpac, projection_dim=12, refit_every=2, log10_ridge_min=-2)
  batches = stream(n_batches=3)
  step = jax.jit(method.train_step)
  state, _, _ = step(state, batches[0])
  assert not np.asarray(state["head"]).any()  # step 1: no refit yet
  state, _, _ = step(state, batches[1])
  refit, ridge = ranpac.fit(state, 10.0 ** np.arange(-2, 9, dtype=np.float32))
  assert_close(state["head"], refit)
  assert float(state["ridge"]) == float(ridge)
  _, scalars, _ = step(state, batches[2])
  z, y = features(model, state, batches[2:])
  h = np.maximum(z @ np.asarray(state["projection"], np.float64), 0.0)
  live = sorted(set(np.nonzero(np.asarray(state["counts"]))[0]) | set(y))
  logits = (h @ np.asarray(state["head"], np.float64))[:, live]
  assert_close(float(scalars["loss"]), ce(logits, np.searchsorted(live, y)), rtol=1e-4)


@pytest.mark.parametrize("key, value, match", [
    ("slda.shrinkage", 0.0, r"slda.shrinkage=0.0 must be in \(0, 1\]"),
    ("simplecil.temperature", 0.0, r"simplecil.temperature=0.0 must be > 0"),
    ("simplecil.first_phase", "head", r"unknown simplecil.first_phase='head'"),
    ("simplecil.learning_rate", 0.0, r"simplecil.learning_rate=0.0 must be > 0"),
    ("simplecil.first_phase_head", "mlp", r"unknown simplecil.first_phase_head='mlp'"),
    ("simplecil.first_phase_optimizer", "lamb",
     r"unknown simplecil.first_phase_optimizer='lamb'"),
    ("simplecil.first_phase_cosine_steps", -1,
     r"simplecil.first_phase_cosine_steps=-1 must be an integer >= 0"),
    ("ranpac.projection_dim", 0, r"ranpac.projection_dim=0 must be >= 1"),
    ("ranpac.holdout_every", 1, r"ranpac.holdout_every=1 must be >= 2"),
    ("ranpac.log10_ridge_min", 9, r"ranpac.log10_ridge_min=9 and ranpac.log10_ridge_max=8"),
    ("ranpac.refit_every", 0, r"ranpac.refit_every=0 must be >= 1"),
])
def test_bad_streaming_method_config_is_refused(key, value, match):
  config = tiny.get_config()
  section, _, leaf = key.rpartition(".")
  config.method = section
  validation.check_method(config)  # the defaults pass: no trainable, no learning rate needed
  setattr(config[section], leaf, value)
  with pytest.raises(validation.InputError, match=match):
    validation.check_method(config)
