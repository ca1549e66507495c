"""Full-size orthogonal transforms for the Hadamard baseline (QuaRot-style), for any dimension.

QuaRot rotates with a Hadamard matrix of the whole dimension d = 2^k · m: H_{2^k} (Sylvester, by a fast
Walsh-Hadamard transform) ⊗ a known Hadamard matrix of the odd part (it ships H_12, H_20, H_28, H_40, H_172...).
The earlier baseline used the largest power of two dividing d as a block-diagonal transform, so d = 768 mixed only
within 256-wide blocks and an odd d got sign flips only: the outliers of one channel stayed in a quarter of the
channels, or in their own. Here, with d = m' · 2^j (m' = m · 2^i, i ≤ k the fewest extra factors of two):

- m' = 1: R = H_d / √d · diag(s) (Sylvester; d a power of two);
- a Paley Hadamard matrix of order m' exists (Paley I: m' − 1 a prime ≡ 3 mod 4; Paley II: m'/2 − 1 a prime
  ≡ 1 mod 4; order up to ``MAX_EXPLICIT``): R = (H_{m'} ⊗ H_{2^j}) / √d · diag(s) — a true Hadamard matrix of
  order d, every entry ±1/√d (768 = 12 · 64, 1000 = 500 · 2, 5120 = 20 · 256);
- otherwise, m ≤ ``MAX_EXPLICIT``: R = (Q_m ⊗ H_{2^k} / √2^k) · diag(s), Q_m a seeded Haar-random orthogonal
  matrix (688 = 43 · 16; odd d up to 4096: Q_d itself);
- larger odd parts (an odd d > 4096): OrthoAdam's windowed randomised Hadamard (``trainers.optim.rotations``,
  three overlapping power-of-two windows): dense and O(d) memory.

s is a seeded ±1 vector. Every case is orthogonal and mixes every input channel into every output channel.
Factors are built in float64 and applied in float32.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

MAX_EXPLICIT = 4096  # largest explicit odd-part factor (Paley or Haar): 64 MiB in float32


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    return all(n % p for p in range(2, math.isqrt(n) + 1))


def _jacobsthal(q: int) -> Tensor:
    """Q_ij = χ(j − i) for a prime q, χ the quadratic character mod q (χ(0) = 0)."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if a in squares else -1.0 for a in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    return chi[(idx.view(1, -1) - idx.view(-1, 1)) % q]


@functools.cache
def paley_hadamard(n: int) -> Tensor | None:
    """An (unnormalised, ±1) Hadamard matrix of order n by Paley's first or second construction, else None."""
    q = n - 1
    if n % 4 == 0 and _is_prime(q) and q % 4 == 3:  # Paley I: H = I + [[0, 1ᵀ], [−1, Q]]
        s = torch.zeros(n, n, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, _jacobsthal(q)
        return torch.eye(n, dtype=torch.float64) + s
    q = n // 2 - 1
    if (
        n % 4 == 0 and _is_prime(q) and q % 4 == 1
    ):  # Paley II: C ⊗ [[1, 1], [1, −1]] + I ⊗ [[1, −1], [−1, −1]]
        c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1.0, 1.0, _jacobsthal(q)
        a = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        b = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        return torch.kron(c, a) + torch.kron(torch.eye(q + 1, dtype=torch.float64), b)
    return None


def fwht(x: Tensor) -> Tensor:
    """Unnormalised fast Walsh–Hadamard transform over the last dim (a power of two): x ↦ x · H (Sylvester H)."""
    n = x.shape[-1]
    h = 1
    while h < n:
        x = x.unflatten(-1, (n // (2 * h), 2, h))  # pairs (i, i + h) inside each run of 2h
        x = torch.stack((x[..., 0, :] + x[..., 1, :], x[..., 0, :] - x[..., 1, :]), dim=-2).flatten(-3)
        h *= 2
    return x


def odd_factor(dim: int, gen: torch.Generator) -> tuple[Tensor | None, str]:
    """(the explicit orthonormal factor F of R = (F ⊗ H_{2^j}/√2^j)·diag(s), or None; a description)."""
    k = (dim & -dim).bit_length() - 1
    m = dim >> k
    if m == 1:
        return None, f"Sylvester H_{dim}"
    for i in range(k + 1):
        order = m << i
        if order > MAX_EXPLICIT:
            break
        h = paley_hadamard(order)
        if h is not None:
            return h / math.sqrt(order), f"Paley H_{order} ⊗ H_{dim // order}"
    if m > MAX_EXPLICIT:
        return None, "windowed"
    q, r = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)), f"Haar Q_{m} ⊗ H_{dim // m}"


def apply_kron(x: Tensor, factor: Tensor | None) -> Tensor:
    """x ↦ x · (F ⊗ H_b / √b)ᵀ over the last dim, F (m×m) on the slow sub-axis, b = dim / m (a power of two)."""
    m = 1 if factor is None else factor.shape[0]
    u = x.unflatten(-1, (m, x.shape[-1] // m))
    b = u.shape[-1]
    if b > 1:
        u = fwht(u) * (1.0 / math.sqrt(b))
    if factor is not None:
        u = torch.matmul(factor, u)  # (m, m) @ (..., m, b): F acting on the slow sub-axis
    return u.flatten(-2)


def seeded_factors(dim: int, seed: int = 0) -> tuple[Tensor, Tensor | None, str]:
    """(signs s, explicit factor F or None, kind) of R = (F ⊗ H_b / √b) · diag(s) for ``dim`` and ``seed``: the
    rotation ``fake.HadamardRotation(dim, seed)`` applies (it draws from one generator in this order)."""
    gen = torch.Generator().manual_seed(seed)
    factor, kind = odd_factor(dim, gen)
    signs = torch.randint(0, 2, (dim,), generator=gen).float() * 2 - 1
    return signs, factor, kind


@functools.lru_cache(maxsize=8)
def _head_factors(dim: int, seed: int) -> tuple[Tensor, Tensor | None]:
    signs, factor, kind = seeded_factors(dim, seed)
    if kind == "windowed":  # an odd part above MAX_EXPLICIT: no attention head is that wide
        raise ValueError(f"no explicit Hadamard rotation of order {dim}")
    return signs, None if factor is None else factor.float()


def rotate_rows(x: Tensor, seed: int = 0, inverse: bool = False) -> Tensor:
    """x (…, d) ↦ x·Rᵀ, or with ``inverse`` x·R, in float32, R the seeded rotation of ``seeded_factors(d, seed)``
    (orthogonal, so each undoes the other). A fast Walsh–Hadamard transform and the odd part's small factor, not a
    dense matmul: each row's result does not depend on how many rows are transformed together (the KV cache's
    fake and packed paths read back the same bits: ``qbench.quant.kvschemes``, ``rotate=true``)."""
    signs, factor = _head_factors(x.shape[-1], seed)
    signs = signs.to(x.device)
    factor = None if factor is None else factor.to(x.device)
    if inverse:  # x·R = (x·(F ⊗ H_b/√b)) ⊙ s, H_b symmetric: apply_kron with Fᵀ
        return apply_kron(x.float(), None if factor is None else factor.t()) * signs
    return apply_kron(x.float() * signs, factor)
