"""The embedded demo on a Swin Transformer: the same stream, method blocks and settings as
configs/demo.py, with a small Swin in place of the tiny ViT.

The Swin has the layout of the timm test fixture (tests/fixtures/swin-tiny-timm): 32x32 digits in
2x2 patches, embedding width 16, stages of 2 blocks with 2, 4 and 8 heads on 16x16, 8x8 and 4x4
maps, window 4 (shifted windows in the first two stages; in the last the window is the whole map,
so timm's rule turns the shift off), LoRA rank 4 on q and v of all 6 blocks. Its cost per image is
close to the demo ViT's.

The backbone is pretrained as the demo ViT is, and shipped with the package: trained by
`scripts/pretrain_backbone.py --backbone swin` on scikit-learn's 8x8 digits (other writers, laid
out as MNIST's, resized to 32x32; 96% on their test split), saved in timm's Swin layout, so the
run goes through the real timm Swin loader. The paper's Swin-T weights (ImageNet) are not shipped
and nothing is downloaded: for the paper's Swin-T runs see `configs/split_imagenet_s.py:swin_t`
and `configs/core50.py:swin_t` (weights from a local file). Runs in a few minutes on 2 CPU cores.

    .venv/bin/python launch/run.py --config configs/demo_swin.py --workdir runs/demo_swin

Any method that applies to a Swin (every one but the ViT-only methods, docs/models.md) is
`--config.method=NAME`, or `configs/demo_swin.py:NAME`.

Measured (seeds 0-2, mean ± std in %, a 2-core CPU shared with other jobs, 30-46 s a run; the
plateau thresholds are the ViT demo's, not tuned for this backbone):

    Online-LoRA       A_final 17.77 ± 0.93  Forgetting 84.38 ± 2.71  A_auc 50.18 ± 1.61  5 plateaus
    plain single LoRA A_final 17.30 ± 0.75  Forgetting 90.58 ± 0.40  A_auc 47.32 ± 3.38

    .venv/bin/python launch/sweep.py --root runs/swin_ol --settings configs/demo_swin.py \
        --methods online_lora --seeds 0,1,2
    .venv/bin/python launch/sweep.py --root runs/swin_lora --settings configs/demo_swin.py \
        --methods online_lora --seeds 0,1,2 -- --config.learner.incremental_lora=False \
        --config.learner.hard_loss=False --config.learner.buffer_size=0
    .venv/bin/python launch/report.py runs/swin_ol/demo_swin/online_lora/seed* \
        runs/swin_lora/demo_swin/online_lora/seed*
"""

import os

import olora_jax
from configs import demo


def get_config(method: str = "online_lora"):
  config = demo.get_config(method)
  config.model.name = "swin_custom"
  config.model.width = 16  # the embedding width, doubled at each stage
  config.model.stage_depths = (2, 2, 2)
  config.model.stage_heads = (2, 4, 8)
  config.model.window_size = 4
  config.model.patch_size = 2
  config.pretrained.path = os.path.join(
      os.path.dirname(olora_jax.__file__), "assets", "swin_tiny_digits.safetensors")
  return config
