"""``python -m eagle3nb.train params/<run>/ [--set key=value ...]``, the same code path on more GPUs or nodes:

    torchrun --nproc_per_node 8 -m eagle3nb.train params/<run>/
    torchrun --nnodes 2 --node_rank R --master_addr HOST --nproc_per_node 8 -m eagle3nb.train params/<run>/
"""

import sys

from eagle3nb.stage_cli import main

sys.exit(main("03_train"))
