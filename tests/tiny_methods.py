"""The methods on the tiny setting: each block's sizes cut down to the width-16, 1-block ViT
(`small_config`, for the tests that run whole streams), the one stream every method runs end to
end on (`stream_config`) and its run through the command line, made once per session
(`method_run`), and a method built on a random tiny ViT (`build`, for the method tests that drive
its functions directly)."""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import tiny_run

from configs import tiny
from olora_jax import methods, validation
from olora_jax.methods import base
from olora_jax.models.vit import VisionTransformer

# Methods that use task boundaries run with the oracle switch (they are told of each task end).
TOLD_BOUNDARIES = ("inflora", "sd_lora", "dualprompt", "coda_prompt", "slca", "ease",
                   "hide_prompt")


def small_config(method: str):
  """configs/tiny.py running `method`, its block (and those of the other methods) cut down to the
  tiny model and stream: small buffers, pools, projections and ranks, a higher learning rate. A
  block not named here runs with its declared defaults."""
  c = tiny.get_config()
  c.method = method
  for block in ("er", "der_pp", "agem", "mir", "gdumb", "pcr", "lode", "ema_der_pp", "ema_rar"):
    c[block].buffer_size = 24
  for block in ("er", "der_pp", "agem", "mir", "pcr", "lode", "ema_der_pp", "ema_rar"):
    c[block].replay_batch = 4
  c.mir.n_candidates = 8
  for block in ("er_ace", "scr", "onpro"):  # the online-continual-learning baselines of issue 51
    c[block].update(buffer_size=24, replay_batch=4, learning_rate=3e-3)
  c.scr.projection_dim = c.onpro.projection_dim = 8
  c.lwf.update(learning_rate=3e-3, refresh_every=3)
  c.gdumb.epochs = 2
  c.ewc_pp.fisher_every = 3
  c.ema_der_pp.ema_warmup_steps = c.ema_rar.ema_warmup_steps = 3
  c.ema_rar.repeats = 2
  for block in ("finetune", "iid", "er", "der_pp", "ewc_pp", "agem", "mir", "pcr", "lode",
                "ema_der_pp", "ema_rar"):
    c[block].learning_rate = 3e-3
  for block in ("l2p", "mvp"):  # a small pool: 4 prompts of 2 tokens
    c[block].pool_size, c[block].prompt_length = 4, 2
  c.mvp.query = "last"  # the 1-block ViT has no block before its last
  c.l2p.top_k = 2
  c.ranpac.projection_dim = 32  # the paper's 10,000 is two 400 MB Gram matrices
  c.ranpac.refit_every = 4  # the loss's head refit inside the train step
  for block in ("inflora", "sd_lora", "ease"):  # branches of rank 2 on the width-16 model
    c[block].rank = 2
  # The prefix-tuning prompt methods on the 1-block ViT (the stream's 5 tasks pass the pool's 4
  # E-prompts and CODA-Prompt's 4 blocks: DualPrompt then selects freely, CODA-Prompt keeps
  # training its last block).
  c.dualprompt.update(g_layers=(0,), e_layers=(0,), g_prompt_length=2, prompt_length=2,
                      pool_size=4)
  c.coda_prompt.update(layers=(0,), pool_size=8, n_tasks=4, prompt_length=4, ortho_weight=0.1)
  c.hide_prompt.update(e_layers=(0,), prompt_length=2, pool_size=4, tap_epochs=2,
                       tii_alignment_epochs=2, tap_samples_per_class=8, tii_samples_per_class=8)
  if method in TOLD_BOUNDARIES:
    c.boundaries.rule = "oracle"
  return c


# The stream of the per-method runs: about 540 training samples (17 steps of 32, 5 tasks),
# checkpoints at 8, 16 and the end (test_methods_run resumes from the one at CHECKPOINT_EVERY),
# the upper bound's two passes, and every figure (the all-methods CLI test looks for them).
CHECKPOINT_EVERY = 8
STREAM = {"data.test_fraction": 0.7, "eval.eval_every": 200, "checkpoint_every": CHECKPOINT_EVERY,
          "max_to_keep": 10, "eval.write_plots": True, "iid.epochs": 2}


def stream_config(method: str, extra: dict | None = None):
  """small_config(method) on STREAM with `extra` ({dotted key: value}) on top, every other
  method's block left at configs/tiny.py's defaults: the config of the command line that
  cli_overrides writes, which a run resumed in-process must match key for key."""
  config, default = small_config(method), tiny.get_config()
  others = {s.name for s in methods.specs()} - {method}
  for block in others & set(default):  # Online-LoRA's keys are the learner block
    config[block] = default[block]
  for key, value in {**STREAM, **(extra or {})}.items():
    section, _, leaf = key.rpartition(".")
    if section not in others:
      setattr(config[section] if section else config, leaf, value)
  return config


def cli_overrides(method: str, extra: dict | None = None) -> list[str]:
  """The command-line overrides that turn configs/tiny.py into stream_config(method, extra)."""
  default = validation.flatten(tiny.get_config())
  return [f"--config.{key}={value}"
          for key, value in validation.flatten(stream_config(method, extra)).items()
          if value != default.get(key)]


def cli(script: str, *args, cache: Path) -> subprocess.CompletedProcess:
  """launch/`script` with `args`, in the repository, sharing the session's compilation cache."""
  return subprocess.run([sys.executable, str(tiny_run.ROOT / "launch" / script), *map(str, args)],
                        cwd=tiny_run.ROOT, capture_output=True, text=True, timeout=300,
                        env=tiny_run.env(cache))


def method_run(root: Path, name: str, method: str, extra: dict, cache: Path,
               *flags: str) -> tuple[Path, int, str]:
  """(workdir, exit code, stderr) of `launch/run.py` on stream_config(method, extra) (plus the
  command-line `flags`) in root/name, made once in the session: the first test to need it runs it
  under the run's lock while another waits; what it printed is kept beside it. The all-methods
  CLI test and test_methods_run read the same runs."""
  workdir = root / name
  with open(root / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    code_file = root / f"{name}.exit"
    if not code_file.is_file():
      done = cli("run.py", "--config", tiny_run.ROOT / "configs" / "tiny.py", "--workdir",
                 workdir, *cli_overrides(method, extra), *flags, cache=cache)
      tiny_run.keep_printed(workdir, done)
      code_file.write_text(str(done.returncode))
  return workdir, int(code_file.read_text()), tiny_run.printed(workdir)[1]


def build(module, spec, num_classes: int, batch_size: int = 8, **block):
  """(method, its initial state, model): `module`'s first method on a random ViT of `spec` with
  a `num_classes`-way head, its config block updated with `block`."""
  config = tiny.get_config()
  name = module.METHODS[0].name
  config.method = name
  for key, value in block.items():
    config[name][key] = value
  shape = (spec.image_size, spec.image_size, 3)
  model = VisionTransformer(spec, num_classes)
  method = module.build(base.Context(config=config, model=model, spec=spec,
                                     num_classes=num_classes, batch_size=batch_size,
                                     image_shape=shape))
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, *shape)))["params"]
  return method, jax.jit(method.init)(jax.random.key(1), params), model
