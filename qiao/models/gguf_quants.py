"""GGUF's quantized block formats decoded, vectorised over all blocks of a tensor at once.

Each decoder takes a matrix's raw rows, uint8 [N, K / block * block bytes] as the file stores
them (row-major, one row of blocks per output feature), and computes in float32 in the order
`gguf.quants.dequantize` does, so the results are bit for bit the gguf package's
(tests/test_gguf.py, tests/test_gguf_kquants.py).

- Q4_0, Q4_1 and Q4_K come back as 4-bit codes with a float32 scale and offset per 32 weights
  (w = q scale - offset), the int4 path's own form (`Int4Weights`).
- Q8_0, Q5_0, Q5_1, Q5_K and Q6_K come back as float32 weights [N, K]: their codes need more
  than 4 bits, so no int4 form holds them exactly.
"""

from __future__ import annotations

import torch


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian -> float32 [...]."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _bits(raw: torch.Tensor, count: int) -> torch.Tensor:
    """[..., count / 8] uint8 -> [..., count] uint8 0/1, bit i of byte j at j * 8 + i (a
    little-endian bit field)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((raw[..., None] >> shifts) & 1).reshape(*raw.shape[:-1], count)


def decode_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """Q8_0 rows [N, K/32 * 34] -> float32 [N, K]: each block is d (f16) and 32 int8, w = q d."""
    blocks = raw.reshape(raw.shape[0], -1, 34)
    d = _f16(blocks[..., :2])
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (q * d[..., None]).reshape(raw.shape[0], -1)


def decode_q4_0(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 rows [N, K/32 * 18] -> (codes uint8 [N, K], scales, offsets float32 [N, K/32]).

    A block is d (f16) and 16 bytes: element i < 16 in the low nibble of byte i, element 16 + i
    in its high nibble; w = (q - 8) d, i.e. scale d and offset 8 d.
    """
    blocks = raw.reshape(raw.shape[0], -1, 18)
    d = _f16(blocks[..., :2])
    qs = blocks[..., 2:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [N, blocks, 32]
    return codes.reshape(raw.shape[0], -1), d, 8.0 * d


def decode_q4_1(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 rows [N, K/32 * 20] -> (codes uint8 [N, K], scales, offsets float32 [N, K/32]):
    d, m (f16), then Q4_0's 16 bytes of nibbles; w = q d + m, i.e. scale d and offset -m."""
    blocks = raw.reshape(raw.shape[0], -1, 20)
    d, m = _f16(blocks[..., :2]), _f16(blocks[..., 2:4])
    qs = blocks[..., 4:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
    return codes.reshape(raw.shape[0], -1), d, -m


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes [N, blocks, 12] -> 6-bit (scale, min) of the 8 sub-blocks, float32
    [N, blocks, 8] each. Sub-blocks 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins);
    sub-blocks 4-7: a nibble of bytes 8-11 plus the top 2 bits of bytes 0-3 (scales) or 4-7
    (mins)."""
    packed = packed.reshape(*packed.shape[:-1], 3, 4)
    low, high, mixed = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = torch.cat([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], dim=-1).float()
    m = torch.cat([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], dim=-1).float()
    return sc, m


def decode_q4_k(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K rows [N, K/256 * 144] -> (codes uint8 [N, K], scales, offsets float32 [N, K/32]).

    A super-block of 256 is d, dmin (f16), 12 bytes of 6-bit (scale, min) pairs for its 8
    sub-blocks of 32, and 128 bytes of codes: sub-blocks 2c and 2c+1 are the low and high
    nibbles of bytes 32c..32c+31. w = q (d sc) - dmin m.
    """
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 144)
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, m = _k_scales(blocks[..., 4:16])
    qs = blocks[..., 16:].reshape(n, -1, 4, 1, 32)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-2)  # [N, blocks, 4 chunks, 2 halves, 32]
    scales = (d[..., None] * sc).reshape(n, -1)
    offsets = (dmin[..., None] * m).reshape(n, -1)
    return codes.reshape(n, -1), scales, offsets


def decode_q5_0(raw: torch.Tensor) -> torch.Tensor:
    """Q5_0 rows [N, K/32 * 22] -> float32 [N, K]. A block is d (f16), 4 bytes of high bits
    (bit i of the little-endian 32-bit field for element i) and Q4_0's 16 bytes of low nibbles;
    w = (q - 16) d."""
    blocks = raw.reshape(raw.shape[0], -1, 22)
    d = _f16(blocks[..., :2])
    q = _five_bit_codes(blocks[..., 2:6], blocks[..., 6:])
    return (d[..., None] * (q.float() - 16)).reshape(raw.shape[0], -1)  # q - 16 exact in float


def decode_q5_1(raw: torch.Tensor) -> torch.Tensor:
    """Q5_1 rows [N, K/32 * 24] -> float32 [N, K]: d, m (f16), then Q5_0's bits; w = q d + m."""
    blocks = raw.reshape(raw.shape[0], -1, 24)
    d, m = _f16(blocks[..., :2]), _f16(blocks[..., 2:4])
    q = _five_bit_codes(blocks[..., 4:8], blocks[..., 8:]).float()
    return (d[..., None] * q + m[..., None]).reshape(raw.shape[0], -1)


def _five_bit_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1's 4 high-bit bytes and 16 nibble bytes [..., 4], [..., 16] -> codes 0..31
    [..., 32] uint8: element i < 16 the low nibble of byte i, element 16 + i its high nibble."""
    low = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
    return low | (_bits(qh, 32) << 4)


def decode_q5_k(raw: torch.Tensor) -> torch.Tensor:
    """Q5_K rows [N, K/256 * 176] -> float32 [N, K]. A super-block is Q4_K's d, dmin and 12
    scale bytes, 32 bytes of high bits (sub-block s of 32 takes bit s of byte l for its element
    l) and Q4_K's 128 bytes of low nibbles; w = q (d sc) - dmin m, q 0..31."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 176)
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, m = _k_scales(blocks[..., 4:16])
    qh = blocks[..., 16:48]  # [N, blocks, 32]
    qs = blocks[..., 48:].reshape(n, -1, 4, 1, 32)
    low = torch.cat([qs & 0x0F, qs >> 4], dim=-2).reshape(n, -1, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8)[:, None]
    high = (qh[..., None, :] >> shifts) & 1  # [N, blocks, 8 sub-blocks, 32]
    q = (low | (high << 4)).float()
    scale = (d[..., None] * sc)[..., None]
    offset = (dmin[..., None] * m)[..., None]
    return (scale * q - offset).reshape(n, -1)


def decode_q6_k(raw: torch.Tensor) -> torch.Tensor:
    """Q6_K rows [N, K/256 * 210] -> float32 [N, K]. A super-block is 128 bytes of low nibbles,
    64 of high 2-bit pairs, 16 int8 scales (one per 16 weights) and d (f16); w = (d sc) (q - 32).

    Element 128 h + 32 j + l (h the half, j 0..3, l 0..31) takes its low nibble from byte
    64 h + 32 (j % 2) + l (low nibble for j < 2, high for j >= 2) and its high bits from bits
    2j, 2j+1 of byte 64 + 32 h + l.
    """
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 210)
    ql = blocks[..., :128].reshape(n, -1, 2, 1, 64)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=-2).reshape(n, -1, 2, 4, 32)
    qh = blocks[..., 128:192].reshape(n, -1, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    high = (qh >> shifts) & 0x03  # [N, blocks, 2 halves, 4, 32]
    q = ((low | (high << 4)).float() - 32).reshape(n, -1, 16, 16)  # q - 32 exact in float
    sc = blocks[..., 192:208].contiguous().view(torch.int8).float()  # [N, blocks, 16]
    d = _f16(blocks[..., 208:210])
    return ((d[..., None] * sc)[..., None] * q).reshape(n, -1)


# The types decoded to float weights (their codes need more than 4 bits).
FLOAT_DECODERS = {
    "Q8_0": decode_q8_0,
    "Q5_0": decode_q5_0,
    "Q5_1": decode_q5_1,
    "Q5_K": decode_q5_k,
    "Q6_K": decode_q6_k,
}
# The types decoded to int4 codes, scales and offsets (the int4 path takes them as they are).
INT4_DECODERS = {"Q4_0": decode_q4_0, "Q4_1": decode_q4_1, "Q4_K": decode_q4_k}
