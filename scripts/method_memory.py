"""Peak memory and step time of every method at full shape (ViT-B/16, 224 px, 100 classes) on
this machine: what fits before renting a GPU.

    .venv/bin/python scripts/method_memory.py --out memory.json
    .venv/bin/python scripts/method_memory.py --methods online_lora,er --steps 1 --warmup 1

Each method runs in a fresh process of `launch/bench.py` (`--sizes SIZE --method NAME
--fidelities FIDELITY`, on synthetic CIFAR-shaped images of 100 classes, olora_jax/data/
synthetic.py, resized to 224 px; random backbone weights, which do not change the cost). Its row
gives the peak memory (the process's peak RSS on a CPU, the device allocator's peak on a GPU/TPU),
the median step time and the passes per step; a method that fails (out of memory, for one) gets
its error's last line instead. Prints a Markdown table and writes the rows as JSON (`--out`).

It is heavy: on a CPU a ViT-B/16 step takes tens of seconds and a method's process several GB.
Run it alone on a machine it may fill, not on a shared one and not in the test suite; every
number it prints is a measurement of that machine at that time.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from olora_jax import methods  # noqa: E402
from olora_jax.data import synthetic  # noqa: E402

COLUMNS = ("method", "step_ms_median", "peak_memory_gib", "memory", "passes_per_step", "error")


def measure(method: str, args: argparse.Namespace) -> dict:
  """One method's row, from a fresh process of launch/bench.py."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "row.json")
    command = [sys.executable, str(ROOT / "launch" / "bench.py"), f"--sizes={args.size}",
               f"--fidelities={args.fidelity}", f"--method={method}", f"--steps={args.steps}",
               f"--warmup={args.warmup}", f"--batch_size={args.batch_size}",
               f"--dataset={synthetic.name(args.train_images, args.classes, args.classes)}",
               f"--out={out}"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
      lines = done.stderr.strip().splitlines() or ["(no output)"]
      return {"method": method, "error": f"exit {done.returncode}: {lines[-1][:200]}"}
    with open(out) as f:
      (row,) = json.load(f)
  return {"method": method, "step_ms_median": row["step_ms_median"],
          "peak_memory_gib": row["peak_memory_bytes"] / 2**30, "memory": row["memory"],
          "passes_per_step": row["passes_per_step"], "error": None, "bench_row": row}


def table(rows: list[dict]) -> str:
  lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  for row in rows:
    cells = []
    for name in COLUMNS:
      value = row.get(name)
      cells.append("-" if value is None else f"{value:.1f}" if isinstance(value, float)
                   else str(value))
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  names = [spec.name for spec in methods.specs()]
  parser.add_argument("--methods", default=",".join(names), help="default: every method")
  parser.add_argument("--size", default="vit_b16")
  parser.add_argument("--fidelity", default="paper")
  parser.add_argument("--classes", type=int, default=100)
  parser.add_argument("--batch_size", type=int, default=8)
  parser.add_argument("--steps", type=int, default=2, help="timed steps per method")
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--out", default="")
  args = parser.parse_args(argv)
  chosen = [m for m in args.methods.split(",") if m]
  unknown = [m for m in chosen if m not in names]
  if unknown or not chosen:
    raise SystemExit(f"error: --methods={args.methods!r}: use a comma-separated list of {names}")
  if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
    raise SystemExit(f"error: --out={args.out!r}: its directory does not exist")
  # Enough training images for the warm-up and timed steps, and one of each class per split.
  args.train_images = max(args.classes, args.batch_size * (args.warmup + args.steps + 4))
  rows = []
  for method in chosen:
    rows.append(measure(method, args))
    print(table(rows[-1:]).splitlines()[-1], flush=True)
  print(table(rows))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)
  return rows


if __name__ == "__main__":
  main()
