"""lightning-pipe's tests.

Every process of the suite (pytest, and the scripts tests/launch.py starts, which import this package) computes with
one intra-op thread, whatever the machine: a float result then depends only on the op sequence, so an exact comparison
holds wherever the two sides run the same ops in the same layout, and nowhere else.
"""

import torch

torch.set_num_threads(1)
