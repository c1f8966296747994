"""How a rank seeds its randomness: from (seed, rank, step) before every step, so data order and
dropout of any step can be reproduced by whichever process holds the rank after a fault.
Scripts import these from recovery/job.py, which re-exports them."""
from __future__ import annotations

import hashlib
import random

import numpy as np
import torch

STEP_SEED_DOMAIN = b"hpct-step-seed"


def step_seed(seed: int, rank: int, step: int) -> int:
    """A 63-bit seed that depends only on (seed, rank, step): data order and dropout of any
    step can be reproduced by any process that takes over the rank."""
    h = hashlib.blake2b(f"{seed}:{rank}:{step}".encode(), digest_size=8, key=STEP_SEED_DOMAIN)
    return int.from_bytes(h.digest(), "big") >> 1


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
