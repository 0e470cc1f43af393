"""Wire formats: a contribution crosses the link in 8 or 16 bits and is decoded to fp32 (pure).

``torch.bfloat16``/``torch.float16``: a cast. ``torch.int8`` and ``torch.float8_e4m3fn``: symmetric,
one fp32 scale per block of :data:`BLOCK` contiguous elements (absmax/127, absmax/448: ZeRO++'s
qgZ), the scales first, then the codes. A block holding a non-finite value decodes to NaN
throughout, so that a ``GradScaler`` still sees the overflow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

BLOCK = 256  # elements per scale
WIRE_DTYPES = (torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn)
WIRE_NAMES = {  # the command line's names
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}
_LIMIT = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # the largest code
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
_MANTISSA = {torch.bfloat16: 8, torch.float16: 11}  # significant bits


def _round4(n: int) -> int:
    return -(-n // 4) * 4


@dataclass(frozen=True, slots=True)
class Codec:
    """One wire format: its size on the wire, its encoder and decoder.

    Example:
        >>> codec = Codec(torch.int8)
        >>> payload = codec.encode(torch.tensor([1.0, -0.5, 0.25]))
        >>> payload.numel(), codec.decode(payload, 3).tolist()
        (8, [1.0, -0.5039370059967041, 0.25196850299835205])
    """

    dtype: torch.dtype

    @property
    def blockwise(self) -> bool:
        """Whether the format carries a scale per block (int8, fp8)."""
        return self.dtype in _LIMIT

    def nbytes(self, numel: int) -> int:
        """The bytes ``numel`` elements take on the wire (scales included, padded to 4).

        Example:
            >>> Codec(torch.int8).nbytes(1024), Codec(torch.bfloat16).nbytes(1024)
            (1040, 2048)
        """
        if numel == 0:
            return 0
        if self.blockwise:
            return 4 * -(-numel // BLOCK) + _round4(numel)
        return _round4(numel * self.dtype.itemsize)

    def encode(self, x: Tensor) -> Tensor:
        """``x`` (1-D) as the bytes it travels in (a new ``uint8`` tensor; ``x`` untouched).

        Example:
            >>> Codec(torch.bfloat16).encode(torch.ones(2)).tolist()
            [128, 63, 128, 63]
        """
        out = torch.empty(self.nbytes(x.numel()), dtype=torch.uint8, device=x.device)
        self.encode_into(x, out)
        return out

    def encode_into(self, x: Tensor, out: Tensor) -> None:
        """:meth:`encode` written into ``out`` (``uint8``, :meth:`nbytes` long, 4-aligned).

        Example:
            >>> out = torch.empty(4, dtype=torch.uint8)
            >>> Codec(torch.float16).encode_into(torch.ones(2), out)
            >>> out.tolist()
            [0, 60, 0, 60]
        """
        n = x.numel()
        if n == 0:
            return
        if not self.blockwise:
            out[: n * self.dtype.itemsize].view(self.dtype).copy_(x)
            return
        blocks, whole = -(-n // BLOCK), n // BLOCK * BLOCK
        scales = out[: 4 * blocks].view(torch.float32)
        codes = out[4 * blocks : 4 * blocks + n].view(self.dtype)
        x = x.reshape(-1)
        if whole:  # the whole blocks as they are, the last one padded
            self._encode_rows(x[:whole].view(-1, BLOCK), scales[: whole // BLOCK], codes[:whole])
        if whole < n:
            tail = torch.zeros(BLOCK, dtype=x.dtype, device=x.device)
            tail[: n - whole].copy_(x[whole:])
            self._encode_rows(tail.view(1, BLOCK), scales[-1:], codes[whole:])

    def _encode_rows(self, rows: Tensor, scales: Tensor, codes: Tensor) -> None:
        """One scale per row of ``rows`` into ``scales``, as many codes as ``codes`` holds."""
        limit = _LIMIT[self.dtype]
        absmax = rows.abs().amax(dim=1).float()  # NaN or inf where a value is not finite
        scales.copy_(absmax / limit)
        # multiplied by limit / absmax (0 where that is not a finite number: the decoded block
        # is then NaN or inf whatever the codes, scale x code)
        inverse = torch.where(absmax > 0, limit / absmax, torch.zeros_like(absmax))
        inverse.masked_fill_(~inverse.isfinite(), 0.0)
        q = rows.float().mul(inverse[:, None]).nan_to_num_(0.0, 0.0, 0.0)
        if self.dtype == torch.int8:
            q.round_()
        codes.copy_(q.view(-1)[: codes.numel()])

    def decode(self, payload: Tensor, numel: int) -> Tensor:
        """The fp32 values of ``numel`` elements :meth:`encode` wrote into ``payload``.

        Example:
            >>> codec = Codec(torch.float8_e4m3fn)
            >>> codec.decode(codec.encode(torch.tensor([448.0, 1.0])), 2).tolist()
            [448.0, 1.0]
        """
        if numel == 0:
            return torch.zeros(0, dtype=torch.float32, device=payload.device)
        if not self.blockwise:
            return payload[: numel * self.dtype.itemsize].view(self.dtype).float()
        blocks = -(-numel // BLOCK)
        scale = payload[: 4 * blocks].view(torch.float32)
        codes = payload[4 * blocks : 4 * blocks + numel]
        values = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=payload.device)
        if self.dtype == torch.float8_e4m3fn and codes.device.type == "cpu":
            # a table of the 256 values: several times faster than the CPU's conversion
            torch.index_select(_FP8_VALUES, 0, codes.int(), out=values[:numel])
        else:
            values[:numel].copy_(codes.view(self.dtype))
        values.view(blocks, BLOCK).mul_(scale[:, None])  # a non-finite scale: not finite after
        return values[:numel]

    def rounding_bound(self, x: Tensor) -> Tensor:
        """The most each element of ``x`` (1-D) can move through :meth:`encode` and
        :meth:`decode`: half a quantum (a block's scale over 2 for int8; half an ulp, subnormals
        included, for the floating formats; no bound past fp16's largest value: it becomes inf).

        Example:
            >>> Codec(torch.int8).rounding_bound(torch.tensor([127.0, 1.0])).tolist()
            [0.5, 0.5]
        """
        x = x.float()
        if not self.blockwise:
            bits = _MANTISSA[self.dtype]
            info = torch.finfo(self.dtype)
            tiny = info.smallest_normal * 2.0 ** (1 - bits)  # a subnormal's ulp
            bound = torch.maximum(x.abs() * 2.0**-bits, torch.full_like(x, tiny / 2))
            return bound.masked_fill_(x.abs() > info.max, torch.inf)  # fp16 overflows past 65504
        n, blocks = x.numel(), -(-x.numel() // BLOCK)
        padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=x.device)
        padded[:n].copy_(x.abs())
        absmax = padded.view(blocks, BLOCK).amax(dim=1)
        per = (absmax / _LIMIT[self.dtype]).repeat_interleave(BLOCK)[:n]
        if self.dtype == torch.int8:
            bound = per / 2
        else:  # e4m3: 3 stored mantissa bits (half an ulp is 2**-4 of the value), subnormal ulp 2**-9
            bound = torch.maximum(x.abs() * 2.0**-4, per * 2.0**-10)
        # a block below ~1e-36, whose limit / absmax overflows fp32, is sent as zeros
        flushed = (_LIMIT[self.dtype] / absmax).isinf().repeat_interleave(BLOCK)[:n]
        return torch.where(flushed, x.abs(), bound)


def check_wire_dtype(value: object, name: str = "wire_dtype") -> Codec | None:
    """The :class:`Codec` of ``value`` (a keyword's value: ``None`` or one of :data:`WIRE_DTYPES`).

    Example:
        >>> check_wire_dtype(torch.int8)
        Codec(dtype=torch.int8)
    """
    if value is None:
        return None
    if isinstance(value, torch.dtype) and value in WIRE_DTYPES:
        return Codec(value)
    choices = ", ".join(map(str, WIRE_DTYPES))
    error = ValueError if isinstance(value, torch.dtype) else TypeError
    raise error(f"{name} must be None or one of {choices}; got {value!r}")
