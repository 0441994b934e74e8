"""Runs the demo comparison and collects it into the committed data (docs/data/demo_comparison/).

Every registered method on the three streams of `olora_jax.comparison.STREAMS` (the disjoint demo
over seeds 0-9, the same in reversed class order and the Si-Blurry demo over seeds 0-4: 580 runs),
as `launch/sweep.py` grids into one sweep root, one stream after another, then `collect`: each
finished run's summary replaces the committed one of the same stream, method and seed.

    .venv/bin/python scripts/demo_comparison.py run --root runs/demo_comparison
    .venv/bin/python scripts/demo_comparison.py collect --root runs/demo_comparison
    .venv/bin/python scripts/demo_comparison.py render

`render` rewrites the docs' tables rendered from the data (README.md and docs/, between the
markers of `olora_jax.comparison.BLOCK_START` and `BLOCK_END`); tests/test_comparison_claims.py
fails while a page's table is not the rendering of the committed data.

A sweep resumes where it stopped, so `run` may be stopped and run again, and `--methods` or
`--streams` run a part (two parts at once, on disjoint methods, share the root). On a 2-core CPU,
two runs at a time, a run's median was 14-18 s (Online-LoRA, fine-tuning, ER) to about a minute
(the i.i.d. upper bound 56 s, OnPro 72 s): 277 of the 580 runs took 7,799 run-seconds, so the
whole comparison is about 2.3 hours. `collect` records the commit the runs were made at
(`--code`; by default this checkout's HEAD, refused while the code a run executes, olora_jax/,
launch/ or configs/, has uncommitted changes).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from olora_jax import comparison, methods, sweep  # noqa: E402

RUN_CODE = ("olora_jax", "launch", "configs")  # what a run executes


def head_commit() -> str:
  """This checkout's HEAD; SystemExit while RUN_CODE has uncommitted changes (the runs would not
  be the commit's)."""
  dirty = subprocess.run(["git", "status", "--porcelain", "--", *RUN_CODE], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
  if dirty:
    raise SystemExit(f"uncommitted changes in {', '.join(RUN_CODE)}:\n{dirty}\ncommit them (or"
                     " give the commit the runs were made at with --code)")
  return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                        text=True, check=True).stdout.strip()


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("command", choices=("run", "collect", "render"))
  parser.add_argument("--root", default="runs/demo_comparison", help="the sweep root")
  parser.add_argument("--streams", default=",".join(comparison.STREAM_NAMES),
                      help="comma separated, of " + ", ".join(comparison.STREAM_NAMES))
  parser.add_argument("--methods", default="",
                      help="comma separated (default: every registered method)")
  parser.add_argument("--code", default="", help="the commit the runs were made at (collect)")
  parser.add_argument("--data_dir", default=None, help="default: " + comparison.DATA_DIR)
  args = parser.parse_args(argv)
  names = [s for s in args.streams.split(",") if s]
  unknown = sorted(set(names) - set(comparison.STREAM_NAMES))
  if unknown:
    parser.error(f"--streams: unknown {unknown}; the comparison's streams are"
                 f" {', '.join(comparison.STREAM_NAMES)}")
  if args.command == "render":
    cells = comparison.load(args.data_dir)
    for page in comparison.rendered_pages():
      text = page.read_text()
      new = comparison.render_blocks(text, cells)
      if new != text:
        page.write_text(new)
        print(f"rendered {page.relative_to(ROOT)}")
    return 0
  if args.command == "collect":
    code = args.code or head_commit()
    try:
      paths = comparison.collect([args.root], code, args.data_dir)
    except (FileNotFoundError, ValueError) as e:  # no run under ROOT; a run of another setting
      raise SystemExit(f"error: {e}") from None
    for path in paths:
      print(f"wrote {path}")
    return 0
  chosen = [m for m in args.methods.split(",") if m] or [s.name for s in methods.specs()]
  worst = 0
  for stream in comparison.STREAMS:
    if stream.name in names:
      worst = max(worst, sweep.run_local(args.root, [os.path.relpath(ROOT / stream.config)], chosen,
                                         seeds=list(stream.seeds)))
  return worst


if __name__ == "__main__":
  sys.exit(main())
