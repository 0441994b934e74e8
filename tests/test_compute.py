"""What a run costs: the compute ledger in results.json (summed over the processes of a resumed
run), the persistent compilation cache launch/run.py turns on, and launch/bench.py (numbers not
asserted: it must run and report every column)."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_methods
import tiny_run

from olora_jax import checkpointing, compute, trainer
from olora_jax.benchmarks import bench, cases
from olora_jax.benchmarks.stream import STREAM_SPLIT

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import dense_floor  # noqa: E402


def test_the_ledger_leaves_out_each_process_first_step_and_sums_over_processes():
  first = compute.Ledger({})
  first.timed_step(16, 5.0)  # compiles: not steady state
  first.timed_step(16, 0.5)
  first.timed_step(8, 0.5)
  first.timed_eval(2.0)
  first.timed_host_wait(0.25)
  first.timed_checkpoint(0.5)
  first.set_flops(1e9, 1e7)
  record = first.checkpoint_record()
  assert record["step_seconds"] == pytest.approx(6.0)
  assert first.results()["steady_samples_per_second"] == pytest.approx(24 / 1.0)
  second = compute.Ledger(json.loads(json.dumps(record)))  # as a checkpoint carries it
  second.timed_step(16, 4.0)  # the resumed process compiles again
  second.timed_step(16, 1.0)
  second.timed_host_wait(0.5)
  second.timed_checkpoint(1.0)
  out = second.results()
  assert out["step_seconds"] == pytest.approx(11.0)
  assert out["eval_seconds"] == pytest.approx(2.0)
  assert out["host_wait_seconds"] == pytest.approx(0.75)
  assert out["checkpoint_seconds"] == pytest.approx(1.5) and out["n_checkpoints"] == 2
  assert out["steady_samples_per_second"] == pytest.approx(40 / 2.0)
  assert out["passes_per_step"] == pytest.approx(100.0)
  assert out["passes_per_sample"] == pytest.approx(100.0 * 5 / 72)  # every step, every sample
  assert out["achieved_flops_per_second"] == pytest.approx(3 * 1e9 / 2.0)
  assert out["compile_seconds"] >= record["compile_seconds"] >= 0
  assert out["peak_host_rss_bytes"] > 0 and out["device"].startswith(jax.default_backend())


def test_results_carry_the_ledger_and_run_py_fills_the_compilation_cache(
    tiny_reference, compilation_cache):
  ledger = json.loads((tiny_reference / "results.json").read_text())["compute"]
  assert ledger["step_seconds"] > 0 and ledger["eval_seconds"] > 0
  # The loop waits on the host for at least its first batch; every checkpoint is timed.
  assert ledger["host_wait_seconds"] > 0 and ledger["checkpoint_seconds"] > 0
  assert ledger["n_checkpoints"] >= tiny_run.N_STEPS // tiny_run.OVERRIDES["checkpoint_every"]
  assert (ledger["step_seconds"] + ledger["eval_seconds"] + ledger["host_wait_seconds"]
          + ledger["checkpoint_seconds"]) < json.loads(
              (tiny_reference / "results.json").read_text())["wall_seconds"]
  assert ledger["steady_samples_per_second"] > 0
  assert ledger["flops_per_step"] > ledger["forward_flops_per_image"] > 0
  assert ledger["passes_per_step"] > 1  # forward and backward over the batch at least
  assert 0 < ledger["passes_per_sample"] < ledger["passes_per_step"]
  assert ledger["n_compilations"] >= 1 and ledger["compile_seconds"] > 0
  # tiny_run sets $JAX_COMPILATION_CACHE_DIR; run.py's default ('auto') uses it
  assert any(Path(compilation_cache).iterdir())


def test_a_program_loaded_from_the_persistent_cache_counts_as_compiled():
  """test_all_methods_cli holds each method to its number of programs on runs that share the
  session's persistent cache: a program the cache serves is counted as one compiled, so those
  counts are the ones with the cache off."""
  hits = []
  jax.monitoring.register_event_listener(
      lambda event, **kwargs: hits.append(event) if event.endswith("cache_hits") else None)
  fn = jax.jit(lambda x: jnp.cumsum(x * 3.0 + 1.0))
  x = np.arange(7, dtype=np.float32)
  counts = [compute.COMPILE_CLOCK.count]
  for _ in range(2):
    jax.clear_caches()  # the in-memory caches: the second call reads the persistent one
    fn(x).block_until_ready()
    counts.append(compute.COMPILE_CLOCK.count)
  assert np.diff(counts).tolist() == [1, 1] and hits, (counts, hits)


def test_a_random_model_is_drawn_by_its_own_program_shared_across_methods_with_the_same_bits():
  """trainer.run_initial_state draws a random model (no checkpoint) in a program of its own
  (random_params), then builds the method's state from it: the state is bit for bit the one the
  single program of seeded_init builds, and the draw's program is the same for two methods (one
  persistent-cache entry for a sweep's methods, and for the suite's runs)."""
  seed = np.uint32(3)
  setups = [trainer.Setup(tiny_methods.small_config(m)) for m in ("er", "ewc_pp")]
  setup = setups[0]
  one = trainer.build_state(setup.method, trainer.seeded_init(setup, setup.config), (seed, None))
  two = trainer.run_initial_state(setup, seed, None)
  # Every leaf's digest (PRNG keys by their key data), as the checkpoints' bit-exactness checks.
  assert checkpointing.array_checksums(one) == checkpointing.array_checksums(two)
  lowered = [jax.jit(trainer.random_init(s, s.config)).lower(seed).as_text() for s in setups]
  assert lowered[0] == lowered[1]


def test_keep_host_memory_applies_on_glibc_and_can_be_turned_off(monkeypatch):
  monkeypatch.setenv(compute.KEEP_HOST_MEMORY_ENV, "0")
  assert compute.keep_host_memory() is False
  monkeypatch.delenv(compute.KEEP_HOST_MEMORY_ENV)
  glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
  assert compute.keep_host_memory() is glibc


def test_peak_host_memory_is_the_process_own_not_its_parent():
  """A run started by a large process (a test worker, bench.py's cases) reports its own peak:
  Linux would carry the parent's resident size into the child's getrusage ru_maxrss."""
  parent = np.ones(2**27)  # 1 GiB, resident in this process when the child starts
  done = subprocess.run([sys.executable, "-c", "from olora_jax import compute;"
                         " print(compute.peak_host_rss_bytes())"],
                        cwd=tiny_run.ROOT, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  child = int(done.stdout)
  assert 0 < child < parent.nbytes
  assert compute.peak_host_rss_bytes() > parent.nbytes


def test_default_cache_dir(monkeypatch, tmp_path):
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
  assert compute.default_cache_dir() == str(tmp_path / "jax")
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert compute.default_cache_dir() == os.path.join(tmp_path, "xdg", "olora_jax", "jax")


def test_bench_runs_the_tiny_model_and_reports_every_column(tmp_path, compilation_cache):
  out = tmp_path / "bench.json"
  bench.main(["--sizes=tiny", "--fidelities=reference,paper", "--steps=2", "--warmup=1",
              f"--compilation_cache={compilation_cache}", f"--out={out}",
              f"--profile={tmp_path / 'profile'}"])
  rows = json.loads(out.read_text())
  assert [row["fidelity"] for row in rows] == ["reference", "paper"]
  for row in rows:
    for name, _ in cases.COLUMNS:
      assert row[name] is not None, name
    assert row["matmul_pct"] + row["layout_pct"] + row["other_pct"] == pytest.approx(100)
    # The profile's matrix products were found and classified; their share of the time is a
    # measurement (it falls under load), reported by bench.py, never asserted.
    assert row["matmul_pct"] > 0
    assert list((tmp_path / "profile" / f"tiny_{row['fidelity']}").rglob("*.xplane.pb"))
    assert row["step_ms_median"] > 0 and row["passes_per_step"] > 1
    assert row["implicit_transfers"] == "none"  # the step moves nothing behind our back
    assert row["h2d_arrays"] == 3 and row["d2h_arrays"] >= 1
  reference, paper = rows
  assert reference["passes_per_step"] > 2 * paper["passes_per_step"]  # K whole batches vs K
  if reference["memory"] == "host peak RSS":  # each case in its own process: its own peak
    assert paper["peak_memory_bytes"] < reference["peak_memory_bytes"]


# What the accelerator suite must run without (a machine with JAX, flax, optax, orbax, PyTorch and
# timm preinstalled has none of them): TFDS, TensorBoard, plotting, the demo's dataset packages.
SUITE_NEEDS_NONE_OF = ("tensorflow_datasets", "tensorflow", "tensorboardX", "tensorboard",
                       "matplotlib", "mlxtend", "sklearn")
# Runs launch/bench.py's command line with those packages missing: every finder of sys.meta_path
# is wrapped to find none of them (find_spec says None, an import raises ModuleNotFoundError).
_WITHOUT = """
import sys
class Without:
  def __init__(self, finder): self.finder = finder
  def find_spec(self, name, path=None, target=None):
    if name.split('.')[0] in {blocked!r}: return None
    find = getattr(self.finder, 'find_spec', None)
    return find(name, path, target) if find else None
  def __getattr__(self, attr): return getattr(self.finder, attr)
sys.meta_path[:] = [Without(f) for f in sys.meta_path]
sys.argv = ['launch/bench.py', *sys.argv[1:]]
from olora_jax.benchmarks import bench
bench.main()
"""


def test_accelerator_suite_runs_tiny_on_cpu_without_tfds_tensorboard_or_plotting(
    tmp_path, compilation_cache):
  """launch/bench.py --suite accelerator, shrunk to the tiny model and a 20-step stream of 10
  classes, with the packages above missing: the report has every field (numbers not
  asserted, but consistent)."""
  out = tmp_path / "suite.json"
  done = subprocess.run(
      [sys.executable, "-c", _WITHOUT.format(blocked=SUITE_NEEDS_NONE_OF), "--suite=accelerator",
       "--sizes=tiny", "--fidelities=paper", "--compute_dtypes=float32", "--steps=2",
       "--warmup=1", "--peak_n=256", "--stream_size=tiny", "--stream_train=320",
       "--stream_test=100", "--stream_classes=10", "--stream_tasks=5",
       "--stream_batch_size=16", "--stream_eval_every=80", "--stream_checkpoint_every=10",
       "--host_images=40", "--host_jpegs=2",
       f"--compilation_cache={compilation_cache}", f"--out={out}"],
      cwd=tiny_run.ROOT, env=tiny_run.env(compilation_cache), capture_output=True, text=True,
      timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report["suite"] == "accelerator" and report["device_count"] >= 1
  assert report["platform"] == jax.default_backend() and report["device_kind"]
  assert set(report["matmul_peak_gflops"]) == {"float32", "bfloat16"}
  assert all(v > 0 for v in report["matmul_peak_gflops"].values())
  (row,) = report["steps"]
  for name, _ in cases.COLUMNS:
    if name not in {f"{kind}_pct" for kind in compute.OP_KINDS}:  # those need --profile
      assert row[name] is not None, name
  assert (row["size"], row["fidelity"], row["compute_dtype"]) == ("tiny", "paper", "float32")
  stream = report["stream"]
  assert (stream["n_steps"], stream["classes"], stream["tasks"]) == (20, 10, 5)
  assert stream["n_anytime_evaluations"] == 320 // 80 and stream["n_task_end_evaluations"] == 5
  for key in (*STREAM_SPLIT, "setup_seconds", "loop_seconds"):
    assert stream[key] >= 0, key
  assert stream["step_seconds"] > 0 and stream["eval_seconds"] > 0
  assert stream["total_seconds"] >= stream["loop_seconds"] > stream["step_seconds"]
  assert stream["n_checkpoints"] >= 2 and stream["checkpoint_save_seconds"] > 0
  assert stream["checkpoint_bytes"] > 0 and stream["peak_memory_bytes"] > 0
  assert bool(report["torch_steps"]) == (importlib.util.find_spec("torch") is not None)
  assert "| step |" in done.stdout and "measured matmul peak" in done.stdout
  host = report["host"]
  assert (host["batch_size"], host["image_size"], host["stored_image_size"]) == (16, 32, 32)
  assert host["jpeg_files"]["mean_kib"] > 0 and host["jpeg_files"]["mean_height"] >= 300
  for key, images in (("pipeline_host", 40), ("pipeline_device", 40), ("jpeg_one_thread", 2),
                      ("jpeg_all_threads", 2)):
    rate = host[key]
    assert rate["images"] == images, key  # every image of the pipeline's stream pulled
    assert rate["seconds"] > 0 and 1 <= rate["cores_used"] <= rate["threads"], key
    assert rate["images_per_s"] >= rate["images_per_s_per_core"] > 0, key
    assert rate["steps_per_s"] == pytest.approx(rate["images_per_s"] / 16), key
  assert host["jpeg_one_thread"]["threads"] == 1
  assert host["stream_steps_per_s"] > 0
  assert "host input path alone" in done.stdout and "steps/s it can feed" in done.stdout


def test_accelerator_suite_runs_only_the_parts_asked_for(tmp_path):
  """--parts=host: the matmul peaks and the host pipeline, no step case, stream or PyTorch."""
  report = bench.main(["--suite=accelerator", "--parts=host", "--peak_n=64", "--stream_size=tiny",
                       "--stream_classes=10", "--stream_tasks=5", "--stream_batch_size=16",
                       "--host_images=20", "--host_jpegs=0", f"--out={tmp_path / 's.json'}"])
  assert report == json.loads((tmp_path / "s.json").read_text())
  assert report["steps"] == [] and report["stream"] is None and report["torch_steps"] is None
  host = report["host"]
  assert host["pipeline_host"]["images"] == host["pipeline_device"]["images"] == 20
  assert host["jpeg_one_thread"] is None and host["stream_steps_per_s"] is None


def test_op_time_shares_split_a_traced_program_by_kind(tmp_path):
  """A product, a transpose copied out and element-wise math, each timed in its own kind; a
  trace of another program holds none of this one's ops."""
  # Three inputs, so that XLA cannot fuse the transpose with the element-wise work.
  program = jax.jit(lambda a, b, c: (a @ b, c.T, jnp.tanh(jnp.exp(a))))
  args = (jnp.ones((512, 512)), jnp.ones((512, 512)), jnp.ones((512, 256)))
  hlo_text = program.lower(*args).compile().as_text()
  with jax.profiler.trace(str(tmp_path)):
    jax.block_until_ready(program(*args))
  profile = jax.profiler.ProfileData.from_file(str(next(tmp_path.rglob("*.xplane.pb"))))
  shares = compute.op_time_shares(profile, hlo_text)
  assert shares["matmul"] > 0 and shares["layout"] > 0 and shares["other"] > 0
  assert sum(shares.values()) == pytest.approx(1)
  other_text = jax.jit(lambda a: a - 1).lower(args[0]).compile().as_text()
  assert compute.op_time_shares(profile, other_text) is None


def test_dense_floor_program_computes_the_products_it_counts():
  """XLA's FLOP estimate of scripts/dense_floor.py's program: its products (the count the script
  reports) plus the few element-wise adds and scalings that chain them."""
  program, inputs, flops = dense_floor.dense_products(tokens=8, width=16, mlp_dim=32, depth=2)
  assert flops == 2 * 8 * 2 * (8 * 16 * 16 + 4 * 16 * 32)
  assert compute.flops(program.lower(*inputs)) == pytest.approx(flops, rel=0.1)


def test_torch_step_trains_only_the_lora_factors_and_the_head():
  """scripts/torch_step.py (PyTorch is not a dependency: runs where it is installed)."""
  torch = pytest.importorskip("torch")
  import torch_step

  tiny = ["--image_size", "16", "--patch", "8", "--width", "16", "--depth", "2", "--heads", "2",
          "--mlp_dim", "32", "--classes", "5"]
  model = torch_step.ViT(torch_step.parse(tiny))
  trained = torch_step.trained_parameters(model)
  names = [n for n, p in model.named_parameters() if p.requires_grad]
  assert len(trained) == len(names) == 2 * 2 + 2  # A and B per block, the head's weight and bias
  assert all(".lora_" in n or n.startswith("head.") for n in names)
  assert not all(p.requires_grad for p in model.parameters())
  frozen = model.blocks[0].attn.qkv.weight.detach().clone()
  lora_b = model.blocks[0].attn.lora_b.detach().clone()
  args = torch_step.parse([*tiny, "--images", "6", "--batch", "4", "--steps", "2", "--warmup", "0"])
  assert len(torch_step.train_steps(model, args)) == 2
  assert torch.equal(model.blocks[0].attn.qkv.weight, frozen)
  assert not torch.equal(model.blocks[0].attn.lora_b, lora_b)
  # --profile: one more step under the profiler, not among the timed ones; its op time split
  # into the three kinds ours reports, the products found by name.
  args = torch_step.parse([*tiny, "--images", "6", "--batch", "4", "--steps", "1", "--warmup", "0",
                           "--profile"])
  assert len(torch_step.train_steps(model, args)) == 1
  shares, ops = args.op_split
  assert set(shares) == {"matmul", "layout", "other"} and sum(shares.values()) == pytest.approx(1)
  assert shares["matmul"] > 0 and {"aten::mm", "aten::addmm"} & {op for op, _ in ops}


def test_hlo_ops_read_tuple_results_fusions_and_library_products():
  """A GPU-style module: a cuBLAS GEMM custom call with a tuple result counts as a product."""
  text = "\n".join([
      "HloModule jit_f, entry_computation_layout={(f32[4,4]{1,0})->f32[4,4]{1,0}}",
      "%fused_add (param_0: f32[4,4]) -> f32[4,4] {",
      "  %param_0 = f32[4,4]{1,0} parameter(0)",
      "  ROOT %add.1 = f32[4,4]{1,0} add(%param_0, %param_0)",
      "}",
      "ENTRY %main.2 (p: f32[4,4]) -> f32[4,4] {",
      "  %p = f32[4,4]{1,0} parameter(0)",
      "  %gemm = (f32[4,4]{1,0}, s8[16]{0}) custom-call(%p, %p),"
      " custom_call_target=\"__cublas$gemm\", backend_config={}",
      "  %gte = f32[4,4]{1,0} get-tuple-element(%gemm), index=0",
      "  ROOT %fusion = f32[4,4]{1,0} fusion(%gte), kind=kLoop, calls=%fused_add",
      "}"])
  module, instructions, computations = compute._hlo_ops(text)
  assert module == "jit_f"
  assert instructions["gemm"] == ("dot", None)
  assert instructions["fusion"] == ("fusion", "fused_add")
  assert computations["fused_add"] == {"parameter", "add"}


@pytest.mark.parametrize("argv, message", [
    (["--sizes=vit_g14"], "--sizes='vit_g14'"),
    (["--fidelities=fast"], "--fidelities='fast'"),
    (["--steps=0"], "at least 1"),
    (["--out=/nonexistent/dir/b.json"], "its directory does not exist"),
    (["--peak_gflops=-1"], "--peak_gflops=-1.0 must be >= 0"),
    (["--suite=gpu"], "--suite='gpu'"),
    (["--compute_dtypes=float16"], "--compute_dtypes='float16'"),
    (["--suite=accelerator", "--stream_size=vit_x"], "--stream_size='vit_x'"),
    (["--suite=accelerator", "--stream_classes=100", "--stream_test=50"], "each of its"),
    (["--suite=accelerator", "--host_images=50"], "--host_images=50: the host pipeline's"),
    (["--suite=accelerator", "--host_jpegs=-1"], "--host_jpegs=-1"),
    (["--suite=accelerator", "--parts=host,gpu"], "--parts='host,gpu'"),
])
def test_bench_refuses_bad_arguments_before_any_compute(argv, message):
  with pytest.raises(SystemExit, match=message) as refused:
    bench.main(argv)
  assert "\n" not in str(refused.value)  # one line


def test_bfloat16_runs_the_stream_and_tracks_float32(tmp_path, tiny_reference, compilation_cache):
  """The tiny stream end to end with model.compute_dtype=bfloat16: every train loss within 2% of
  the float32 run's, and the final accuracy within 5 points."""
  workdir = tmp_path / "bf16"
  done = tiny_run.run(workdir, compilation_cache, "--config.model.compute_dtype=bfloat16")
  assert done.returncode == 0, done.stderr[-2000:]

  def losses(run: Path) -> np.ndarray:
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return np.array([e["loss"] for e in events if e["event"] == "train"])

  bf16, f32 = losses(workdir), losses(tiny_reference)
  assert len(bf16) == len(f32) == tiny_run.N_STEPS
  np.testing.assert_allclose(bf16, f32, rtol=0.02)
  a16, a32 = (json.loads((d / "results.json").read_text())["A_final"]
              for d in (workdir, tiny_reference))
  assert abs(a16 - a32) <= 0.05


def test_flops_of_a_backend_that_estimates_only_compiled_programs():
  """JAX's CUDA plugin (PJRT's C API) refuses Lowered.cost_analysis: the compiled program's
  estimate is used, the same number XLA gives for the lowered one where both exist."""
  program = jax.jit(lambda a, b: (a @ b).sum())
  lowered = program.lower(jnp.ones((16, 8)), jnp.ones((8, 4)))

  class CompiledOnly:  # a lowered program as the GPU plugin's backend answers for it
    def cost_analysis(self):
      raise NotImplementedError("Lowered.cost_analysis not implemented on platform 'cuda'")

    def compile(self):
      return lowered.compile()

  assert compute.flops(CompiledOnly()) == pytest.approx(compute.flops(lowered), rel=0.1)
  assert compute.flops(CompiledOnly()) > 0
