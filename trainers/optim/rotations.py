"""Fixed random orthogonal transforms for OrthoAdam: one per parameter, re-derived from a seed, never stored.

A full n×n rotation of a flattened weight is out of reach (GPT-2-small's MLP weight would need ~22 TB), so a
parameter of shape (d_0, ..., d_k) gets one orthogonal transform per axis and the parameter's transform is their
Kronecker product. For a 2-D weight W (out, in) that is W' = Q_out W Q_inᵀ. Axes of length 1 and 0-D parameters
are left alone (plain Adam on them).

Per-axis kinds (the ``rotation=`` names):

- ``hadamard`` (default): a randomised Hadamard transform Q = F·diag(s), s a seeded ±1 vector. F is chosen by n:
  * n = 2^k: the normalised Walsh–Hadamard matrix H_n, applied as a Kronecker product of small explicit Hadamard
    factors (one up to 64, else ⌈k/5⌉ factors ≤ 32: 8192 = 16·16·32) with one matmul each: Σ sizes flops per
    element, O(n) memory. In eager torch that beats the textbook FWHT's log2(n) add/sub passes (8192×384 on one
    core: ~10 ms vs ~35 ms), because every pass is a full read and write of the tensor.
  * n = 2^k·m with odd m ≤ MAX_ODD_FACTOR (384 = 128·3, 1536 = 512·3, 32000 = 256·125): F = R_m ⊗ H_{2^k} with
    R_m a seeded Haar-random m×m orthogonal matrix (merged into the first Hadamard factor when small). A Kronecker
    product of dense matrices is dense; for n = 384 its coherence √n·max|Q_ij| is 1.35 — flatter than a Haar
    matrix (4.8); 1 is the optimum, √n the identity — for m² extra memory.
  * any other n (large odd part, e.g. GPT-2's vocabulary 50257): three overlapping power-of-two windows,
    Q = W_3 W_2 W_1, each W an independent randomised Hadamard on b = 2^⌊log2 n⌋ coordinates — the head [0, b),
    then the tail [n−b, n), then the head again. Since b > n/2 the windows overlap, so after the tail pass every
    coordinate of the tail depends on every input, and the third pass carries that to the head: Q is dense.
  Why not "random permutation + Hadamard on power-of-two blocks"? With blocks of the largest power of two dividing
  n, n = 1000 = 8·125 gets 8-blocks and two rounds leave 94 % of Q's entries zero (coherence 11.9); an odd n gets
  1-blocks, i.e. a signed permutation — exactly Adam. Blocks from n's binary expansion (384 = 256 + 128) with a
  permutation between two rounds leave 4–8 % zeros (384, 1000) and need a third round to be dense. The choices
  above are dense for every n; measured √n·max|Q_ij| (Haar in brackets): 1000 → 3.8 (4.7), 1001 → 4.8 with
  windows (4.9), 3001 → 5.0 (5.5).
- ``dense``: a seeded Haar-random orthogonal matrix per axis (QR of a Gaussian, signs fixed). Axes longer than
  ``block_size`` (the vocabulary) get a block-diagonal matrix of Haar blocks of that size (the last block
  shorter), which mixes only within a block along that axis. Cost n (or block_size) flops per element and memory.
- ``identity``: Q = I (reproduces AdamW exactly; for tests).
- ``signed-permutation``: Q = diag(s)·P. NOT a rotation for OrthoAdam's purpose: Adam's per-coordinate update is
  equivariant to it, so it trains exactly like Adam. Kept only to test that pitfall.

Every axis transform acts on a tensor viewed as (L, n, R) along its middle axis; ``apply(x, transpose=True)``
applies Qᵀ = Q⁻¹. Transforms are generated on the CPU in float64 from a torch.Generator seeded by a hash of (seed,
parameter index, shape, axis), then cast to the parameter's device and dtype — the same numbers on every device
and every run, so a resumed optimiser rebuilds them instead of storing them.
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from models.errors import UserError
from models.registry import Registry

MAX_ODD_FACTOR = 128  # largest odd m kept as a dense m×m factor in hadamard mode (Llama's 32000 = 2^8·125)
MAX_HADAMARD_FACTOR_LOG2 = 5  # explicit Hadamard factors up to 32×32: fewest flops at good matmul efficiency
DEFAULT_BLOCK_SIZE = 1024


def axis_seed(seed: int, index: int, shape: Sequence[int], axis: int, kind: str) -> int:
    """A 63-bit seed for one axis of one parameter: sha256 of (seed, index, shape, axis, kind).

    Python's hash() is salted per process, so it cannot be used; sha256 gives the same value everywhere.
    """
    key = f"{seed}/{index}/{tuple(int(d) for d in shape)}/{axis}/{kind}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1


def random_signs(n: int, gen: torch.Generator) -> Tensor:
    """n independent ±1 values (float64)."""
    return torch.randint(0, 2, (n,), generator=gen).to(torch.float64).mul_(2).sub_(1)


def hadamard_matrix(n: int) -> Tensor:
    """The normalised Sylvester–Hadamard matrix H_n / √n (n a power of two), float64; symmetric and orthogonal."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def haar_orthogonal(n: int, gen: torch.Generator) -> Tensor:
    """A Haar-distributed n×n orthogonal matrix (float64): QR of a Gaussian with R's diagonal signs moved into Q."""
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).contiguous()


def apply_factor(x: Tensor, f: Tensor, pre: int, post: int, out: Tensor) -> Tensor:
    """F (k×k) times the middle axis of ``x`` viewed as (pre, k, post), written into ``out`` (not aliasing x).

    The branches pick the matmul shape the BLAS handles best: a plain GEMM when either side is trivial.
    """
    k = f.shape[0]
    if post == 1:
        torch.mm(x.view(pre, k), f.mT, out=out.view(pre, k))
    elif pre == 1:
        torch.mm(f, x.view(k, post), out=out.view(k, post))
    else:
        torch.matmul(f, x.view(pre, k, post), out=out.view(pre, k, post))
    return out


def scratch_pair(x: Tensor) -> tuple[Tensor, Tensor]:
    """A contiguous copy of ``x`` and an uninitialised tensor like it: the two buffers a transform chain needs."""
    return x.clone(memory_format=torch.contiguous_format), torch.empty_like(
        x, memory_format=torch.contiguous_format
    )


class AxisRotation(ABC):
    """An orthogonal n×n matrix Q acting on the middle axis of a tensor viewed as (L, n, R)."""

    n: int

    @abstractmethod
    def apply(self, x: Tensor, transpose: bool = False) -> Tensor:
        """Q·x (or Qᵀ·x) along axis 1 of the 3-D tensor ``x``; returns a new tensor, never modifies ``x``."""

    def apply_(self, x: Tensor, spare: Tensor, transpose: bool = False) -> tuple[Tensor, Tensor]:
        """The same on scratch tensors: ``x`` (contiguous) and ``spare`` (same shape) may both be overwritten.

        Returns (result, free): two distinct tensors of x's shape, so a chain of transforms runs without
        allocating (on CPU each fresh multi-MB tensor costs page faults). This default allocates.
        """
        return self.apply(x, transpose), x

    @abstractmethod
    def tensors(self) -> list[Tensor]:
        """The tensors this transform holds (for moving it between devices and for the memory report)."""

    @abstractmethod
    def to(self, device: torch.device, dtype: torch.dtype) -> AxisRotation:
        """A copy on ``device`` in ``dtype``."""

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def matrix(self) -> Tensor:
        """Q itself, by applying it to the identity (for tests and small n only)."""
        eye = torch.eye(self.n, dtype=self.dtype(), device=self.device())
        return self.apply(eye.view(1, self.n, self.n)).view(self.n, self.n)

    def dtype(self) -> torch.dtype:
        ts = self.tensors()
        return ts[0].dtype if ts else torch.float32

    def device(self) -> torch.device:
        ts = self.tensors()
        return ts[0].device if ts else torch.device("cpu")


class IdentityRotation(AxisRotation):
    """Q = I."""

    def __init__(self, n: int) -> None:
        self.n = n

    def apply(self, x: Tensor, transpose: bool = False) -> Tensor:
        return x.clone()

    def tensors(self) -> list[Tensor]:
        return []

    def to(self, device: torch.device, dtype: torch.dtype) -> IdentityRotation:
        return self


class SignedPermutation(AxisRotation):
    """Q = diag(s)·P: (Qx)_i = s_i · x_{perm_i}. Adam is equivariant to it — see the module docstring."""

    def __init__(self, perm: Tensor, signs: Tensor) -> None:
        self.n = perm.numel()
        self.perm, self.signs = perm, signs
        self.inv_perm = torch.argsort(perm)

    def apply(self, x: Tensor, transpose: bool = False) -> Tensor:
        s = self.signs.view(1, -1, 1)
        if transpose:  # Qᵀy = Pᵀ(s ⊙ y)
            return (x * s).index_select(1, self.inv_perm)
        return x.index_select(1, self.perm) * s

    def tensors(self) -> list[Tensor]:
        return [self.perm, self.signs, self.inv_perm]

    def to(self, device: torch.device, dtype: torch.dtype) -> SignedPermutation:
        return SignedPermutation(self.perm.to(device), self.signs.to(device, dtype))

    def dtype(self) -> torch.dtype:
        return self.signs.dtype


class KroneckerRotation(AxisRotation):
    """Q = (F_1 ⊗ F_2 ⊗ ... ⊗ F_c)·diag(s), each F_i a small explicit orthogonal matrix.

    F_1 is the slowest-varying sub-axis of the n coordinates (row-major), F_c the fastest. Kronecker factors act
    on different sub-axes, so they commute and Qᵀ = diag(s)·(F_1ᵀ ⊗ ... ⊗ F_cᵀ).
    """

    def __init__(self, factors: list[Tensor], signs: Tensor | None) -> None:
        self.factors, self.signs = factors, signs  # signs None: diag(s) = I (a Haar factor needs none)
        self.n = math.prod(f.shape[0] for f in factors)
        if signs is not None and signs.numel() != self.n:
            raise ValueError(f"{signs.numel()} signs for factor sizes {[f.shape[0] for f in factors]}")

    def apply(self, x: Tensor, transpose: bool = False) -> Tensor:
        return self.apply_(*scratch_pair(x), transpose=transpose)[0]

    def apply_(self, x: Tensor, spare: Tensor, transpose: bool = False) -> tuple[Tensor, Tensor]:
        L, n, R = x.shape
        s = None if self.signs is None else self.signs.view(n, 1)
        if s is not None and not transpose:
            x.mul_(s)
        done = 1  # product of the factor sizes already applied (the slower-varying sub-axes)
        for f in self.factors:
            k = f.shape[0]
            apply_factor(x, f.mT if transpose else f, L * done, R * (n // (done * k)), out=spare)
            x, spare = spare, x
            done *= k
        if s is not None and transpose:
            x.mul_(s)
        return x, spare

    def tensors(self) -> list[Tensor]:
        return [*self.factors] + ([] if self.signs is None else [self.signs])

    def to(self, device: torch.device, dtype: torch.dtype) -> KroneckerRotation:
        signs = None if self.signs is None else self.signs.to(device, dtype)
        return KroneckerRotation([f.to(device, dtype) for f in self.factors], signs)


class WindowedRotation(AxisRotation):
    """Q = W_3·W_2·W_1: each W_j an orthogonal transform of a window of b coordinates, identity elsewhere.

    Windows [0, b), [n−b, n), [0, b) with b > n/2 overlap, which makes Q dense (module docstring).
    """

    def __init__(self, n: int, windows: list[tuple[int, AxisRotation]]) -> None:
        self.n, self.windows = n, windows

    def apply(self, x: Tensor, transpose: bool = False) -> Tensor:
        x = x.clone()
        for start, rot in reversed(self.windows) if transpose else self.windows:
            stop = start + rot.n
            x[:, start:stop] = rot.apply(x[:, start:stop], transpose)
        return x

    def tensors(self) -> list[Tensor]:
        return [t for _, rot in self.windows for t in rot.tensors()]

    def to(self, device: torch.device, dtype: torch.dtype) -> WindowedRotation:
        return WindowedRotation(self.n, [(start, rot.to(device, dtype)) for start, rot in self.windows])


class BlockDiagonalRotation(AxisRotation):
    """Q = diag(B_1, ..., B_q, B_tail): dense orthogonal blocks of ``block`` coordinates (the tail block shorter)."""

    def __init__(self, blocks: Tensor, tail: Tensor | None) -> None:
        self.blocks, self.tail = blocks, tail  # (q, b, b) and (r, r) or None
        self.n = blocks.shape[0] * blocks.shape[1] + (0 if tail is None else tail.shape[0])

    def apply(self, x: Tensor, transpose: bool = False) -> Tensor:
        L, _, R = x.shape
        q, b, _ = self.blocks.shape
        blocks = self.blocks.mT if transpose else self.blocks
        head = x[:, : q * b].reshape(L, q, b, R)
        out = torch.einsum("qij,lqjr->lqir", blocks, head).reshape(L, q * b, R)
        if self.tail is None:
            return out
        tail = x[:, q * b :].contiguous()
        tail = apply_factor(tail, self.tail.mT if transpose else self.tail, L, R, out=torch.empty_like(tail))
        return torch.cat([out, tail], dim=1)

    def tensors(self) -> list[Tensor]:
        return [self.blocks] + ([] if self.tail is None else [self.tail])

    def to(self, device: torch.device, dtype: torch.dtype) -> BlockDiagonalRotation:
        tail = None if self.tail is None else self.tail.to(device, dtype)
        return BlockDiagonalRotation(self.blocks.to(device, dtype), tail)


def hadamard_factor_sizes(k: int) -> list[int]:
    """Sizes of the explicit Hadamard factors of H_{2^k}, ascending (the largest is the fastest sub-axis).

    Up to 64 one factor; beyond, ⌈k/5⌉ near-equal factors of at most 32: few flops (Σ sizes per element) with
    matmuls still large enough to run near peak (8192 → 16·16·32).
    """
    if k <= 6:
        return [1 << k] if k else []
    count = math.ceil(k / MAX_HADAMARD_FACTOR_LOG2)
    base, extra = divmod(k, count)
    return [1 << base] * (count - extra) + [1 << (base + 1)] * extra


def build_hadamard(n: int, gen: torch.Generator, block_size: int = DEFAULT_BLOCK_SIZE) -> AxisRotation:
    """Randomised Hadamard transform for any n (the three cases of the module docstring)."""
    k = (n & -n).bit_length() - 1  # n = 2^k · m with m odd
    m = n >> k
    if m > MAX_ODD_FACTOR:
        b = 1 << (n.bit_length() - 1)
        return WindowedRotation(n, [(start, build_hadamard(b, gen)) for start in (0, n - b, 0)])
    factors = [hadamard_matrix(size) for size in hadamard_factor_sizes(k)]
    if m > 1:
        odd = haar_orthogonal(m, gen)
        if factors and m * factors[0].shape[0] <= 128:  # one larger matmul beats a tiny m×m one
            factors[0] = torch.kron(odd, factors[0])
        else:
            factors.insert(0, odd)
    return KroneckerRotation(factors, random_signs(n, gen))


def build_dense(n: int, gen: torch.Generator, block_size: int = DEFAULT_BLOCK_SIZE) -> AxisRotation:
    """A Haar-random orthogonal matrix; block-diagonal Haar blocks of ``block_size`` when n is longer."""
    if n <= block_size:
        return KroneckerRotation([haar_orthogonal(n, gen)], None)
    q, r = divmod(n, block_size)
    blocks = torch.stack([haar_orthogonal(block_size, gen) for _ in range(q)])
    return BlockDiagonalRotation(blocks, haar_orthogonal(r, gen) if r else None)


def build_identity(n: int, gen: torch.Generator, block_size: int = DEFAULT_BLOCK_SIZE) -> AxisRotation:
    return IdentityRotation(n)


def build_signed_permutation(
    n: int, gen: torch.Generator, block_size: int = DEFAULT_BLOCK_SIZE
) -> AxisRotation:
    perm = torch.randperm(n, generator=gen)
    return SignedPermutation(perm, random_signs(n, gen))


AxisBuilder = Callable[[int, torch.Generator, int], AxisRotation]
ROTATIONS: Registry[AxisBuilder] = Registry("rotation")
ROTATIONS.register(
    "hadamard", build_hadamard, "randomised Hadamard per axis, O(n) memory (default)", ("had",)
)
ROTATIONS.register("dense", build_dense, "Haar-random orthogonal per axis, block-diagonal past block_size")
ROTATIONS.register("identity", build_identity, "Q = I: exactly AdamW (tests)", ("none",))
ROTATIONS.register(
    "signed-permutation", build_signed_permutation, "±1 and a shuffle: exactly Adam, the pitfall (tests)"
)


class ParamRotation:
    """The Kronecker product of per-axis rotations for one parameter shape: Q = Q_0 ⊗ Q_1 ⊗ ... ⊗ Q_k.

    ``forward(g)`` is Q·vec(g) reshaped (for 2-D: Q_out g Q_inᵀ); ``inverse(u)`` is Qᵀ·vec(u). Axes whose entry is
    None (length 1) are left alone. Both return new tensors and never modify their input.
    """

    def __init__(self, shape: Sequence[int], axes: list[AxisRotation | None]) -> None:
        self.shape = torch.Size(shape)
        self.axes = axes

    def apply_(self, x: Tensor, spare: Tensor, transpose: bool = False) -> tuple[Tensor, Tensor]:
        """Q·x (Qᵀ·x when ``transpose``) on scratch tensors of the parameter's shape, both contiguous and
        overwritable; returns (result, free) as :meth:`AxisRotation.apply_` does."""
        for a, rot in enumerate(self.axes):
            if rot is not None:
                view = (math.prod(self.shape[:a]), rot.n, math.prod(self.shape[a + 1 :]))
                x, spare = rot.apply_(x.view(view), spare.view(view), transpose)
        return x.view(self.shape), spare.view(self.shape)

    def forward(self, g: Tensor) -> Tensor:
        return self.apply_(*scratch_pair(g), transpose=False)[0]

    def inverse(self, u: Tensor) -> Tensor:
        return self.apply_(*scratch_pair(u), transpose=True)[0]

    def nbytes(self) -> int:
        return sum(rot.nbytes() for rot in self.axes if rot is not None)

    def to(self, device: torch.device, dtype: torch.dtype) -> ParamRotation:
        return ParamRotation(self.shape, [None if r is None else r.to(device, dtype) for r in self.axes])


def param_rotation(
    shape: Sequence[int],
    kind: str = "hadamard",
    seed: int = 0,
    index: int = 0,
    block_size: int = DEFAULT_BLOCK_SIZE,
    fixed_axes: Sequence[int] = (),
) -> ParamRotation | None:
    """The fixed rotation of parameter number ``index`` (its position among the optimiser's parameters).

    Returns None when the parameter is left as plain Adam: the ``identity`` kind, 0-D parameters and parameters
    with a single element. Deterministic in (kind, seed, index, shape, block_size); built in float64 on the CPU.
    Axes in ``fixed_axes`` are not rotated (an embedding's token axis: see ``trainers.optim.registry``).
    """
    builder = ROTATIONS.get(kind)
    kind = ROTATIONS.canonical(kind)
    if block_size < 1:
        raise UserError(f"block_size must be a positive integer, got {block_size}")
    if kind == "identity" or math.prod(n for a, n in enumerate(shape) if a not in fixed_axes) <= 1:
        return None
    axes: list[AxisRotation | None] = []
    for axis, n in enumerate(shape):
        gen = torch.Generator().manual_seed(axis_seed(seed, index, shape, axis, kind))
        axes.append(builder(int(n), gen, block_size) if n > 1 and axis not in fixed_axes else None)
    return ParamRotation(shape, axes)
