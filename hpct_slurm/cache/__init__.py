"""Per-node shared-memory data cache (`store`) and the dataset/sampler over it (`dataset`).

`dataset` imports torch, so it is loaded on first use of its names.
"""
from __future__ import annotations

from .store import CacheEntry, CacheIndex, SharedCache

_DATASET_NAMES = ("CachedDataset", "PrefetchLoader", "ResumableSampler", "SamplerState")

__all__ = ["CacheEntry", "CacheIndex", "SharedCache", *_DATASET_NAMES]


def __getattr__(name: str):
    if name in _DATASET_NAMES:
        from . import dataset

        return getattr(dataset, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
