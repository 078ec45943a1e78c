"""Orthogonal rotations for KV quantization: Hadamard, bit-reversal placement, OSCAR composition.

Convention: rows are rotated on the right, ``x_rot = x @ R``.  For a covariance C (the error
weighting of the rows), eigh gives C = U diag(lam) U^T and ``x @ U`` lands in the eigenbasis.

OSCAR rotation, as built here:  R = U . P_br . H_G
  * U     eigenvectors of the weighting covariance (query second moment for keys, attention-output
          second moment for values);
  * P_br  a permutation that places the eigen-direction of importance rank r (0 = largest
          eigenvalue) at channel bitrev(r), so every power-of-two group of G channels receives one
          direction from each of G importance levels;
  * H_G   block-diagonal normalized Walsh-Hadamard of size G (the quantization group): inside each
          group it spreads every direction over all G channels, so each channel carries the mean
          eigenvalue of its group - which P_br made equal across groups.
With G = D this is U . P . H, and every channel carries exactly tr(C)/D.
The authors apply P_br *after* a full Hadamard, where it is a data-independent no-op; placing it
before a group-sized Hadamard is what makes the placement act on eigen-directions.
"""

from __future__ import annotations

import contextlib

import torch

ORTHOGONALITY_TOLERANCE = 1e-4


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def hadamard(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Normalized Sylvester Walsh-Hadamard matrix of order n (symmetric, orthogonal)."""
    if not is_power_of_two(n):
        raise ValueError(f"Hadamard order must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).to(dtype)


def block_hadamard(dim: int, block: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Block-diagonal Hadamard: one normalized Hadamard of order ``block`` per group of channels."""
    if dim % block:
        raise ValueError(f"block {block} must divide dim {dim}")
    return torch.block_diag(*([hadamard(block, torch.float64)] * (dim // block))).to(dtype)


def bit_reverse(i: int, nbits: int) -> int:
    return int(format(i, f"0{nbits}b")[::-1], 2) if nbits else 0


def bit_reversal_order(dim: int) -> torch.Tensor:
    """``order[r]`` = the channel that receives the direction of importance rank r."""
    if not is_power_of_two(dim):
        raise ValueError(f"bit reversal needs a power-of-two dim, got {dim}")
    nbits = dim.bit_length() - 1
    return torch.tensor([bit_reverse(r, nbits) for r in range(dim)])


def bit_reversal_placement(eigenvalues: torch.Tensor) -> torch.Tensor:
    """Permutation matrix P (columns of U @ P) placing eigen-directions by bit-reversed rank.

    ``(U @ P)[:, bitrev(r)] = U[:, rank_r]`` where rank_r is the r-th largest eigenvalue.

    Shapes:
        eigenvalues: [D], D a power of two.
    Returns:
        P, float64 [D, D].
    """
    dim = eigenvalues.shape[-1]
    ranked = torch.argsort(eigenvalues, descending=True)
    source = torch.empty(dim, dtype=torch.long)
    source[bit_reversal_order(dim)] = ranked
    return torch.eye(dim, dtype=torch.float64)[source].T  # column c of P selects eigvec source[c]


def eigh_descending(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigen-decomposition of a symmetric matrix in float64, eigenvalues descending.

    Shapes:
        cov: [..., D, D] (symmetrized first).
    Returns:
        (eigenvalues float64 [..., D], eigenvectors float64 [..., D, D] as columns, in the same order).
    """
    cov = cov.to(torch.float64)
    with _one_thread():
        lam, vecs = torch.linalg.eigh((cov + cov.transpose(-1, -2)) / 2)
    return lam.flip(-1), vecs.flip(-1)


@contextlib.contextmanager
def _one_thread():
    """torch on one thread within the block.  A head's D x D eigendecomposition is milliseconds of work that
    LAPACK's threads only contend over: on a 16-core host running three calibrations one 128 x 128 eigh took 2.8 s
    with 16 threads and 5 ms with one, most of a calibration's time (benchmarks/NOTES.md, run D11)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


COMPOSITIONS = ("oscar", "u_h", "u", "hadamard", "identity")


def compose(cov: torch.Tensor | None, dim: int, group_size: int, composition: str = "oscar"):
    """Build one D x D rotation and the eigenvalues it was built from.

    Args:
        cov: the weighting covariance; may be None for the data-free compositions.
        dim: D.
        group_size: G, the order of the block Hadamard.
        composition: ``oscar`` = U.P_br.H_G (the method), ``u_h`` = U.H_G (no placement, contiguous groups
            of eigen-directions), ``u`` = U alone, ``hadamard`` = H_G alone (QuaRot-style), ``identity``
            (naive).
    Shapes:
        cov: [D, D].
    Returns:
        (R float64 [D, D], eigenvalues float64 [D] descending; zeros when data-free).
    """
    if composition not in COMPOSITIONS:
        raise ValueError(f"unknown composition {composition!r}; choose from {COMPOSITIONS}")
    if composition == "identity":
        return torch.eye(dim, dtype=torch.float64), torch.zeros(dim, dtype=torch.float64)
    h = block_hadamard(dim, group_size)
    if composition == "hadamard":
        return h, torch.zeros(dim, dtype=torch.float64)
    if cov is None:
        raise ValueError(f"composition {composition!r} needs a covariance")
    lam, u = eigh_descending(cov)
    if composition == "u":
        return u, lam
    if composition == "u_h":
        return u @ h, lam
    return u @ bit_reversal_placement(lam) @ h, lam


def spread_hadamard(dim: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """An orthogonal [dim, dim] mix that gives every output channel about the same share of each input rank: with
    dim = b k (b the largest power of two dividing dim), input j goes to block j mod k, then a Hadamard of order b
    mixes each block (a power-of-two dim: one Hadamard)."""
    block = dim & -dim
    blocks = dim // block
    order = torch.tensor([(j % blocks) * block + j // blocks for j in range(dim)])
    place = torch.zeros(dim, dim, dtype=torch.float64)
    place[torch.arange(dim), order] = 1.0  # row j (input rank j) -> channel order[j]
    return (place @ block_hadamard(dim, block)).to(dtype)


def compose_split(cov: torch.Tensor, dim: int, hi_dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The key rotation of split keys (quant.SplitWidth): U with its ``hi_dims`` leading eigen-directions mixed
    among themselves into the first channels and the rest among themselves into the others (spread_hadamard each),
    so each part is one quantization group whose channels share its energy evenly.

    Returns:
        (R float64 [D, D], eigenvalues float64 [D] descending).
    """
    lam, u = eigh_descending(cov)
    mix = torch.block_diag(spread_hadamard(hi_dims), spread_hadamard(dim - hi_dims))
    return u @ mix, lam


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x @ R per head: the one torch rotation of keys, queries and values (transposed: back).

    Args:
        x: rows of H heads.
        rotation: one matrix per head, or one shared by all.
    Shapes:
        x: [..., H, T, D]; rotation: [H | 1, D, D].
    Returns:
        [..., H, T, D] in the dtype of the operands.
    """
    if rotation.shape[0] == 1:
        rotation = rotation.expand(x.shape[-3], *rotation.shape[1:])
    return torch.einsum("...htd,hde->...hte", x, rotation)


def orthogonality_error(r: torch.Tensor) -> float:
    """max |R R^T - I| over all matrices in a stack [..., D, D]."""
    r = r.to(torch.float64)
    eye = torch.eye(r.shape[-1], dtype=torch.float64)
    return float((r @ r.transpose(-1, -2) - eye).abs().max())


def channel_importance(r: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """diag(R^T C R): the weight each stored channel carries under covariance C."""
    return torch.diagonal(r.T.to(torch.float64) @ cov.to(torch.float64) @ r.to(torch.float64))
