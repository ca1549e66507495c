"""OrthoAdam: AdamW when Q = I, Adam when Q is a signed permutation (the pitfall), different when Q mixes."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

from models.errors import UserError
from trainers.optim import ROTATIONS, OrthoAdam, optimizer_extra_memory_bytes, param_rotation
from trainers.optim.rotations import WindowedRotation

CPU = torch.device("cpu")


class Tiny(nn.Module):
    """Embedding (vocab 131: odd part > 128, so the windowed Hadamard), two linears, a scalar gain (0-D)."""

    def __init__(self, vocab: int = 131, d: int = 12) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc1 = nn.Linear(d, 24)
        self.fc2 = nn.Linear(24, vocab)
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(self.emb(idx)))) * self.gain


def batches(n: int, vocab: int = 131, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(vocab, (4, 8), generator=gen), torch.randint(vocab, (4, 8), generator=gen))
        for _ in range(n)
    ]


def train(model: nn.Module, opt: torch.optim.Optimizer, data, scheduler=None) -> nn.Module:
    for idx, tgt in data:
        opt.zero_grad()
        nn.functional.cross_entropy(model(idx).flatten(0, 1), tgt.flatten()).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return model


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def run_pair(rotation: str, steps: int, lr: float = 1e-2) -> tuple[nn.Module, nn.Module]:
    """The same model and data trained by torch's AdamW and by OrthoAdam(rotation)."""
    torch.manual_seed(0)
    ref = Tiny()
    model = copy.deepcopy(ref)
    data = batches(steps)
    train(ref, torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.1), data)
    train(model, OrthoAdam(model.parameters(), lr=lr, weight_decay=0.1, rotation=rotation), data)
    return ref, model


def test_identity_reproduces_adamw_bit_for_bit():
    ref, model = run_pair("identity", steps=50)
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_signed_permutation_is_just_adam_but_mixing_rotations_are_not():
    ref, perm = run_pair("signed-permutation", steps=20)
    assert max_diff(ref, perm) < 1e-6  # Adam is equivariant to ±1 and shuffles: the pitfall
    for rotation in ("hadamard", "dense"):
        ref, rotated = run_pair(rotation, steps=20)
        assert max_diff(ref, rotated) > 1e-3, rotation


@pytest.mark.parametrize("rotation", ["hadamard", "dense"])
def test_it_trains(rotation):
    torch.manual_seed(0)
    model = Tiny()
    data = batches(1) * 40  # memorise one batch
    opt = OrthoAdam(model.parameters(), lr=1e-2, rotation=rotation)
    idx, tgt = data[0]
    first = nn.functional.cross_entropy(model(idx).flatten(0, 1), tgt.flatten()).item()
    train(model, opt, data)
    last = nn.functional.cross_entropy(model(idx).flatten(0, 1), tgt.flatten()).item()
    assert last < 0.5 * first


def test_first_step_matches_the_definition_with_explicit_matrices():
    """Step 1 from zero moments: θ ← θ(1 − lr·wd) − lr·Qᵀ(g'/(|g'| + ε)), g' = (Q_out ⊗ Q_in) vec(g)."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(6, 10, dtype=torch.float64))
    w.grad = torch.randn(6, 10, dtype=torch.float64)
    start, g = w.detach().clone(), w.grad.clone()
    OrthoAdam([w], lr=0.1, weight_decay=0.5, eps=1e-8, seed=3).step()
    rot = param_rotation((6, 10), "hadamard", seed=3, index=0).to(CPU, torch.float64)
    q = torch.kron(rot.axes[0].matrix(), rot.axes[1].matrix())
    g_rot = q @ g.flatten()
    expected = start.flatten() * (1 - 0.1 * 0.5) - 0.1 * q.T @ (g_rot / (g_rot.abs() + 1e-8))
    torch.testing.assert_close(w.detach().flatten(), expected, atol=1e-12, rtol=0)


SIZES = (2, 3, 12, 64, 96, 100, 384, 1000, 1001, 2049)


@pytest.mark.parametrize("kind", ["hadamard", "dense", "identity", "signed-permutation"])
def test_every_axis_transform_is_orthogonal(kind):
    for n in SIZES:
        gen = torch.Generator().manual_seed(n)
        rot = ROTATIONS.get(kind)(n, gen, 256).to(CPU, torch.float32)  # 256: dense goes block-diagonal
        q = rot.matrix()
        eye = torch.eye(n)
        assert (q.T @ q - eye).abs().max() < 1e-5, (kind, n)
        q_t = rot.apply(eye.view(1, n, n), transpose=True).view(n, n)
        assert (q_t - q.T).abs().max() < 1e-5, (kind, n)


def test_hadamard_mixes_densely_for_every_length():
    """Every entry non-zero and none much larger than a Haar matrix's (coherence √n·max|Q_ij| < 6)."""
    for n in SIZES:
        rot = ROTATIONS.get("hadamard")(n, torch.Generator().manual_seed(0), 1024).to(CPU, torch.float64)
        q = rot.matrix()
        assert (q.abs() > 1e-9).all(), n
        assert math.sqrt(n) * q.abs().max() < 6, n
    assert isinstance(ROTATIONS.get("hadamard")(1001, torch.Generator(), 1024), WindowedRotation)
    perm = ROTATIONS.get("signed-permutation")(100, torch.Generator(), 1024).to(CPU, torch.float64).matrix()
    assert (perm != 0).sum() == 100


@pytest.mark.parametrize("n", [2, 16, 64, 128, 1024, 4096])
def test_hadamard_of_a_power_of_two_is_exactly_sylvester_times_signs(n):
    """For n = 2^k the rotation is H_n·diag(s): Sylvester–Hadamard (normalised) with seeded ±1 column signs,
    whatever Kronecker factorisation the fast path uses (H_a ⊗ H_b = H_ab for Sylvester matrices)."""
    rot = ROTATIONS.get("hadamard")(n, torch.Generator().manual_seed(0), 1024).to(CPU, torch.float64)
    s = rot.signs
    assert set(s.tolist()) <= {-1.0, 1.0}
    h = torch.ones(1, 1, dtype=torch.float64)  # Sylvester's construction, written out again here
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    torch.testing.assert_close(rot.matrix(), h / math.sqrt(n) * s, rtol=0, atol=1e-15)


def test_dense_long_axis_is_block_diagonal():
    q = ROTATIONS.get("dense")(100, torch.Generator().manual_seed(0), 32).to(CPU, torch.float64).matrix()
    assert (q[:32, 32:] == 0).all() and (q[96:, :96] == 0).all()
    assert (q[:32, :32] != 0).all()


@pytest.mark.parametrize("shape", [(5,), (3, 4, 6), (7, 1, 5), (131, 12)])
@pytest.mark.parametrize("kind", ["hadamard", "dense"])
def test_param_rotation_is_an_isometry_and_inverts(shape, kind):
    rot = param_rotation(shape, kind, seed=1, index=2, block_size=64).to(CPU, torch.float64)
    x = torch.randn(shape, dtype=torch.float64)
    y = rot.forward(x)
    assert y.shape == x.shape and not torch.equal(x, y)
    torch.testing.assert_close(y.norm(), x.norm())
    torch.testing.assert_close(rot.inverse(y), x)


def test_rotations_are_deterministic_and_differ_by_seed_and_index():
    def mat(seed, index):
        return param_rotation((12,), "hadamard", seed, index).axes[0].matrix()

    assert torch.equal(mat(0, 1), mat(0, 1))
    assert not torch.equal(mat(0, 1), mat(1, 1))
    assert not torch.equal(mat(0, 1), mat(0, 2))
    assert param_rotation((), "hadamard") is None and param_rotation((1, 1), "dense") is None
    assert param_rotation((4, 4), "identity") is None


@pytest.mark.parametrize("rotation", ["hadamard", "dense"])
def test_state_dict_round_trip_resumes_identically(rotation):
    torch.manual_seed(0)
    first = Tiny()
    data = batches(12)
    straight = copy.deepcopy(first)
    train(straight, OrthoAdam(straight.parameters(), lr=1e-2, rotation=rotation, seed=5), data)

    opt = OrthoAdam(first.parameters(), lr=1e-2, rotation=rotation, seed=5)
    train(first, opt, data[:6])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = Tiny()
    resumed.load_state_dict(saved["model"])
    opt2 = OrthoAdam(
        resumed.parameters(), lr=0.5, rotation="identity", seed=0
    )  # replaced by the saved groups
    opt2.load_state_dict(saved["opt"])
    train(resumed, opt2, data[6:])
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_loading_state_onto_reordered_parameters_is_refused():
    model = Tiny()
    opt = OrthoAdam(model.parameters())
    train(model, opt, batches(1))
    params = list(model.parameters())
    other = OrthoAdam([params[1], params[0], *params[2:]])
    with pytest.raises(UserError, match="same order"):
        other.load_state_dict(opt.state_dict())


def test_weight_decay_is_decoupled():
    w = nn.Parameter(torch.randn(8, 16))
    start = w.detach().clone()
    opt = OrthoAdam([w], lr=0.1, weight_decay=0.3)
    w.grad = torch.zeros_like(w)  # zero gradient: zero Adam update, only the decay remains
    opt.step()
    torch.testing.assert_close(w.detach(), start * (1 - 0.1 * 0.3), rtol=0, atol=0)
    # decay never enters the moments: with a gradient, the moments are those of a wd = 0 run
    a, b = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    opt_a, opt_b = OrthoAdam([a], lr=0.1, weight_decay=0.0), OrthoAdam([b], lr=0.1, weight_decay=0.3)
    grad = torch.randn(8, 16)
    a.grad, b.grad = grad.clone(), grad.clone()
    opt_a.step(), opt_b.step()
    assert torch.equal(opt_a.state[a]["exp_avg_sq"], opt_b.state[b]["exp_avg_sq"])
    torch.testing.assert_close(b.detach(), a.detach() - 0.1 * 0.3 * start, atol=1e-6, rtol=0)


def test_works_with_a_lambda_lr_scheduler():
    torch.manual_seed(0)
    model = Tiny()
    opt = OrthoAdam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(step / 2, 1.0))  # lr 0 on the first step
    before = copy.deepcopy(model)
    train(model, opt, batches(1), sched)
    assert max_diff(before, model) == 0.0  # lr 0: no update and no decay
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-3)
    train(model, opt, batches(2, seed=2), sched)
    assert max_diff(before, model) > 0.0
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2)


def test_memory_report():
    layer = nn.Linear(512, 256, bias=True)
    opt = OrthoAdam(layer.parameters())
    report = optimizer_extra_memory_bytes(opt)
    param_bytes = 4 * (512 * 256 + 256)
    assert report["adamw_moment_bytes"] == 2 * param_bytes
    assert report["moment_bytes"] == 2 * param_bytes
    # signs (256 + 512 + 256 floats) and Hadamard factors 16², 16² (256) and 16², 32² (512), bias 16², 16²
    expected = 4 * (256 + 512 + 256 + 2 * (16**2 + 16**2) + 16**2 + 32**2)
    assert report["transform_bytes"] == expected
    assert report["extra_bytes"] == expected
    assert report["step_workspace_bytes"] == 2 * 4 * 512 * 256
    dense = optimizer_extra_memory_bytes(OrthoAdam(layer.parameters(), rotation="dense"))
    assert dense["transform_bytes"] == 4 * (256**2 + 512**2 + 256**2)
    plain = optimizer_extra_memory_bytes(torch.optim.AdamW(layer.parameters()))
    assert plain["transform_bytes"] == 0 and plain["extra_bytes"] == 0
    layer(torch.randn(3, 512)).sum().backward()
    opt.step()
    assert optimizer_extra_memory_bytes(opt) == report  # the step allocated exactly what was reported
    sgd = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    sgd.step()
    assert optimizer_extra_memory_bytes(sgd)["moment_bytes"] == param_bytes  # one momentum buffer


def test_bf16_parameters_keep_their_dtype():
    w = nn.Parameter(torch.randn(16, 24, dtype=torch.bfloat16))
    w.grad = torch.randn_like(w)
    opt = OrthoAdam([w], lr=1e-2)
    opt.step()
    assert w.dtype == torch.bfloat16 and opt.state[w]["exp_avg"].dtype == torch.bfloat16
    assert torch.isfinite(w.float()).all()


def test_bad_arguments_are_user_errors():
    with pytest.raises(UserError, match="did you mean 'hadamard'"):
        OrthoAdam([nn.Parameter(torch.ones(2))], rotation="hadamart")
    with pytest.raises(UserError, match="betas"):
        OrthoAdam([nn.Parameter(torch.ones(2))], betas=(0.9, 1.0))
    with pytest.raises(UserError, match="block_size"):
        OrthoAdam([nn.Parameter(torch.ones(2))], block_size=0)


def test_param_groups_may_choose_their_own_rotation():
    model = Tiny()
    params = list(model.parameters())
    opt = OrthoAdam([{"params": params[:2], "rotation": "none"}, {"params": params[2:]}], lr=1e-2)
    train(model, opt, batches(2))
    first, second = opt.param_groups
    assert first["rotation"] == "identity" and second["rotation"] == "hadamard"
    assert all(opt.rotation_for(p, first) is None for p in params[:2])
    assert all(opt.rotation_for(p, second) is not None for p in params[2:] if p.numel() > 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    cpu = Tiny()
    gpu = copy.deepcopy(cpu).cuda()
    data = batches(10)
    train(cpu, OrthoAdam(cpu.parameters(), lr=1e-2), data)
    train(gpu, OrthoAdam(gpu.parameters(), lr=1e-2), [(x.cuda(), y.cuda()) for x, y in data])
    assert max_diff(cpu, gpu.cpu()) < 1e-4
