"""launch/device_check.py rehearsed on the CPU (--allow_cpu) with the tiny model: every part runs
through its real launchers (run.py, bench.py, torch_step.py when PyTorch is importable), and its
JSON holds what docs/performance.md says it does; the whole-stream extrapolation's arithmetic."""

from __future__ import annotations

import json

import pytest

from olora_jax.benchmarks import device_check, device_steps, device_stream

# Every step case, the `reference` ones first (--step_cases).
REFERENCE_FIRST = sorted(device_steps.STEP_CASES, key=lambda case: case[0] != "reference")
STREAM = ["--stream_train=640", "--stream_test=100", "--stream_classes=10", "--stream_tasks=2",
          "--stream_eval_every=320", "--stream_checkpoint_every=4"]


# The demo part's stream: configs/tiny.py without its figures (output-only: the comparison reads
# results.json and metrics.jsonl; figures cost each of the part's two runs a second or two).
DEMO_CONFIG = """from configs import tiny


def get_config():
  config = tiny.get_config()
  config.eval.write_plots = False
  return config
"""


def test_the_check_runs_every_part_on_the_cpu_and_reports_each(tmp_path, compilation_cache):
  out = tmp_path / "out"
  out.mkdir()
  demo_config = tmp_path / "tiny_demo.py"
  demo_config.write_text(DEMO_CONFIG)
  # The budget is a ceiling: on a quiet machine every part ends long before its share does.
  device_check.main([f"--out_dir={out}", "--allow_cpu", "--size=tiny", "--budget=1200",
                     f"--demo_config={demo_config}", "--demo_runs=paper",
                     "--steps=1", "--warmup=1", "--batch_size=16", "--peak_n=128",
                     f"--step_cases={','.join(f'{f}:{d}' for f, d in REFERENCE_FIRST)}",
                     f"--compilation_cache={compilation_cache}", *STREAM])
  report = json.loads((out / "device_check.json").read_text())
  assert report["platform"] == "cpu" and report["versions"]["jax"]
  assert set(report["peaks_gflops"]) == {"float32", "bfloat16"}
  assert all(v > 0 for v in report["peaks_gflops"].values())
  assert report["skipped"] == {}

  # The demo on the "device" (this CPU) against the CPU: the same program, the same numbers.
  demo = report["demo"]["paper"]
  assert demo["rc"] == 0, demo
  comparison = demo["comparison"]
  assert comparison["within_tolerance"] and comparison["loss_max_rel_diff"] == 0.0

  # The step table: both fidelities in both compute dtypes, in the order --step_cases names them,
  # each against its dtype's peak.
  steps = report["steps"]
  assert [(r["fidelity"], r["compute_dtype"]) for r in steps] == REFERENCE_FIRST
  for row in steps:
    assert row["step_ms_median"] > 0 and row["pct_of_peak"] > 0, row
    assert row["peak_gflops"] == pytest.approx(report["peaks_gflops"][row["compute_dtype"]])

  # The stream: stopped by SIGTERM once half its checkpoints were written, resumed, finished.
  stream = report["stream"]
  assert "error" not in stream, stream
  assert [s["rc"] for s in stream["segments"]] == [143, 0]
  assert stream["finished"] and stream["steps_done"] == stream["n_steps"] == 10
  assert stream["resume_seconds"] > 0
  # Saves every 4 steps, at the SIGTERM (step `stop`, unless a save there just ran) and at the
  # end. A checkpoint carries the ledger's totals from before its own save, so the last one holds
  # every save but each process's last (the SIGTERM's, the end's); fewer: the first process's
  # totals were not carried over.
  stop = int(stream["segments"][0]["last_line"].split("/checkpoints/")[1].split(":")[0])
  first, resumed = {*range(4, stop + 1, 4), stop}, [*range(4 * (stop // 4 + 1), 10, 4), 10]
  assert stream["n_checkpoints"] == len(first) - 1 + len(resumed) - 1 >= 1, (stop, stream)
  whole = stream["whole_stream"]
  assert whole["measured"] and whole["total_seconds"] > whole["step_seconds"] > 0
  assert stream["vs_paper"] == pytest.approx(whole["total_seconds"] / device_stream.PAPER_SECONDS)
  assert stream["compute_dtype"] == "float32" and stream["eval_images_per_s"] > 0
  # Cold persistent cache in the first process, warm in the resumed one.
  assert stream["cold_compile_seconds"] > 0 and stream["warm_compile_seconds"] >= 0
  other = report["stream_other_dtypes"]["bfloat16"]  # one process, to its end or its share's
  assert other["compute_dtype"] == "bfloat16" and len(other["segments"]) == 1, other
  # The step once more with the encoder blocks scanned, beside the unrolled rows.
  (scanned,) = report["steps_scanned"]
  assert scanned["scan_blocks"] and scanned["step_ms_median"] > 0
  assert [r["scan_blocks"] for r in steps] == [False] * len(steps)
  assert [r["matmul_precision"] for r in steps] == ["highest", "highest", "default", "default"]

  assert isinstance(report["torch_steps"], list)  # [] where PyTorch is not installed
  text = (out / "device_check.md").read_text()
  for heading in ("## The demo on the device", "## Train step", "## Split CIFAR-100's shape"):
    assert heading in text


def test_an_unfinished_stream_is_extrapolated_at_its_measured_rates():
  plan = {"n_steps": 100, "checkpoint_every": 50,
          "eval_images": [(9, 100), (49, 500), (59, 600), (99, 1000)]}
  ledger = {"step_seconds": 12.0, "steady_steps": 49, "steady_seconds": 4.9, "eval_seconds": 6.0,
            "host_wait_seconds": 1.0, "checkpoint_seconds": 0.5, "n_checkpoints": 1}
  est = device_stream.extrapolate(plan, cursor=50, loop_seconds=22.0, setup_seconds=3.0,
                                 ledger=ledger)
  assert est["step_seconds"] == pytest.approx(12.0 + 50 * 0.1)  # the rest at the steady step
  # 600 images evaluated in 6 s: 1,600 more at 0.01 s each.
  assert (est["eval_images_done"], est["eval_images_total"]) == (600, 2200)
  assert est["eval_seconds"] == pytest.approx(6.0 + 1600 * 0.01)
  assert est["host_wait_seconds"] == pytest.approx(2.0)
  assert est["checkpoint_seconds"] == pytest.approx(3 * 0.5)  # at 50, 100 and the final save
  assert est["other_seconds"] == pytest.approx((22.0 - 19.5) * 2)
  assert est["total_seconds"] == pytest.approx(3.0 + 17.0 + 22.0 + 2.0 + 1.5 + 5.0)


def test_the_first_stream_process_is_not_stopped_before_it_has_trained(tmp_path, monkeypatch):
  """At 60% of its share the first process is stopped only once a step has run (else it runs on:
  an H200's float32 stream was stopped while compiling and left nothing to resume); half the
  stream's checkpoints stop it at any time."""
  saved = []
  monkeypatch.setattr(device_stream, "_checkpoint_steps", lambda workdir: saved)

  def done(elapsed: float) -> bool:  # half the stream: step 10; 60% of the share: 60 s
    return device_stream.first_process_done(str(tmp_path), 10, elapsed, 60.0)

  assert not done(30.0) and not done(90.0)  # compiling: no metrics.jsonl yet
  (tmp_path / "metrics.jsonl").write_text('{"step": 0, "event": "eval"}\n')
  assert not done(90.0)
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "samples_seen": 64, "event": "train"}\n')
  assert not done(30.0) and done(90.0)
  saved[:] = [10]
  assert done(1.0)


def test_the_step_cases_run_in_the_order_named():
  """A short budget reaches the `reference` cases when they are named first (or alone)."""
  assert device_steps.step_cases(device_steps.DEFAULT_STEP_CASES) == list(device_steps.STEP_CASES)
  assert device_steps.step_cases("reference:bfloat16,reference:float32") == [
      ("reference", "bfloat16"), ("reference", "float32")]


def test_bad_flags_are_refused_in_one_line_before_any_compute(tmp_path):
  for argv, words in ((["--out_dir="], "no output directory"),
                      ([f"--out_dir={tmp_path / 'missing'}"], "is not a directory"),
                      ([f"--out_dir={tmp_path}", "--parts=demo,nope"], "--parts"),
                      ([f"--out_dir={tmp_path}", "--demo_runs=x"], "--demo_runs"),
                      ([f"--out_dir={tmp_path}", "--budget=5"], "--budget"),
                      ([f"--out_dir={tmp_path}", "--stream_dtypes=float16"], "--stream_dtypes"),
                      ([f"--out_dir={tmp_path}", "--size=vit_z"], "--size"),
                      ([f"--out_dir={tmp_path}", "--step_cases=reference:float16"],
                       "--step_cases"),
                      ([f"--out_dir={tmp_path}", "--step_cases=paper:float32,paper:float32"],
                       "each at most once"),
                      ([f"--out_dir={tmp_path}"], "JAX sees no GPU")):  # this CPU, no --allow_cpu
    with pytest.raises(SystemExit, match=words):
      device_check.main(argv)
  assert list(tmp_path.iterdir()) == []
