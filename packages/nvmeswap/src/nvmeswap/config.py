"""The ``"nvmeswap"`` config section and the checks of DeepSpeed's part of the config."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import pydantic

from zerohooks import ConfigError, PluginConfig
from zerohooks.strict import MAX_NUMEL

__all__ = [
    "MAX_BLOCK_SIZE",
    "MAX_BUFFERS",
    "MAX_IO_THREADS",
    "MAX_PREFETCH_BYTES",
    "NvmeSwapConfig",
    "rewrite_offload",
]


MAX_BUFFERS = 16
"""Upper bound of ``buffer_count`` (each buffer holds one sub-group's swapped state in RAM)."""
MAX_IO_THREADS = 32
"""Upper bound of ``io_threads`` (per buffer)."""
MAX_BLOCK_SIZE = 1 << 28
"""Upper bound of ``block_size`` (256 MiB per request)."""
MAX_PREFETCH_BYTES = 1 << 48
"""Upper bound of ``prefetch_bytes`` (256 TiB: more RAM than any machine; the RAM check decides)."""


class NvmeSwapConfig(PluginConfig):
    """``"nvmeswap": {...}``, next to ``zero_optimization.offload_optimizer: {"device": "nvme"}``."""

    auto_aliases: ClassVar[dict[str, str]] = {"io_engine": "detect", "fused_adam": "when_supported"}
    """``"auto"`` read as these words (see ``zerohooks.PluginConfig.auto_aliases``)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    keep_master_in_ram: bool = False
    """Keep the fp32 master parameters in RAM and swap only the optimizer moments (8 bytes per
    parameter written and read per step instead of 12); costs 4 bytes of RAM per parameter."""
    folder: str | None = pydantic.Field(None, min_length=1)
    """Folder of the swap files; default (absent or null): ``offload_optimizer.nvme_path``.  Each
    rank uses ``<folder>/nvmeswap/rank<R>/``.  An empty string is refused."""
    buffer_count: int = pydantic.Field(3, ge=2, le=MAX_BUFFERS)
    """Sub-group buffers in RAM: one being stepped, one being read ahead, the rest being written.
    At most 16: each buffer holds a whole sub-group's swapped state in RAM."""
    io_threads: int = pydantic.Field(2, ge=1, le=MAX_IO_THREADS)
    """I/O threads per buffer (requests in flight per buffer); at most 32 (threads in all:
    ``buffer_count * io_threads``)."""
    block_size: int = pydantic.Field(1 << 20, ge=4096, le=MAX_BLOCK_SIZE, multiple_of=4096)
    """Bytes per I/O request, a multiple of 4096 from 4 KiB to 256 MiB; a sub-group's file is
    read and written in pieces of this size."""
    min_swap_numel: int = pydantic.Field(0, ge=0, le=MAX_NUMEL)
    """Sub-groups with fewer elements stay in RAM (DeepSpeed's own swapper keeps those under 1 MiB).
    At most 2**48 (``zerohooks.strict.MAX_NUMEL``, more elements than any sub-group has: that
    value already keeps every sub-group in RAM)."""
    prefetch_bytes: int = pydantic.Field(0, ge=0, le=MAX_PREFETCH_BYTES)
    """RAM, in bytes, for optimizer state read ahead while backward runs (the overlap; 0, the
    default: none).  At the last micro-step of an accumulation window, each swapped sub-group
    whose gradients are all final (ZeRO-3 finishes them in reverse order of the forward) starts
    reading its master and moments into one more swap buffer, so that the step finds it in RAM;
    ``prefetch_bytes // buffer size`` such buffers are made (a buffer holds the largest
    sub-group's swapped state: 12 bytes an element, 8 with ``keep_master_in_ram``).  A value
    that is not 0 but smaller than one buffer is a ConfigError naming the buffer size, and these
    buffers count with ``buffer_count``'s in the RAM check made when the engine is built.  At
    most 2**48.  The arithmetic is unchanged: losses and weights are bit-identical to 0."""
    step_in_backward: bool = False
    """Step each swapped sub-group while backward still runs (the overlap of issue 37; off by
    default).  At the last micro-step of an accumulation window, as soon as a sub-group's
    gradients are all final, a background thread reads its master and moments, steps it, writes
    its 16-bit partition and writes the new state to a second region of its swap file, while
    backward goes on with the other sub-groups.  The step is speculative: it assumes no gradient
    clipping applies and no overflow skips the step.  DeepSpeed's step then commits it when its
    own unscale-and-clip factor is the one assumed (the new region becomes the live one), and
    undoes it otherwise (an fp16 overflow or a non-finite bf16 norm, clipping that clips, a loss
    scale raised at this step, a checkpoint, ``detach`` or DeepSpeed's get/set APIs used before
    the step, a forward without a step): the 16-bit partition is restored from the live region
    and the step runs as without it (after an undone window speculation pauses for 1, 2, 4, ...
    at most 64 windows).  Losses and weights are bit-identical to ``false``.  Costs:
    swap files twice the size (checked against the disk when the engine is built); no RAM beyond
    ``buffer_count``'s buffers.  Not with ``prefetch_bytes`` (a ConfigError)."""
    io_engine: Literal["detect", "native", "python"] = "detect"
    """``detect`` (the default, also when the key is absent): the C++ engine, or the pure-Python
    one (with a warning) if it cannot be built; ``native``: the C++ engine or an error;
    ``python``: the pure-Python engine.  ``"auto"`` is also accepted (stored as ``detect``), but
    Trainer/accelerate reject any ``"auto"`` they cannot fill themselves: leave the key out
    there."""
    fused_adam: bool | Literal["when_supported"] = "when_supported"
    """Step swapped sub-groups with nvmeswap's fused Adam/AdamW kernel, which reads the 16-bit
    gradient partitions directly (no fp32 gradient buffer; bitwise equal to the unfused step).
    ``"when_supported"`` (the default, also when the key is absent): whenever the optimizer is
    ``torch.optim.Adam``/``AdamW`` in its default single-tensor form (DeepSpeed's
    ``"torch_adam": true``), else the unfused step; ``true``: a ConfigError for any other
    optimizer; ``false``: never.  ``"auto"`` is also accepted (stored as ``when_supported``),
    but Trainer/accelerate reject any ``"auto"`` they cannot fill themselves: leave the key out
    there."""

    @pydantic.model_validator(mode="after")
    def _one_overlap(self) -> NvmeSwapConfig:
        if self.step_in_backward and self.prefetch_bytes:
            raise ValueError(
                "step_in_backward and prefetch_bytes are two ways of overlapping the optimizer's I/O with "
                "backward; choose one (step_in_backward hides the reads and the step, prefetch_bytes only "
                "as many reads as its RAM holds)"
            )
        if self.step_in_backward and self.keep_master_in_ram:
            raise ValueError(
                "step_in_backward cannot be combined with keep_master_in_ram: a speculative step overwrites the "
                "one copy of the master kept in RAM, which an undone step would need; set keep_master_in_ram "
                "to false (the master is swapped with the moments) or step_in_backward to false"
            )
        return self

    @pydantic.field_validator("fused_adam", mode="before")
    @classmethod
    def _fused_adam_auto(cls, value: Any) -> Any:
        if isinstance(value, bool) or value == "when_supported":
            return value
        raise ValueError('use true, false or "when_supported"')


def rewrite_offload(ds_config: dict[str, Any], cfg: NvmeSwapConfig) -> str:
    """Check DeepSpeed's config and turn its NVMe optimizer offload into CPU offload (in place).

    nvmeswap owns the swapping: DeepSpeed must not build its own (libaio-based) swapper, so it
    is told to offload to the CPU, and nvmeswap moves the CPU-resident state to disk around each
    sub-group's step.  Returns the swap folder.
    """
    zero = ds_config.get("zero_optimization")
    got = zero.get("stage", 0) if isinstance(zero, dict) else None
    if type(got) is not int or got != 3:
        raise ConfigError(
            f'"nvmeswap" needs ZeRO stage 3: zero_optimization.stage must be the JSON integer 3; got {got!r}'
        )
    assert isinstance(zero, dict)
    off = zero.get("offload_optimizer")
    device = off.get("device") if isinstance(off, dict) else None
    if device != "nvme":
        raise ConfigError(
            '"nvmeswap" needs zero_optimization.offload_optimizer.device = "nvme" (with nvme_path); '
            f"got {device!r}"
        )
    assert isinstance(off, dict)
    param_off = zero.get("offload_param")
    if isinstance(param_off, dict) and param_off.get("device") == "nvme":
        raise ConfigError(
            '"nvmeswap" swaps optimizer state only: zero_optimization.offload_param.device "nvme" would '
            'bring back DeepSpeed\'s libaio swapper; use "cpu" or "none" for offload_param'
        )
    folder = cfg.folder or off.get("nvme_path")
    if not folder:
        raise ConfigError(
            '"nvmeswap" needs a folder for its swap files: set zero_optimization.offload_optimizer.nvme_path '
            'or "nvmeswap": {"folder": ...}'
        )
    ratio = off.get("ratio", 1.0)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio != 1.0:
        partial = (
            " (partial offload)" if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) else ""
        )
        raise ConfigError(
            f"zero_optimization.offload_optimizer.ratio = {ratio!r}{partial} is not supported with nvmeswap: "
            "the accepted value is the JSON number 1.0 (the default): remove the key"
        )
    optimizer = ds_config.get("optimizer")
    params = optimizer.get("params") if isinstance(optimizer, dict) else None
    if isinstance(params, dict) and params.get("amsgrad"):
        raise ConfigError(
            f"optimizer.params.amsgrad is {params['amsgrad']!r} with nvmeswap: amsgrad keeps a third fp32 "
            "state tensor per element (max_exp_avg_sq) and nvmeswap's swap files hold two (the Adam "
            "moments, or one momentum buffer); set amsgrad to false or remove it"
        )
    new = {k: v for k, v in off.items() if k not in ("pipeline_read", "pipeline_write", "buffer_count")}
    new["device"] = "cpu"
    zero["offload_optimizer"] = new
    return str(folder)
