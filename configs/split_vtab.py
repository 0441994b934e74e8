"""Split VTAB: the 5-dataset VTAB of the pretrained-model class-incremental papers (APER, EASE):
Resisc45, DTD, Oxford-IIIT Pets, EuroSAT and Oxford Flowers, 10 classes of each, 50 in all; 5
disjoint tasks of 10 classes in label order, one pass.

    .venv/bin/python launch/run.py --config configs/split_vtab.py \
        --workdir runs/split_vtab --config.data.data_dir=DIR/vtab

Read from the authors' released folder (`vtab/train/<class>/*` and `vtab/test/<class>/*`, the two
ImageFolder trees; 50 class folders), whose classes in sorted folder order are the label order,
the tasks taking them 10 at a time (the authors' released configs: init_cls 10, increment 10, in
a class order drawn with seed 1993; give it as data.class_order to match). Their released log of
SimpleCIL (ViT-B/16-IN21K; RevisitingCIL's logs/simplecil/vtab): last accuracy 84.37, average
over tasks 85.94 (%). Online-LoRA: no paper thresholds; Split ImageNet-R's 5.2 / 0.02.
"""

from configs.benchmark import benchmark_config


def get_config(backbone="vit_b16"):
  config = benchmark_config(backbone, dataset="vtab", scenario="disjoint", n_tasks=5,
                            mean_threshold=5.2, var_threshold=0.02)
  config.data.source = "folder"
  return config
