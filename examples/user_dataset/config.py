"""A config that adds a user dataset from outside the package (`my_dataset.py` beside it):

    .venv/bin/python launch/run.py --config examples/user_dataset/config.py \\
        --workdir runs/my_dataset

`data.dataset` names a function, 'path/to/file.py:function' (as here) or 'module:function' for a
module on PYTHONPATH. Its per-sample domain ids make a domain-incremental stream (one task per
rotation), evaluated per domain: acc_matrix rows are domains and results.json has
`forgetting_per_domain`. A tiny random backbone, seconds on a CPU.
"""

import os

from configs import tiny


def get_config():
  config = tiny.get_config()
  config.data.dataset = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                     "my_dataset.py") + ":load"
  config.data.scenario = "domain"
  config.data.n_tasks = 4  # one per domain
  config.eval.write_plots = False
  return config
