"""The loss window's plateau/peak rule on scripted loss sequences."""

import pytest

from olora_jax.learner import plateau

CFG = plateau.PlateauConfig(window=3, mean_threshold=1.0, var_threshold=0.01)


def run(values, config=CFG):
  state, fired = plateau.init(), []
  for v in values:
    state, stats = plateau.update(state, v, config)
    fired.append(stats.fired)
  return state, fired


def test_fires_on_a_low_flat_window_only_when_full():
  _, fired = run([0.5, 0.5, 0.5])
  assert fired == [False, False, True]


def test_does_not_fire_when_mean_or_variance_is_too_high():
  assert not any(run([1.5, 1.5, 1.5, 1.5])[1])  # flat but above the mean threshold
  assert not any(run([0.1, 0.9, 0.1, 0.9, 0.1])[1])  # low mean, variance 0.142 > 0.01


def test_rearms_only_after_a_peak():
  # Plateau at step 2 (mean 0.5, var 0); it stays low and flat: no second plateau.
  _, fired = run([0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
  assert fired == [False, False, True, False, False, False]
  # With variance 0 at the last plateau, any window mean above 0.5 is a peak: a spike to 1.7
  # (mean 0.9, too high to be a plateau) re-arms, and the settled window fires again.
  state, fired = run([0.5, 0.5, 0.5, 1.7, 0.5, 0.5, 0.5])
  assert fired == [False, False, True, False, False, False, True]
  assert state.n_plateaus == 2


def test_the_armed_state_and_its_rearm_are_reported():
  """Armed at the start, disarmed by a plateau, re-armed by the peak (one `rearm`, with the bar
  it passed), armed when the settled window fires."""
  state, armed, rearmed = plateau.init(), [], []
  for v in [0.5, 0.5, 0.5, 0.5, 1.7, 0.5, 0.5, 0.5]:
    before = state
    state, stats = plateau.update(state, v, CFG)
    armed.append(stats.armed)
    rearmed.append(stats.rearmed)
    if stats.rearmed:
      event = plateau.rearm_event(stats, before)
  assert armed == [True, True, True, False, True, True, True, True]
  assert rearmed == [False, False, False, False, True, False, False, False]
  assert event == ("rearm", {"window_mean": pytest.approx(0.9), "bar": pytest.approx(0.5),
                             "n_plateaus": 1})


def test_peak_threshold_uses_mean_plus_std_at_last_plateau():
  cfg = plateau.PlateauConfig(window=2, mean_threshold=1.0, var_threshold=0.05)
  # Plateau at step 1: window (0.4, 0.8): mean 0.6, var 0.04, std 0.2 -> re-arms above 0.8.
  state, fired = run([0.4, 0.8], cfg)
  assert fired == [False, True] and state.last_mean == pytest.approx(0.6)
  # Window means 0.75 and 0.79 (not > 0.8): no peak, so the later low flat window does not fire.
  state, fired = run([0.4, 0.8, 0.7, 0.88, 0.5, 0.5], cfg)
  assert fired == [False, True, False, False, False, False]
  # Window mean 1.0 > 0.8 is a peak (too high to be a plateau itself); the later flat window fires.
  state, fired = run([0.4, 0.8, 1.2, 0.5, 0.5], cfg)
  assert fired == [False, True, False, False, True]


def test_partial_window_check_can_fire_at_step_one():
  cfg = plateau.PlateauConfig(window=5, mean_threshold=1.0, var_threshold=0.01,
                              check_partial_window=True)
  assert run([0.5], cfg)[1] == [True]
  assert run([0.5], plateau.PlateauConfig(window=5, mean_threshold=1.0,
                                          var_threshold=0.01))[1] == [False]


def test_update_is_pure():
  state = plateau.init()
  new, _ = plateau.update(state, 0.3, CFG)
  assert state.values == () and new.values == (0.3,)


@pytest.mark.parametrize("kwargs, key", [(dict(window=0), "learner.window"),
                                         (dict(mean_threshold=0.0), "learner.mean_threshold"),
                                         (dict(var_threshold=-1.0), "learner.var_threshold")])
def test_bad_hyperparameters_are_refused(kwargs, key):
  with pytest.raises(ValueError, match=key):
    plateau.PlateauConfig(**kwargs)
