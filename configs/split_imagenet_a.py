"""Split ImageNet-A: disjoint class-incremental, 20 tasks of 10 classes (label order), one pass.

    .venv/bin/python launch/run.py --config configs/split_imagenet_a.py \
        --workdir runs/split_imagenet_a --config.data.data_dir=DIR

ImageNet-A (7,500 adversarially filtered images of 200 ImageNet classes) has one split, TFDS's
`test`: its 200 classes are renumbered 0..199 in ImageNet-1k index order (sorted WordNet ids) and
20% of every class is held out as the test set, seeded by data.split_seed
(data.test_fraction), as for ImageNet-R. The pretrained-model papers that use it (APER, EASE)
train on their own released train/test folders: read those with `--config.data.source=folder
--config.data.data_dir=DIR/imagenet-a` (train/ and test/ class folders) to use their split. Their
released configs run 20 tasks of 10 classes (init_cls 10, increment 10) in a class order drawn
with seed 1993 (give it as data.class_order to match). Their released log of SimpleCIL
(ViT-B/16-IN21K; RevisitingCIL's logs/simplecil/imageneta): last accuracy 48.85, average over
tasks 60.64 (%). Online-LoRA: no paper thresholds; Split ImageNet-R's 5.2 / 0.02.
Data: `tfds build imagenet_a --file_format=array_record --data_dir=DIR`.
"""

from configs.benchmark import benchmark_config


def get_config(backbone="vit_b16"):
  return benchmark_config(backbone, dataset="imagenet_a", scenario="disjoint", n_tasks=20,
                          mean_threshold=5.2, var_threshold=0.02)
