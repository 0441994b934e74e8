"""The device check's report: its Markdown text (the demo's comparison, the step table, each
stream's wall-time split, PyTorch's step) and its two files, device_check.json and .md.
"""

from __future__ import annotations

import json
import os

from olora_jax.benchmarks.device_demo import DEMO_RTOL
from olora_jax.benchmarks.device_stream import PAPER_SECONDS


def _fmt(v, spec: str = ".1f") -> str:
  return "-" if v is None else format(v, spec)


def stream_text(stream: dict) -> list[str]:
  """One stream's lines of the report."""
  lines = []
  if "skipped" in stream:
    return [f"{stream['compute_dtype']}: skipped ({stream['skipped']})"]
  if "error" in stream and "whole_stream" not in stream:
    lines.append(f"{stream.get('compute_dtype', '')} error: {stream['error']}")
  else:
    w = stream["whole_stream"]
    lines += [f"{stream['size']} {stream['fidelity']} {stream['compute_dtype']},"
              f" {stream['train_images']} train / {stream['test_images']} test images,"
              f" {stream['classes']} classes in {stream['tasks']} tasks, batch"
              f" {stream['batch_size']}, {stream['n_steps']} steps,"
              f" {stream['n_evaluations']} evaluations; ran {stream['steps_done']} steps in"
              f" {len(stream['segments'])} processes (exits "
              f"{', '.join(str(s['rc']) for s in stream['segments'])})", "",
              "| part | measured s | whole stream s |", "|---|---|---|"]
    for key in ("setup_seconds", "step_seconds", "eval_seconds", "host_wait_seconds",
                "checkpoint_seconds"):
      lines.append(f"| {key.removesuffix('_seconds')} | {_fmt(stream[key])} |"
                   f" {_fmt(w[key])} |")
    other = stream["loop_seconds"] - sum(stream[k] or 0 for k in (
        "step_seconds", "eval_seconds", "host_wait_seconds", "checkpoint_seconds"))
    lines += [f"| other (host hooks, logging) | {other:.1f} | {_fmt(w['other_seconds'])} |",
              f"| compile (inside the above) | {_fmt(stream['compile_seconds'])} | |",
              f"| total | {stream['process_seconds']:.1f} ({len(stream['segments'])} processes) |"
              f" {_fmt(w['total_seconds'])} ({'measured' if w['measured'] else 'extrapolated'})"
              " |", "",
              f"steady samples/s {_fmt(stream['steady_samples_per_second'])}; resume: "
              + (stream.get("resume_skipped") or "process start to the restored state"
                 f" {_fmt(stream.get('resume_seconds'))} s") + "; checkpoint"
              f" {stream['checkpoint_bytes'] / 1e6:.1f} MB, {stream['n_checkpoints']} saves in"
              f" {_fmt(stream['checkpoint_seconds'])} s; peak device memory"
              f" {_fmt(stream['peak_device_bytes'], '.3g')} B",
              f"whole stream / the paper's {PAPER_SECONDS} s on an A100 (their code):"
              f" {_fmt(stream['vs_paper'], '.2f')}"]
  if stream.get("eval_images_per_s") is not None:
    lines.append(f"evaluation: {stream['eval_images']} test images at"
                 f" {stream['eval_images_per_s']:.0f} images/s (compile included)")
  if stream.get("warm_compile_seconds") is not None:
    lines.append(f"compilation: {stream['cold_compile_seconds']:.1f} s in the first process"
                 f" (cold persistent cache), {stream['warm_compile_seconds']:.1f} s in the"
                 " resumed one (warm)")
  return lines


def report_text(report: dict) -> str:
  """The check as Markdown."""
  from olora_jax.benchmarks import cases

  v = report["versions"]
  lines = ["# Device check", "", f"device: {report['device']}",
           "versions: " + ", ".join(f"{k} {v[k]}" for k in v if v[k]),
           f"budget: {report['budget_seconds']:.0f} s, used {report['seconds']:.0f} s"]
  if report.get("peaks_gflops"):
    lines.append("measured matmul peak (GFLOP/s): " + ", ".join(
        f"{k} {x:.1f}" for k, x in report["peaks_gflops"].items()))
  demo = report.get("demo")
  if demo:
    lines += ["", "## The demo on the device against the CPU", "",
              "| run | precision | device s | CPU s | same plateaus / task ends | A_final device"
              " / CPU | max rel. diff accuracy | max rel. diff train loss | within tolerance |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, row in demo.items():
      if "skipped" in row or "error" in row:
        lines.append(f"| {name} | | | | {row.get('skipped') or row.get('error')} | | | | |")
        continue
      c = row.get("comparison", {})
      if "error" in c or not c:
        lines.append(f"| {name} | {row['matmul_precision']} | {row['seconds']:.1f} | | "
                     f"{c.get('error', 'not compared')} | | | | |")
        continue
      lines.append(
          f"| {name} | {row['matmul_precision']} | {row['seconds']:.1f} |"
          f" {_fmt(row['cpu_seconds'])} | {c['same_plateau_steps']} / {c['same_task_ends']} |"
          f" {c['A_final'][0]:.4f} / {c['A_final'][1]:.4f} | {c['accuracy_max_rel_diff']:.2e} |"
          f" {c['loss_max_rel_diff']:.2e} | {c['within_tolerance']} |")
    lines.append(f"(tolerance: accuracies {DEMO_RTOL['accuracy']:g}, train losses"
                 f" {DEMO_RTOL['loss']:g}, relative to the compared values' scale)")
  steps = report.get("steps")
  if steps:
    steps = steps + report.get("steps_scanned", [])  # the scanned row below the unrolled ones
    done = [r for r in steps if "step_ms_median" in r]
    lines += ["", "## Train step", ""]
    if done:
      lines.append(cases.table(done))
    lines += [f"- {r['size']} {r['fidelity']} {r['compute_dtype']}"
              f"{' scanned' if r.get('scan_blocks') else ''}: "
              f"{r.get('error') or r.get('skipped')}" for r in steps if "step_ms_median" not in r]
  stream = report.get("stream")
  if stream:
    lines += ["", "## Split CIFAR-100's shape end to end", ""]
    for one in (stream, *report.get("stream_other_dtypes", {}).values()):
      lines += stream_text(one) + [""]
  torch_rows = report.get("torch_steps")
  if torch_rows is not None:
    lines.append("")
    for row in torch_rows:
      lines.append(f"torch_step.py {row['size']}: " + (
          row["error"] if "error" in row else
          f"{row['device']}, step median {1e3 * row['step_s_median']:.1f} ms, min"
          f" {1e3 * row['step_s_min']:.1f} ms ({row['images']} images, reference float32)"))
    if not torch_rows:
      lines.append("torch_step.py: PyTorch is not importable here (skipped)")
  for part, why in report["skipped"].items():
    lines.append(f"- {part}: skipped ({why})")
  return "\n".join(lines) + "\n"


def write_report(out_dir: str, report: dict) -> None:
  text = report_text(report)
  for name, content in (("device_check.json", json.dumps(report, indent=1, default=str)),
                        ("device_check.md", text)):
    tmp = os.path.join(out_dir, name + ".tmp")
    with open(tmp, "w") as f:
      f.write(content)
    os.replace(tmp, os.path.join(out_dir, name))
