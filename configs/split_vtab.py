"""Split VTAB: the 5-dataset VTAB of the pretrained-model class-incremental papers (APER, EASE):
Resisc45, DTD, Oxford-IIIT Pets, EuroSAT and Oxford Flowers, 10 classes of each, 50 in all; 5
disjoint tasks of 10 classes in label order, one pass.

    .venv/bin/python launch/run.py --config configs/split_vtab.py \
        --workdir runs/split_vtab --config.data.data_dir=DIR/vtab

Read from the authors' released folder (`vtab/train/<class>/*` and `vtab/test/<class>/*`, the two
ImageFolder trees; 50 class folders), whose classes in sorted folder order are the label order,
so each task is the papers' (class-incremental, the class order as their folder gives it).
Online-LoRA: no paper thresholds; Split ImageNet-R's 5.2 / 0.02. No paper number is quoted here:
none was checked against its table for this config yet.
"""

from configs.benchmark import benchmark_config


def get_config(backbone="vit_b16"):
  config = benchmark_config(backbone, dataset="vtab", scenario="disjoint", n_tasks=5,
                            mean_threshold=5.2, var_threshold=0.02)
  config.data.source = "folder"
  return config
