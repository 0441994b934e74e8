"""Split TinyImageNet: disjoint class-incremental, 10 tasks of 20 classes (label order, the sorted
WordNet ids), one pass; read from the dataset's own folder (no TFDS builder exists).

    .venv/bin/python launch/run.py --config configs/split_tiny_imagenet.py:resnet18_reduced \
        --workdir runs/split_tiny_imagenet_er --config.data.data_dir=DIR/tiny-imagenet-200

DIR/tiny-imagenet-200 is the archive as its authors ship it: training images in
`train/<wnid>/images/*.JPEG`, the labelled validation images in `val/images/` with
`val/val_annotations.txt`; val/ is the test set (test/ has no labels). `:resnet18_reduced` trains
the reduced ResNet-18 from scratch at the images' 64 px (ER, a 1,000-sample buffer as OnPro's
released command, batch 10); --config.data.n_tasks sets another split of the 200 classes.
Online-LoRA on a ViT: no paper thresholds; Split CIFAR-100's 2.6 / 0.03. OnPro's released code
splits TinyImageNet into 100 tasks of 2 classes (--config.data.n_tasks=100 for that split). No
paper number is quoted: OnPro's and OCM's Table 1 could not be read first-hand (their released
code ships no results), and the copies seen do not state each column's buffer size.
"""

from configs.benchmark import FROM_SCRATCH, benchmark_config


def get_config(backbone="vit_b16"):
  config = benchmark_config(backbone, dataset="tiny_imagenet", scenario="disjoint", n_tasks=10,
                            mean_threshold=2.6, var_threshold=0.03, native_size=64)
  config.data.source = "folder"
  if backbone == FROM_SCRATCH:
    config.learner.batch_size = 10
    config.er.buffer_size = 1000
  return config
