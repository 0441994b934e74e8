"""Shared by the paper's benchmark settings (configs/split_*.py, si_blurry_*.py, core50.py).

Each setting fixes its dataset, scenario and plateau thresholds (docs/fidelity.md) and calls
`benchmark_config`. The backbone is chosen by the config-file argument: ViT-B/16 by default,
ViT-S/16 with `--config=configs/SETTING.py:vit_s16`, which sets the model, its checkpoint and the
paper's ViT-S learning rate (5e-4) together; `:swin_t` the Swin-T of the paper's appendix
(Online-LoRA learning rate 3e-4; run there on Split ImageNet-S and CORe50, the other settings
accept it too); `:vit_l16` and `:vit_h14` (ViT-L/16, ViT-H/14, beyond the paper, with ViT-B's
learning rate) likewise; `:resnet18_reduced` the reduced ResNet-18 of online continual learning,
trained from scratch at the dataset's own image size, running ER (`--config.method` picks another
method that trains the whole model; docs/models.md). The ViTs are ImageNet-21k backbones; all are
in timm's safetensors layout, as the released code uses them; they are never downloaded. Put the
files at

    checkpoints/vit_base_patch16_224.augreg2_in21k_ft_in1k.safetensors   (timm, ViT-B/16)
    checkpoints/vit_small_patch16_224.augreg_in21k_ft_in1k.safetensors   (timm, ViT-S/16)
    checkpoints/vit_large_patch16_224.augreg_in21k_ft_in1k.safetensors   (timm, ViT-L/16)
    checkpoints/vit_huge_patch14_224.orig_in21k.safetensors               (timm, ViT-H/14)
    checkpoints/swin_tiny_patch4_window7_224.safetensors                  (timm, Swin-T)

The paper does not name its Swin-T weights: the released code calls timm's
`create_model("swin_tiny_patch4_window7_224", pretrained=True)`, whose default tag depends on the
timm version; save the state_dict of the tag you mean under that name (timm >= 0.9 layout; older
timm and Microsoft's own layout are renamed on load, olora_jax/pretrained_swin.py).

or point `--config.pretrained.path` elsewhere (a Google AugReg / big_vision `.npz` also loads).
TFDS datasets are read from `--config.data.data_dir` (see olora_jax/data/tfds_sources.py for how
to prepare them); with `--config.data.source=folder`, every setting reads its dataset's image files
in that folder instead (docs/streams.md, "Your datasets on disk").
"""

import ml_collections

from configs import common

# backbone -> (model.name, default checkpoint, paper learning rate)
BACKBONES = {
    "vit_b16": ("vit_b16", "checkpoints/vit_base_patch16_224.augreg2_in21k_ft_in1k.safetensors",
                2e-4),
    "vit_s16": ("vit_s16", "checkpoints/vit_small_patch16_224.augreg_in21k_ft_in1k.safetensors",
                5e-4),
    # Beyond the paper (no learning rate of its own: ViT-B/16's).
    "vit_l16": ("vit_l16", "checkpoints/vit_large_patch16_224.augreg_in21k_ft_in1k.safetensors",
                2e-4),
    "vit_h14": ("vit_h14", "checkpoints/vit_huge_patch14_224.orig_in21k.safetensors", 2e-4),
    # The paper's appendix "Results of Swin Transformer": Online-LoRA at learning rate 3e-4.
    "swin_t": ("swin_t", "checkpoints/swin_tiny_patch4_window7_224.safetensors", 3e-4),
}


# The backbone trained from scratch (olora_jax/models/resnet.py): `:resnet18_reduced` runs ER on
# it, at the dataset's own image size (`native_size`), reading no checkpoint; the other
# whole-model baselines with --config.method.
FROM_SCRATCH = "resnet18_reduced"


def benchmark_config(backbone: str, *, dataset: str, scenario: str, n_tasks: int,
                     mean_threshold: float, var_threshold: float, native_size: int = 32,
                     **learner_overrides) -> ml_collections.ConfigDict:
  """The common config with one benchmark's data and thresholds on the chosen backbone."""
  if backbone not in BACKBONES and backbone != FROM_SCRATCH:
    raise ValueError(
        f"unknown backbone {backbone!r} after the config file's ':'; use one of"
        f" {(*BACKBONES, FROM_SCRATCH)}")
  config = common.get_config()
  if backbone == FROM_SCRATCH:
    config.method = "er"
    config.model.name = FROM_SCRATCH
    config.model.image_size = native_size
  else:
    name, checkpoint, learning_rate = BACKBONES[backbone]
    config.model.name = name
    config.model.image_size = 224  # paper appendix: inputs resized to 224x224, pixels in [0, 1]
    config.pretrained.path = checkpoint
    config.pretrained.format = "timm"
    config.learner.learning_rate = learning_rate
  config.data.dataset = dataset
  config.data.scenario = scenario
  config.data.n_tasks = n_tasks
  # B = 64, K = 4, r = 4, lambda = 2000, window 5 are common.py's (the paper's) defaults.
  config.learner.mean_threshold = mean_threshold
  config.learner.var_threshold = var_threshold
  for key, value in learner_overrides.items():
    config.learner[key] = value
  return config


def si_blurry_config(backbone: str, *, dataset: str) -> ml_collections.ConfigDict:
  """The paper's Si-Blurry setting on `dataset`: 5 tasks, N = 50% disjoint classes, M = 10% of
  blurry samples moved, anytime accuracy every 1,000 samples with unseen classes' logits masked,
  thresholds 5.2 / 0.02 (released script), and no hard-buffer loss in the objective (the paper's
  Si-Blurry table; the buffer still feeds the importance estimate)."""
  config = benchmark_config(backbone, dataset=dataset, scenario="si_blurry", n_tasks=5,
                            mean_threshold=5.2, var_threshold=0.02, hard_loss=False)
  config.data.si_blurry_n = 50.0
  config.data.si_blurry_m = 10.0
  config.eval.eval_every = 1000
  config.eval.mask_unseen_logits = True
  return config
