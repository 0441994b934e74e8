"""DomainNet, domain-incremental: 6 tasks, one per domain (clipart, infograph, painting,
quickdraw, real, sketch, in that order, as S-Prompts runs it), each with all 345 classes, one
pass; evaluated on every domain's test split.

    .venv/bin/python launch/run.py --config configs/domainnet.py \
        --workdir runs/domainnet --config.data.data_dir=DIR

DIR holds TFDS's six `domainnet/<domain>` configs (`tfds build domainnet
--file_format=array_record --data_dir=DIR`, every config). The domain of each image is its task
(data.scenario='domain'; olora_jax/data/sequences.py). Online-LoRA: no paper thresholds; Split
ImageNet-R's 5.2 / 0.02. No paper number is quoted here: none was checked against its table for
this config yet.
"""

from configs.benchmark import benchmark_config


def get_config(backbone="vit_b16"):
  return benchmark_config(backbone, dataset="domainnet", scenario="domain", n_tasks=6,
                          mean_threshold=5.2, var_threshold=0.02)
