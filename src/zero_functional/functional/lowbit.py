"""Low-bit optimizer state: what torchao's 8-bit, 4-bit and FP8 Adam(W) keep per element (pure).

Each moment as ``code_bits`` per element plus one fp32 scale per ``block`` elements, only for a
whole tensor of whole blocks and at least :data:`MIN_QUANTIZED_NUMEL` elements (bitsandbytes'
rule; a piece would decide wrongly: pytorch/ao#4912). The registry and the planner read it here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_QUANTIZED_NUMEL = 4096  # torchao's (bitsandbytes') _AdamBase._new_buffer


def quantized(numel: int, block: int) -> bool:
    """Whether torchao quantizes a whole tensor's state in blocks of ``block``.

    Example:
        >>> quantized(4096, 256), quantized(4096 + 128, 256)
        (True, False)
    """
    return numel >= MIN_QUANTIZED_NUMEL and numel % block == 0


@dataclass(frozen=True)
class LowBitSpec:
    """One low-bit kind: its ``plan --optimizer`` name, its classes' name suffix (``AdamW8bit``),
    each moment's code bits per element, and its block (the classes' default ``block_size``)."""

    name: str
    suffix: str
    code_bits: int
    block: int

    @property
    def class_path(self) -> str:
        return f"torchao.optim.AdamW{self.suffix}"

    def quantized(self, numel: int) -> bool:
        return quantized(numel, self.block)

    def state_bytes(self, numel: int, full_bytes: int = 4, owned: int | None = None) -> float:
        """Bytes of the two moments of ``owned`` elements (all by default) of a tensor of ``numel``:
        codes and scales where it is quantized, else ``full_bytes`` per element per moment.

        Example:
            >>> LOW_BIT["adamw4bit"].state_bytes(8192)  # 2 x (4096 B codes + 64 scales x 4 B)
            8704.0
        """
        n = numel if owned is None else owned
        if not 0 <= n <= numel:
            raise ValueError(f"owned must be in [0, numel={numel}], got {owned}")
        if not self.quantized(numel):
            return float(2 * full_bytes * n)
        codes = n * self.code_bits / 8
        scales = 4 * math.ceil(n / self.block)
        return float(2 * (codes + scales))


LOW_BIT: dict[str, LowBitSpec] = {
    spec.name: spec
    for spec in (
        LowBitSpec("adamw8bit", "8bit", code_bits=8, block=256),
        LowBitSpec("adamw4bit", "4bit", code_bits=4, block=128),
        LowBitSpec("adamwfp8", "Fp8", code_bits=8, block=256),
    )
}


def low_bit_spec(class_path: str) -> LowBitSpec | None:
    """The spec of the low-bit class at ``class_path`` (``module.Class``), else ``None``.

    Example:
        >>> low_bit_spec("torchao.optim.AdamW4bit").block, low_bit_spec("torch.optim.AdamW")
        (128, None)
    """
    return next((s for s in LOW_BIT.values() if s.class_path == class_path), None)
