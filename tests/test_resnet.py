"""The reduced ResNet-18 of online continual learning (model.name='resnet18_reduced'): its shapes,
its parameter count against the architecture's own arithmetic, BatchNorm's two modes and running
statistics, a short ER run through the command line, and the one-line refusals (methods that do
not train the whole model, a pretrained checkpoint) before anything is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_run
from numerics import assert_close, reduction_rtol
from test_all_methods_cli import documented_programs

from configs import tiny
from olora_jax import models, trainer
from olora_jax.methods import common
from olora_jax.models import resnet

ROOT = Path(__file__).resolve().parents[1]


def _model(num_classes=100, image_size=32):
  spec = resnet.ResNetSpec(image_size=image_size)
  return resnet.ReducedResNet(spec, num_classes)


def _init(model, image_size: int) -> dict:
  """The model's variables, initialised in one compiled program (eagerly, each of the network's
  hundreds of initialiser and convolution ops compiles a program of its own)."""
  return jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, image_size, image_size, 3)))


def _apply(model, **kwargs):
  """model.apply compiled, traced afresh (so under the BatchNorm mode in force when called)."""
  return jax.jit(lambda variables, x: model.apply(variables, x, **kwargs))


def _count_by_arithmetic(nf: int, num_classes: int) -> int:
  """The reduced ResNet-18's trainable parameters counted from its definition: bias-free 3x3
  convs, BN scale and bias per channel, 1x1 conv + BN shortcuts where the width changes, a
  linear head with bias."""
  conv = lambda k, cin, cout: k * k * cin * cout  # noqa: E731
  bn = lambda c: 2 * c  # noqa: E731
  total = conv(3, 3, nf) + bn(nf)
  cin = nf
  for stage in range(4):
    cout = nf * 2 ** stage
    for block in range(2):
      total += conv(3, cin, cout) + bn(cout) + conv(3, cout, cout) + bn(cout)
      if block == 0 and cin != cout:
        total += conv(1, cin, cout) + bn(cout)
      cin = cout
  return total + cin * num_classes + num_classes


def test_parameter_count_is_the_reduced_resnet18s_at_nf_20_and_100_classes():
  model = _model()
  # Shapes alone: the initialiser traced, nothing computed.
  params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"]
  trained = {k: v for k, v in params.items() if k != resnet.BATCH_STATS}
  count = sum(x.size for x in jax.tree.leaves(trained))
  assert count == _count_by_arithmetic(20, 100) == 1_109_240
  # Running mean and variance for every BN channel: the BN parameters' count.
  bn_channels = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(trained)
                    if path[-2].key.startswith("bn") and path[-1].key == "scale")
  assert sum(x.size for x in jax.tree.leaves(params[resnet.BATCH_STATS])) == 2 * bn_channels
  assert params["stem"]["conv"]["kernel"].shape == (3, 3, 3, 20)  # 3x3 stem, nf = 20
  assert params["head"]["kernel"].shape == (160, 100)  # 8 nf features


@pytest.mark.parametrize("image_size", [32, 64])
def test_forward_shapes(image_size):
  model = _model(10, image_size)  # shapes alone: traced, nothing computed
  variables = jax.eval_shape(model.init, jax.random.key(0),
                             jnp.zeros((1, image_size, image_size, 3)))
  x = jax.ShapeDtypeStruct((3, image_size, image_size, 3), jnp.float32)
  assert jax.eval_shape(model.apply, variables, x).shape == (3, 10)
  assert jax.eval_shape(_apply(model, pre_logits=True), variables, x).shape == (3, 160)  # GAP


def test_batch_norm_trains_on_batch_statistics_and_evaluates_on_running_ones():
  model = _model(4, 16)
  variables = _init(model, 16)
  x = 3.0 + 2.0 * jax.random.normal(jax.random.key(1), (6, 16, 16, 3))
  # Training mode: each example's logits depend on the rest of the batch.
  train = _apply(model)
  assert not np.allclose(train(variables, x)[:3], train(variables, x[:3]), atol=1e-6)
  with resnet.running_statistics():  # evaluation: each example alone
    evaluate = _apply(model)
    # Two batch sizes: XLA may sum each convolution in another order (numerics.py's rule: the
    # chain of sums behind a logit, 3x3 kernels over 20-160 channels, 4 convolutions a width).
    chain = 27 + 4 * 9 * (20 + 40 + 80 + 160) + 160
    assert_close(evaluate(variables, x)[:3], evaluate(variables, x[:3]),
                 rtol=reduction_rtol(chain))
  # One update moves the stem's running mean 10% of the way to the valid rows' channel means,
  # and its variance to the unbiased batch variance, as PyTorch's BatchNorm2d (momentum 0.1).
  mask = jnp.array([True] * 4 + [False] * 2)
  _, moved = _apply(model, update_statistics=True, mask=mask)(variables, x)
  stem = moved["stem"]["bn"]
  conv = variables["params"]["stem"]["conv"]["kernel"]
  y = jax.lax.conv_general_dilated(x[:4], conv, (1, 1), "SAME",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))
  mean, var = np.mean(y, axis=(0, 1, 2)), np.var(y, axis=(0, 1, 2), ddof=1)
  np.testing.assert_allclose(stem["mean"], 0.1 * mean, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(stem["var"], 0.9 + 0.1 * var, rtol=1e-4, atol=1e-5)


def test_the_running_statistics_are_frozen_never_trained():
  model = _model(4, 16)
  params = _init(model, 16)["params"]
  trainable, frozen = common.split_trainable(params, "all", jax.random.key(1), model.spec, 4)
  assert resnet.BATCH_STATS not in trainable and set(frozen) == {resnet.BATCH_STATS}


def _run(workdir: Path, method: str, *overrides: str) -> dict:
  """results.json of `method` on the tiny stream at 8 px through the command line, compiled at
  XLA's level 1 where the session compiles at level 0 (tiny_run.convolution_level_env: at level 0
  a ResNet's convolutions run several times slower than they compile faster; GDumb's run took
  155 s at level 0 and 43 s at the default on a loaded 2-core machine). It exits 0 with finite
  losses."""
  run = subprocess.run(
      [sys.executable, str(ROOT / "launch" / "run.py"), "--config", str(ROOT / "configs" /
       "tiny.py"), "--workdir", str(workdir), f"--config.method={method}",
       "--config.model.name=resnet18_reduced", "--config.model.image_size=8",
       "--config.learner.batch_size=64", "--config.eval.eval_every=600",
       "--config.eval.write_plots=False", "--config.checkpoint_every=0", *overrides],
      capture_output=True, text=True, cwd=ROOT, env=tiny_run.convolution_level_env())
  assert run.returncode == 0, run.stderr[-2000:]
  results = json.loads((workdir / "results.json").read_text())
  assert len(results["acc_matrix"]) == 5 and 0 <= results["A_final"] <= 1
  assert results["nonfinite_steps"] == []
  return results


def test_er_runs_on_it_from_the_command_line(tmp_path):
  _run(tmp_path / "er", "er", "--config.er.buffer_size=50", "--config.er.learning_rate=0.003",
       "--config.data.test_fraction=0.7")


def _config(method: str):
  config = tiny.get_config(method)
  config.model.name = resnet.NAME
  config.model.image_size = 8
  return config


@pytest.mark.parametrize("method, why", [
    ("online_lora", "adds LoRA to a pretrained transformer's attention"),
    ("l2p", "trains 'prompts', not the whole model"),
    ("inflora", "trains 'lora', not the whole model"),
    ("slda", "trains no whole model"),
])
def test_methods_that_do_not_train_the_whole_model_are_refused(method, why, tmp_path):
  with pytest.raises(models.ModelError, match=f"method='{method}' {why}.*"
                     "model.name='resnet18_reduced' is trained from scratch") as err:
    trainer.train_and_evaluate(_config(method), str(tmp_path / "run"), progress=False)
  assert "\n" not in str(err.value) and not (tmp_path / "run").exists()


def test_a_baseline_set_to_train_the_head_alone_is_told_to_train_all(tmp_path):
  config = _config("er")
  config.er.trainable = "head"
  with pytest.raises(models.ModelError, match="set er.trainable='all'"):
    trainer.train_and_evaluate(config, str(tmp_path / "run"), progress=False)
  assert not (tmp_path / "run").exists()


def test_a_pretrained_checkpoint_is_refused(tmp_path):
  config = _config("er")
  config.pretrained.path = str(tmp_path / "vit.safetensors")
  with pytest.raises(models.ModelError, match="is trained from scratch and reads no checkpoint;"
                     " set pretrained.path=''"):
    trainer.train_and_evaluate(config, str(tmp_path / "run"), progress=False)
  assert not (tmp_path / "run").exists()


def test_gdumb_runs_on_it_with_running_statistics_of_its_own_training(tmp_path):
  """GDumb trains a fresh model from its buffer at each evaluation: its running statistics start
  afresh and move through that training (the loop's per-step statistics are of the untrained
  model it keeps). It ends with finite accuracies, compiling no program more than on the ViT
  (each of its jitted functions traced once: docs/performance.md's count)."""
  results = _run(tmp_path / "gdumb", "gdumb", "--config.gdumb.epochs=1",
                 "--config.gdumb.buffer_size=40", "--config.data.test_fraction=0.3")
  assert results["compute"]["n_compilations"] == documented_programs()["gdumb"], results["compute"]


def test_reset_batch_statistics_restores_the_initial_mean_and_variance():
  model = _model(4, 16)
  params = _init(model, 16)["params"]
  _, frozen = common.split_trainable(params, "all", jax.random.key(1), model.spec, 4)
  moved = common.moved_batch_statistics(model, frozen, {k: v for k, v in params.items()
                                                        if k != resnet.BATCH_STATS},
                                        jnp.ones((2, 16, 16, 3)), jnp.ones(2, bool))
  assert not np.allclose(moved[resnet.BATCH_STATS]["stem"]["bn"]["var"], 1.0)
  for path, x in jax.tree_util.tree_leaves_with_path(common.reset_batch_statistics(moved)):
    np.testing.assert_array_equal(x, 1.0 if path[-1].key == "var" else 0.0)
  assert common.reset_batch_statistics({"head": 1}) == {"head": 1}  # no statistics: unchanged


def test_a_size_key_given_for_it_on_the_command_line_is_refused(tmp_path):
  run = subprocess.run(
      [sys.executable, str(ROOT / "launch" / "run.py"), "--config", str(ROOT / "configs" /
       "tiny.py"), "--workdir", str(tmp_path / "run"), "--config.method=er",
       "--config.model.name=resnet18_reduced", "--config.model.width=64"],
      capture_output=True, text=True, cwd=ROOT)
  assert run.returncode == 2
  last = run.stderr.strip().splitlines()[-1]
  assert "--config.model.width would change nothing; drop it" in last
  assert not (tmp_path / "run").exists()


def test_reports_name_it_as_it_is_not_as_a_vit():
  from olora_jax import reporting

  assert reporting.setting_title({"data.dataset": "cifar10", "data.n_tasks": 5,
                                  "data.scenario": "disjoint",
                                  "model.name": "resnet18_reduced"}) == (
      "cifar10: 5 disjoint tasks, resnet18_reduced")
