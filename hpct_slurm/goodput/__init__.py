"""Goodput model: checkpoint-restart vs hpct-slurm from 16 to 100k GPUs (pure; see model.py)."""
from .model import (Curve, FailSlow, Params, Result, evaluate, fit_curve, load_params,
                    spares_for, spare_exhaustion_probability, sweep)

__all__ = ["Curve", "FailSlow", "Params", "Result", "evaluate", "fit_curve", "load_params",
           "spares_for", "spare_exhaustion_probability", "sweep"]
