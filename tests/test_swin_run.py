"""Every method that applies, on a tiny Swin, through the one loop: a short stream end to end with
each jitted function traced once; Online-LoRA in both fidelities also killed mid-stream and
resumed bit-identical to its uninterrupted run (the kill simulated from the run's own files, as
in test_methods_run.py). The ViT-only methods are refused on a Swin before anything is written."""

from __future__ import annotations

import pytest
from test_methods_run import KILLED_AFTER, _outputs, resume_after_simulated_kill
from test_methods_run import _config as methods_run_config

from olora_jax import models, pretrained, trainer
from olora_jax.learner import online_lora as online_lora_lib
from olora_jax.methods import common
from olora_jax.models import swin

# Every method but the ViT-only ones (models.VIT_ONLY_METHODS), on the stream of
# test_methods_run.py, SimpleCIL, SLDA and RanPAC included. PCR also
# checks that its cosine head survives the zero features this random Swin gives a padded image.
METHODS = ("finetune", "iid", "er", "der_pp", "ewc_pp", "agem", "mir", "gdumb", "pcr", "lode",
           "ema_der_pp", "ema_rar", "simplecil", "slda", "ranpac")


def _config(method: str, fidelity: str = "paper"):
  """test_methods_run.py's stream and method blocks, with about 360 training samples (12 steps),
  on a Swin of 3 blocks: an 8x8 stage whose second block is shifted, and a 4x4 stage where the
  window is the whole map."""
  c = methods_run_config(method)
  c.fidelity = fidelity
  c.model.name = swin.CUSTOM
  c.model.width, c.model.stage_depths, c.model.stage_heads = 8, (2, 1), (1, 2)
  c.model.window_size, c.model.patch_size = 4, 2
  c.data.test_fraction = 0.8
  c.eval.eval_every, c.eval.write_plots = 150, False
  c.checkpoint_every = KILLED_AFTER // 2  # checkpoints at 4, 8 and the end
  c.gdumb.epochs = 1
  c.learner.mean_threshold, c.learner.var_threshold = 10.0, 10.0  # plateaus from the first window
  return c


# The per-method runs' Swin: one block a stage (a windowed stage, patch merging, a stage whose
# window is the whole map), so every kind of Swin parameter and the features' wider last stage,
# but no shifted block: the mask is a constant, not a parameter, so no method sees it, and the
# shift is held by test_swin.py (timm's outputs) and the Online-LoRA runs below. Evaluations at
# the task ends alone (the accuracy matrix): an anytime evaluation runs the same program. The 15
# runs at level 0, 2-core Intel Xeon, median of 3 alternated: 219.9 -> 152.6 CPU-s.
@pytest.mark.parametrize("method", METHODS)
def test_every_applicable_method_runs_on_swin_compiling_once(method, tmp_path):
  config = _config(method)
  config.checkpoint_every = 0  # the final checkpoint alone: nothing here resumes
  config.model.stage_depths, config.eval.eval_every = (1, 1), 1000
  common.TRACE_COUNTS.clear()
  trainer.train_and_evaluate(config, str(tmp_path), progress=False)
  results, metrics, _ = _outputs(tmp_path)
  assert common.TRACE_COUNTS[f"{method}.train_step"] == 1
  assert len(results["acc_matrix"]) == 5 and 0 <= results["A_final"] <= 1
  assert results["nonfinite_steps"] == []
  assert metrics.count(b'"event": "train"') == results["n_steps"] > KILLED_AFTER


@pytest.mark.parametrize("fidelity", ["paper", "reference"])
def test_online_lora_both_fidelities_and_resume_after_a_kill(fidelity, tmp_path):
  config = _config("online_lora", fidelity)
  config.export_online_lora = True
  online_lora_lib.TRACE_COUNTS.clear()
  trainer.train_and_evaluate(config, str(tmp_path / "full"), progress=False)
  assert all(online_lora_lib.TRACE_COUNTS[f] == 1 for f in ("train_step", "update_buffer",
                                                             "predict"))
  full = _outputs(tmp_path / "full")
  assert full[0]["n_plateaus"] >= 1 and online_lora_lib.TRACE_COUNTS["consolidate"] == 1
  # The final model in the authors' Swin layout loads back (the LoRA of every stage).
  spec = models.spec_from_config(config.model)
  exported = str(tmp_path / "full" / trainer.EXPORT_FILENAME)
  lora, frozen = pretrained.load_online_lora(exported, spec, config.learner.rank)
  assert set(lora) == set(spec.lora_layers()) == set(frozen)

  assert resume_after_simulated_kill(config, tmp_path / "full", tmp_path / "killed") == full


@pytest.mark.parametrize("method", sorted(models.VIT_ONLY_METHODS))
def test_vit_only_methods_are_refused_on_swin_before_anything_is_written(method, tmp_path):
  with pytest.raises(models.ModelError, match=f"method='{method}' (inserts prompt tokens into|"
                     "prepends prefix tokens to|stacks its LoRA branches over) .*a ViT's .* has no"
                     " Swin version; use a ViT model.name") as err:
    trainer.train_and_evaluate(_config(method), str(tmp_path / "run"), progress=False)
  assert "\n" not in str(err.value) and not (tmp_path / "run").exists()


def test_rank_wider_than_the_first_stage_is_refused(tmp_path):
  config = _config("online_lora")
  config.learner.rank = 9
  with pytest.raises(models.ModelError, match="learner.rank=9 is larger than the Swin's"
                     " first-stage width 8"):
    trainer.train_and_evaluate(config, str(tmp_path / "run"), progress=False)
