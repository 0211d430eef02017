"""The ``"loco"`` section of the DeepSpeed config."""

from __future__ import annotations

from typing import ClassVar, Literal

import pydantic

from zerohooks import PluginConfig
from zerohooks.strict import MAX_NUMEL, MAX_STEPS

__all__ = ["MAX_NODE_SIZE", "LocoConfig"]

MAX_NODE_SIZE = 2**16
"""Upper bound of ``node_size``: ranks on one node (one per accelerator, or per CPU core on
gloo; the largest hosts have a few thousand cores)."""


class LocoConfig(PluginConfig):
    """LoCo settings.  Every field is optional; ``"loco": {}`` (or ``true``) takes the defaults."""

    auto_aliases: ClassVar[dict[str, str]] = {"hierarchy": "detect", "kernels": "compiled"}
    """``"auto"`` read as these words (see ``zerohooks.PluginConfig.auto_aliases``)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    bits: Literal[4, 8] = 4
    """Bits per transmitted gradient element: symmetric integer codes in [-7, 7] (4) or
    [-127, 127] (8), one fp32 scale per group."""

    err_beta: float = pydantic.Field(default=0.8, ge=0.0, le=1.0)
    """Error-feedback decay: ``e <- err_beta * e + (1 - err_beta) * (x - deQ(Q(x)))`` with
    ``x = g + e``.  0 is classic error feedback; 1 keeps ``e`` at zero (no compensation)."""

    reset_T: int = pydantic.Field(default=1024, ge=0, le=MAX_STEPS)
    """Clear every error buffer after each optimizer step whose number (``engine.global_steps``
    after the step, skipped fp16 steps included) is a multiple of ``reset_T``; 0 never clears.
    At most 2**31 - 1 (``zerohooks.strict.MAX_STEPS``): a longer period than any run means
    never, which is 0."""

    group_size: Literal[64, 128, 256, 512, 1024] = 128
    """Elements per quantization group (one fp32 scale each), for gradients and int8 errors."""

    error_dtype: Literal["int8", "bf16", "fp32"] = "int8"
    """Storage of the error buffers: int8 codes with one fp32 scale per group (about 1 byte per
    element), bf16 (2 bytes) or fp32 (4 bytes, exact)."""

    exact_below: int | None = pydantic.Field(default=None, ge=0, le=MAX_NUMEL)
    """Tensors (ZeRO 3: per parameter; ZeRO 1/2: per bucket call) with fewer elements than this
    are reduced exactly in the communication dtype.  None: ``world_size * group_size``, below
    which one rank's chunk is smaller than one group and 4-bit codes would save nothing.  At
    most 2**48 (``zerohooks.strict.MAX_NUMEL``, more elements than any tensor has: that value
    already reduces every tensor exactly)."""

    error_feedback: bool = True
    """False: plain 4-bit quantization without error buffers (no memory, no compensation), for
    comparison."""

    hierarchy: Literal["detect", "flat", "two_level"] = "detect"
    """``flat``: one all-to-all over all ranks.  ``two_level``: intra-node all-to-all, then a
    dequantize-reduce-requantize step with its own error buffer and an inter-node all-to-all.
    ``detect`` (the default, also when the key is absent): two-level when there is more than
    one node (see ``node_size``), else flat.  ``"auto"`` is also accepted (stored as
    ``detect``), but Trainer/accelerate reject any ``"auto"`` they cannot fill themselves: leave
    the key out there."""

    parameter_gather: Literal["two_level", "deepspeed"] = "two_level"
    """Who all-gathers the parameters on ZeRO 1-3 (the updated partitions after each step on ZeRO
    1/2, every parameter before its use on ZeRO 3) when loco reduces two-level (see
    ``hierarchy``).  ``two_level``: loco, across nodes then within the node, so each parameter
    byte crosses to every other node once (2/3 of a ring's link bytes on 2 nodes x 2); lossless,
    the gathered weights are DeepSpeed's bit for bit.  ``deepspeed``: DeepSpeed's ring all-gather
    over all ranks.  With a flat hierarchy DeepSpeed's all-gather is kept either way."""

    gloo_exchange: Literal["point_to_point", "collective"] = "point_to_point"
    """On gloo (CPU): ``point_to_point`` issues loco's all-to-alls and the cross-node hop of its
    all-gathers as sends and receives, every direction at once; gloo's collectives move a pair's
    two directions one after the other (on a 100 Mbit/s link, 1.1-2x the time for the same
    bytes).  ``collective``: gloo's ``all_to_all_single`` / ``all_gather_into_tensor``, for
    comparison.  The results are the same bit for bit; other backends keep their collectives."""

    node_size: int | None = pydantic.Field(default=None, ge=1, le=MAX_NODE_SIZE)
    """Ranks per node (node n holds ranks n*node_size ... (n+1)*node_size-1), 1 to 65536
    (:data:`MAX_NODE_SIZE`).  None: the ``LOCAL_WORLD_SIZE`` (torchrun) or ``LOCAL_SIZE``
    environment variable, else one node."""

    on_skip: Literal["restore", "reset"] = "restore"
    """When an fp16 step is skipped (overflow): ``restore`` the error buffers as they were
    before the step (keeps one old copy of each buffer during fp16 steps), or ``reset`` them
    to zero (no extra memory)."""

    kernels: Literal["compiled", "reference"] = "compiled"
    """``compiled`` (the default, also when the key is absent): the C++/CUDA kernels (built just
    in time; the pure-torch reference when the build fails, with a warning, or the device type
    has none).  ``reference``: always the pure-torch reference.  ``"auto"`` is also accepted (stored
    as ``compiled``), but Trainer/accelerate reject any ``"auto"`` they cannot fill themselves:
    leave the key out there."""
