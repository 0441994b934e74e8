"""Times the work of one Online-LoRA train step in PyTorch, to compare this implementation with an
eager PyTorch one on the same machine (docs/performance-internals.md, "Where a step spends its
time").

    pip install torch==2.13.0        # in a separate virtual environment: not a dependency
    python scripts/torch_step.py --images 40 --steps 3
    python scripts/torch_step.py --images 40 --steps 3 --profile   # + its op time by kind

The step: `--images` random images through a ViT (default ViT-S/16 at 224 px) whose weights are
frozen and whose attention q and v projections carry LoRA factors of rank `--rank`; the
cross-entropy of the first `--batch` images plus that of the rest (the new batch and the hard
buffer, as the loss of a step with a full buffer); gradients for the LoRA factors and the head
only; one Adam step. `--images 40 --batch 8` is `reference` fidelity's step at batch 8 with a
buffer of 4 whole batches, the shape `launch/bench.py --sizes vit_s16 --fidelities reference`
times here. Attention is written out (scores, softmax, weighted sum), as timm's ViT had it before
fused attention; `--fused` uses `torch.nn.functional.scaled_dot_product_attention` instead.

This is an independent implementation of the same arithmetic, not the authors' released code: the
number it prints is what eager PyTorch does with the same work, on the same cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
  def __init__(self, width: int, heads: int, rank: int, fused: bool):
    super().__init__()
    self.heads, self.fused = heads, fused
    self.qkv = nn.Linear(width, 3 * width)
    self.out = nn.Linear(width, width)
    # LoRA on q and v: delta W = A B, A random and B zero at the start, as a fresh LoRA.
    self.lora_a = nn.Parameter(torch.randn(2, width, rank) * rank**-0.5)
    self.lora_b = nn.Parameter(torch.zeros(2, rank, width))

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    b, n, width = x.shape
    q, k, v = self.qkv(x).chunk(3, dim=-1)
    q = q + x @ self.lora_a[0] @ self.lora_b[0]
    v = v + x @ self.lora_a[1] @ self.lora_b[1]
    q, k, v = (t.reshape(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
    if self.fused:
      o = F.scaled_dot_product_attention(q, k, v)
    else:
      scores = (q @ k.transpose(-2, -1)) * q.shape[-1]**-0.5
      o = scores.softmax(dim=-1) @ v
    return self.out(o.transpose(1, 2).reshape(b, n, width))


class Block(nn.Module):
  def __init__(self, width: int, heads: int, mlp_dim: int, rank: int, fused: bool):
    super().__init__()
    self.norm1 = nn.LayerNorm(width, eps=1e-6)
    self.attn = Attention(width, heads, rank, fused)
    self.norm2 = nn.LayerNorm(width, eps=1e-6)
    self.fc1 = nn.Linear(width, mlp_dim)
    self.fc2 = nn.Linear(mlp_dim, width)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x = x + self.attn(self.norm1(x))
    return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))  # exact (erf) GELU, as the ViTs use


class ViT(nn.Module):
  def __init__(self, args: argparse.Namespace):
    super().__init__()
    w, tokens = args.width, (args.image_size // args.patch)**2 + 1
    self.embed = nn.Conv2d(3, w, args.patch, args.patch)
    self.cls = nn.Parameter(torch.zeros(1, 1, w))
    self.pos = nn.Parameter(torch.randn(1, tokens, w) * 0.02)
    self.blocks = nn.Sequential(*[Block(w, args.heads, args.mlp_dim, args.rank, args.fused)
                                  for _ in range(args.depth)])
    self.norm = nn.LayerNorm(w, eps=1e-6)
    self.head = nn.Linear(w, args.classes)

  def forward(self, images: torch.Tensor) -> torch.Tensor:
    x = self.embed(images).flatten(2).transpose(1, 2)
    x = torch.cat([self.cls.expand(len(x), -1, -1), x], dim=1) + self.pos
    return self.head(self.norm(self.blocks(x))[:, 0])


def trained_parameters(model: ViT) -> list[nn.Parameter]:
  """Freezes every weight but the LoRA factors and the head; returns those."""
  trained = []
  for name, p in model.named_parameters():
    p.requires_grad_(name.startswith("head.") or ".lora_" in name)
    if p.requires_grad:
      trained.append(p)
  return trained


def parse(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--images", type=int, default=40, help="images through the network per step")
  p.add_argument("--batch", type=int, default=8, help="the new batch (the rest: the buffer)")
  p.add_argument("--steps", type=int, default=3, help="timed steps")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
  p.add_argument("--fused", action="store_true", help="scaled_dot_product_attention")
  p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ...")
  p.add_argument("--profile", action="store_true",
                 help="after the timed steps, one more step under torch.profiler: its op time"
                 " split as launch/bench.py --profile splits ours, and the ops that took most")
  p.add_argument("--json", action="store_true",
                 help="print one JSON line (launch/bench.py --suite accelerator reads it)")
  # ViT-S/16 at 224 px by default.
  p.add_argument("--image_size", type=int, default=224)
  p.add_argument("--patch", type=int, default=16)
  p.add_argument("--width", type=int, default=384)
  p.add_argument("--depth", type=int, default=12)
  p.add_argument("--heads", type=int, default=6)
  p.add_argument("--mlp_dim", type=int, default=1536)
  p.add_argument("--rank", type=int, default=4)
  p.add_argument("--classes", type=int, default=100)
  args = p.parse_args(argv)
  if not 0 < args.batch <= args.images:
    p.error(f"--batch={args.batch} must be in 1..--images={args.images}")
  return args


# How `--profile` sorts PyTorch's operators into the kinds launch/bench.py --profile reports for
# ours (olora_jax.compute.op_time_shares): matrix products (oneDNN/BLAS calls, the patch
# convolution), data movement (copies, transposes made contiguous, concatenations, views), and the
# rest (element-wise math, reductions, the optimizer's update).
MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
                        "aten::linear", "aten::convolution", "aten::_convolution",
                        "aten::mkldnn_convolution", "aten::convolution_backward"})
LAYOUT_OPS = frozenset({"aten::copy_", "aten::clone", "aten::contiguous", "aten::cat",
                        "aten::transpose", "aten::t", "aten::reshape", "aten::view",
                        "aten::_reshape_alias", "aten::expand", "aten::permute", "aten::slice",
                        "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::as_strided",
                        "aten::chunk", "aten::split", "aten::narrow", "aten::flatten",
                        "aten::_unsafe_view", "aten::empty", "aten::empty_like",
                        "aten::empty_strided", "aten::zeros", "aten::zero_", "aten::fill_",
                        "aten::detach", "detach", "aten::to", "aten::_to_copy"})


def op_time_split(events) -> tuple[dict[str, float], list[tuple[str, float]]]:
  """torch.profiler's key averages -> ({matmul, layout, other: fraction of the summed self CPU
  time}, [(operator, self seconds)] largest first). Self time counts each operator once, without
  the operators it calls; an operator's own worker threads run inside it."""
  per_op = {e.key: e.self_cpu_time_total / 1e6 for e in events if e.self_cpu_time_total > 0}
  kinds = dict.fromkeys(("matmul", "layout", "other"), 0.0)
  for op, seconds in per_op.items():
    kinds["matmul" if op in MATMUL_OPS else "layout" if op in LAYOUT_OPS else "other"] += seconds
  total = sum(kinds.values()) or 1.0
  return ({k: v / total for k, v in kinds.items()},
          sorted(per_op.items(), key=lambda kv: -kv[1]))


def train_steps(model: ViT, args: argparse.Namespace) -> list[float]:
  """Runs `--warmup` + `--steps` steps on random images; returns each step's seconds."""
  device = torch.device(getattr(args, "device", "cpu"))
  model.to(device)
  optimizer = torch.optim.Adam(trained_parameters(model), lr=1e-3)
  sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
  seconds = []
  profiled = getattr(args, "profile", False)
  for i in range(args.warmup + args.steps + profiled):
    if i == args.warmup + args.steps:  # the one more step, under the profiler
      profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
      profiler.__enter__()
    images = torch.randn(args.images, 3, args.image_size, args.image_size, device=device)
    labels = torch.randint(0, args.classes, (args.images,), device=device)
    sync()
    start = time.perf_counter()
    logits = model(images)
    loss = F.cross_entropy(logits[:args.batch], labels[:args.batch])
    if args.images > args.batch:
      loss = loss + F.cross_entropy(logits[args.batch:], labels[args.batch:])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    sync()  # the step's kernels done, as launch/bench.py waits for its step
    if i == args.warmup + args.steps:
      profiler.__exit__(None, None, None)
      args.op_split = op_time_split(profiler.key_averages())
      break
    seconds.append(time.perf_counter() - start)
  return seconds


def main(argv: list[str] | None = None) -> None:
  args = parse(argv)
  torch.manual_seed(0)
  timed = train_steps(ViT(args), args)[args.warmup:]
  if args.json:
    print(json.dumps({"device": args.device, "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "fused": args.fused,
                      "step_s_median": statistics.median(timed), "step_s_min": min(timed),
                      **({"op_shares": args.op_split[0]} if args.profile else {})}))
    return
  print(f"torch {torch.__version__}, {torch.get_num_threads()} threads,"
        f" {'fused' if args.fused else 'written-out'} attention, {args.images} images:"
        f" step median {statistics.median(timed):.3f} s, min {min(timed):.3f} s")
  if args.profile:
    shares, ops = args.op_split
    print("profiled step, share of the operators' self time: "
          + ", ".join(f"{kind}_pct {100 * share:.1f}" for kind, share in shares.items()))
    total = sum(seconds for _, seconds in ops)
    for op, seconds in ops[:15]:
      print(f"  {op:40s} {seconds:8.3f} s  {100 * seconds / total:5.1f}%")


if __name__ == "__main__":
  main()
