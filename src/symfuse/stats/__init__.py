"""Per-model statistics: input Gram matrices, diagonal Fisher (file format: :mod:`symfuse.stats.io`)."""

from symfuse.stats.collect import GRAM_DTYPES, collect_stats, load_model, model_fingerprint
from symfuse.stats.fisher import FisherStats, collect_fisher
from symfuse.stats.gram import GramStats, collect_gram, linear_modules
from symfuse.stats.io import STAT_KINDS, StatsFile, load_stats, save_stats
from symfuse.stats.ownership import files_fingerprint
from symfuse.stats.transform import transform_stats

__all__ = [
    "GRAM_DTYPES",
    "STAT_KINDS",
    "FisherStats",
    "GramStats",
    "StatsFile",
    "collect_fisher",
    "collect_gram",
    "collect_stats",
    "files_fingerprint",
    "linear_modules",
    "load_model",
    "load_stats",
    "model_fingerprint",
    "save_stats",
    "transform_stats",
]
