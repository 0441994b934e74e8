"""PyTorch's train step of the same ViT shapes on the same device, for comparison
(scripts/torch_step.py, run where PyTorch is importable; not a dependency).
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax

from olora_jax.benchmarks import ROOT
from olora_jax.benchmarks.cases import case_config


def torch_steps(rows: list[dict], batch_size: int | None, warmup: int, steps: int,
                timeout: float | None = None) -> list[dict]:
  """scripts/torch_step.py on the same device for each ViT size of `rows` (float32, the
  `reference` step with a full hard buffer); [] when PyTorch is not importable. A size whose
  run outlasts `timeout` seconds gets an error row."""
  import importlib.util

  if importlib.util.find_spec("torch") is None:
    return []
  from olora_jax.models import spec_from_config

  script = ROOT / "scripts" / "torch_step.py"
  device = "cuda" if jax.default_backend() == "gpu" else "cpu"
  out = []
  for size in dict.fromkeys(row["size"] for row in rows):
    config = case_config(size, "reference", "online_lora", batch_size)
    spec = spec_from_config(config.model)
    if not hasattr(spec, "mlp_dim"):  # a Swin: torch_step.py writes a ViT
      continue
    batch = config.learner.batch_size
    images = batch * (1 + config.learner.buffer_size)  # the batch and K whole buffered batches
    command = [sys.executable, str(script), f"--images={images}", f"--batch={batch}",
               f"--steps={steps}", f"--warmup={warmup}", f"--device={device}",
               f"--image_size={spec.image_size}", f"--patch={spec.patch_size}",
               f"--width={spec.width}", f"--depth={spec.depth}", f"--heads={spec.num_heads}",
               f"--mlp_dim={spec.mlp_dim}", "--json"]
    try:
      done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
      out.append({"size": size, "error": f"stopped after its {timeout:.0f} s budget"})
      continue
    if done.returncode != 0:
      lines = done.stderr.strip().splitlines() or ["(no output)"]
      out.append({"size": size, "error": lines[-1]})
      continue
    out.append({"size": size, "images": images, **json.loads(done.stdout.splitlines()[-1])})
  return out
