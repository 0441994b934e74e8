"""A continual-learning loop of your own, on your own arrays, from `olora_jax`'s public API.

This is Online-LoRA's algorithm written out (what `olora_jax.train_and_evaluate` does, minus
checkpoints, logging and prefetching), so you can change any step: the objective, when to
consolidate, what to evaluate. Run it (seconds on a CPU):

    .venv/bin/python examples/custom_loop.py

The arrays here are scikit-learn's 8x8 digits; replace `my_arrays` with yours: uint8 images
(N, H, W, 1|3) and integer labels (N,) in 0..C-1. The backbone is the demo's tiny ViT shipped
with the package (width 64, 2 blocks, 32x32), read by `olora_jax.load_pretrained`; pass
`pretrained=None` and small sizes for a random one (the test suite does).
"""

from __future__ import annotations

import os

import jax
import numpy as np

import olora_jax as ol

SHIPPED_BACKBONE = os.path.join(os.path.dirname(ol.__file__), "assets",
                                "vit_tiny_digits.safetensors")


def my_arrays() -> tuple[np.ndarray, np.ndarray]:
  """Your data: images (N, H, W, 1) uint8 and labels (N,) int."""
  from sklearn.datasets import load_digits

  digits = load_digits()
  images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
  return images, digits.target.astype(np.int64)


def run(images: np.ndarray, labels: np.ndarray, n_tasks: int = 5, batch_size: int = 16,
        image_size: int = 32, width: int = 64, depth: int = 2,
        pretrained: str | None = SHIPPED_BACKBONE, learning_rate: float = 1e-3,
        mean_threshold: float = 3.5, var_threshold: float = 0.05, seed: int = 0,
        log=print) -> dict:
  """Online-LoRA over a disjoint class-incremental stream of (images, labels); returns the
  accuracy matrix a_{i,j} (T, T), A_final, Forgetting and the number of plateaus."""
  # Data: a seeded 80/20 split per class, and a task-free stream of example ids.
  train, test = ol.split_arrays("my_arrays", images, labels, None, test_fraction=0.2,
                                split_seed=0)
  num_classes = train.num_classes
  stream = ol.disjoint_class_incremental(train.labels, n_tasks, batch_size, seed,
                                         num_classes=num_classes)

  # Model: a tiny ViT; its backbone is frozen, LoRA factors + head are trained.
  spec = ol.ViTSpec(width=width, depth=depth, num_heads=4, mlp_dim=4 * width, patch_size=4,
                    image_size=image_size)
  model = ol.VisionTransformer(spec, num_classes)
  init_key, lora_key = jax.random.split(jax.random.key(seed))
  params = jax.jit(model.init)(init_key, np.zeros((1, image_size, image_size, 3),
                                                  np.float32))["params"]
  if pretrained:  # the backbone from a file; the C-way head stays fresh
    params = {**ol.load_pretrained(pretrained, spec, num_classes, "timm"),
              "head": params["head"]}
  backbone, head = ol.split_params(params)

  # Learner: Online-LoRA's jitted functions, its state, the hard buffer, the plateau detector.
  config = ol.LearnerConfig(rank=4, reg_lambda=2000.0)
  tx = ol.make_optimizer(learning_rate)
  learner = ol.make_learner(model, tx, config)
  frozen = ol.init_frozen(backbone, spec, config)
  state = ol.init_train_state(lora_key, head, spec, config, tx)
  buffer = ol.init_buffer(config, 4, batch_size, (image_size, image_size, 3))
  plateau_config = ol.PlateauConfig(window=5, mean_threshold=mean_threshold,
                                    var_threshold=var_threshold)
  window = ol.init_plateau()

  # The evaluator calls `predict(model, images)` on whatever model it is given: here the pair
  # (state, frozen) of the learner's functions.
  evaluator = ol.Evaluator(test, image_size, 128, num_classes,
                           lambda model, images: learner.predict(*model, images))
  groups = stream.evaluation_groups(ol.domains_of(test))  # by class here (no domains)
  task_ends = set(stream.task_end_steps().tolist())
  seen, columns = set(), []
  for step, ids in enumerate(stream.steps):
    batch_images, batch_labels = train.get(ids)
    batch = ol.make_batch(batch_images, batch_labels, batch_size, image_size)
    seen |= set(batch_labels.tolist())
    # 1-2: loss on batch + hard buffer (+ L_LoRA), one Adam step.
    state, scalars, scores = learner.train_step(state, frozen, buffer, batch)
    # 3: the loss window decides, on the host, whether the loss surface is on a plateau.
    window, stats = ol.update_plateau(window, float(scalars["window_value"]), plateau_config)
    if stats.fired:  # 4: importance on the buffer, Omega, merge, a new LoRA.
      state, frozen = learner.consolidate(state, frozen, buffer)
    # 5: the hard buffer keeps the K highest pre-update losses.
    buffer = learner.update_buffer(buffer, batch, scores)
    if step in task_ends:  # the evaluator alone knows where tasks end
      counts = evaluator.all_counts((state, frozen), np.array(sorted(seen)))
      columns.append(ol.group_accuracies(counts, groups))
      log(f"task {len(columns) - 1} ends at step {step}: accuracy per task "
          + " ".join(f"{100 * a:.1f}" for a in columns[-1]))
  acc = np.array(columns).T  # (T, T): a_{i,j}
  results = {"acc_matrix": acc, "A_final": ol.metrics.a_final(acc),
             "forgetting": ol.metrics.forgetting(acc), "n_plateaus": window.n_plateaus}
  log(f"A_final {100 * results['A_final']:.2f}%  Forgetting {100 * results['forgetting']:.2f}%"
      f"  plateaus {results['n_plateaus']}")
  return results


if __name__ == "__main__":
  run(*my_arrays())
