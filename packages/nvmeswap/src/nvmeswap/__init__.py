"""nvmeswap: ZeRO-3 optimizer state swapped to NVMe without gradient I/O, on its own C++ I/O engine.

Enable it with an ``"nvmeswap": {...}`` section next to DeepSpeed's
``zero_optimization.offload_optimizer: {"device": "nvme", "nvme_path": ...}`` and build the
engine with ``zerohooks.initialize``.
"""

from nvmeswap.__about__ import __version__
from nvmeswap.config import NvmeSwapConfig
from nvmeswap.folder import SwapFolderInUseError
from nvmeswap.io import SwapIOError
from nvmeswap.memory import NotEnoughMemoryError
from nvmeswap.plugin import NvmeSwapPlugin
from nvmeswap.swapfile import SwapCorruptionError, SwapSpaceError

__all__ = [
    "NotEnoughMemoryError",
    "NvmeSwapConfig",
    "NvmeSwapPlugin",
    "SwapCorruptionError",
    "SwapFolderInUseError",
    "SwapIOError",
    "SwapSpaceError",
    "__version__",
]
