"""Split OmniBenchmark: disjoint class-incremental, 10 tasks of 30 classes (label order), one pass;
the 300-class OmniBenchmark of the pretrained-model class-incremental papers (APER, EASE).

    .venv/bin/python launch/run.py --config configs/split_omnibenchmark.py \
        --workdir runs/split_omnibenchmark --config.data.data_dir=DIR/omnibenchmark

Read from the authors' released split folder (`train/<class>/*` and `test/<class>/*`, the two
ImageFolder trees; 300 class folders), classes in sorted folder order (the authors' released
configs: init_cls 30, increment 30, in a class order drawn with seed 1993). Their released log
of SimpleCIL (ViT-B/16-IN21K; RevisitingCIL's logs/simplecil/omnibenchmark): last accuracy 73.15,
average over tasks 79.34 (%). Online-LoRA: no paper thresholds; Split ImageNet-R's 5.2 / 0.02.
"""

from configs.benchmark import benchmark_config


def get_config(backbone="vit_b16"):
  config = benchmark_config(backbone, dataset="omnibenchmark", scenario="disjoint", n_tasks=10,
                            mean_threshold=5.2, var_threshold=0.02)
  config.data.source = "folder"
  return config
