"""The embedded demo with its classes in reversed order: the same digits, split, backbone, batch
and buffers as configs/demo.py, its five tasks 9-8, 7-6, ..., 1-0. A held-out order for the demo
comparison (docs/tutorials/first-comparison.md): a sentence that ranks two methods is stated only
where it holds in both orders, since the given order is the one every default was looked at on.

    python launch/run.py --config configs/demo_reversed.py --workdir runs/demo_reversed
"""

from configs import demo


def get_config(method: str = "online_lora"):
  config = demo.get_config(method)
  config.data.class_order = ",".join(str(c) for c in range(9, -1, -1))
  return config
