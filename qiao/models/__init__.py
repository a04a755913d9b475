"""Model architectures, their config, and loading them from a checkpoint."""

from qiao.models.arch_config import ArchConfig, load_arch_config
from qiao.models.loader import find_weight_files, load_model
from qiao.models.registry import get_model_class, supported_architectures

__all__ = [
    "ArchConfig",
    "find_weight_files",
    "get_model_class",
    "load_arch_config",
    "load_model",
    "supported_architectures",
]
