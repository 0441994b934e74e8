"""Times the dense matrix products of one Online-LoRA train step on their own: the floor the step
cannot go under in float32 on this machine, whatever is done about attention, layout and
element-wise work (docs/performance-internals.md, "Where a step spends its time").

    .venv/bin/python scripts/dense_floor.py --model vit_s16 --images 40

For every block, the products a step with a frozen backbone computes: the forward passes of q, k,
v, out, fc1 and fc2 over all tokens of `--images` images, and the gradients with respect to their
inputs (none with respect to the frozen weights). They run as one jitted program at the step's
shapes, chained so that none can be skipped. `--images 40` is `reference` fidelity's full buffer
at batch 8 (8 new images and 4 stored batches of 8); `paper` fidelity's is 12.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from olora_jax import compute  # noqa: E402
from olora_jax.models import vit  # noqa: E402


def dense_products(tokens: int, width: int, mlp_dim: int, depth: int):
  """(the jitted program, its arguments, its FLOPs)."""
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (tokens, width))
  attn = jax.random.normal(keys[1], (depth, 4, width, width)) * width**-0.5
  fc1 = jax.random.normal(keys[2], (depth, width, mlp_dim)) * width**-0.5
  fc2 = jax.random.normal(keys[3], (depth, mlp_dim, width)) * mlp_dim**-0.5

  @jax.jit
  def program(x, attn, fc1, fc2):
    y = x
    for layer in range(depth):
      for w in attn[layer]:  # q, k, v, out forward
        y = y + 1e-3 * (x @ w)
      y = y + 1e-3 * ((x @ fc1[layer]) @ fc2[layer])  # MLP forward
      for w in attn[layer]:  # their input gradients: dy @ W^T
        y = y + 1e-3 * (y @ w.T)
      y = y + 1e-3 * ((y @ fc2[layer].T) @ fc1[layer].T)
    return y

  flops = 2 * tokens * depth * (8 * width * width + 4 * width * mlp_dim)
  return program, (x, attn, fc1, fc2), flops


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="vit_s16", choices=sorted(vit.PRESETS))
  parser.add_argument("--images", type=int, default=40, help="images through the network")
  parser.add_argument("--image_size", type=int, default=224)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  if args.images < 1 or args.repeats < 1:
    raise SystemExit("error: --images and --repeats must be at least 1")
  compute.keep_host_memory()  # as launch/run.py and launch/bench.py
  spec = vit.ViTSpec(image_size=args.image_size, **vit.PRESETS[args.model])
  tokens = args.images * (1 + spec.num_patches)
  program, inputs, flops = dense_products(tokens, spec.width, spec.mlp_dim, spec.depth)
  jax.block_until_ready(program(*inputs))  # compiles
  times = []
  for _ in range(args.repeats):
    start = time.perf_counter()
    jax.block_until_ready(program(*inputs))
    times.append(time.perf_counter() - start)
  print(f"{args.model}, {args.images} images ({tokens} tokens): dense products of one step"
        f" {flops / 1e9:.1f} GFLOP in {min(times):.2f} s (median {statistics.median(times):.2f} s),"
        f" {flops / min(times) / 1e9:.0f} GFLOP/s on {compute.device_description()}")


if __name__ == "__main__":
  main()
