"""The 1-bit family's denominator floor: embedding rows that no batch used while the variance was measured.

Hand-built cases. The model is one embedding of 24 rows of 4 (d = 96, a multiple of 8 n for n = 1 .. 4, so no
padding); the loss is sum_r a_r <E[r], w> with w = (1, -1, 1, -1), so row r's gradient is a_r w, the same on
every rank. The even rows are used from step 1, the odd rows only from the step named in each test. The weights
a_r of the first step that uses the odd rows are chosen so that every coordinate of the vector the 1-bit average
compresses has magnitude exactly 1: then every compression is exact (the scale is 1, the errors are 0) and each
step's update is known in closed form. The variance of a row unused so far is 0. Where v is frozen (APMSqueeze,
1-bit LAMB), a row first used after the freeze takes the mean of its tensor's rows used before, so it steps like
them; where it is not yet (0/1 Adam's 1-bit steps before the next variance step), its denominator is raised to
the floor F = denominator_floor * mean over the model of sqrt(v) (default 0.01; the used half has sqrt(v) = s,
the other half 0, so F = 0.01 * s / 2). Without either such a row moves by lr / eps, 1e8 times lr.
"""

import math

import pytest
import torch

from mpicomm import topology as topo
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator

from .algo_common import make_model
from .conftest import run_all

pytestmark = pytest.mark.mpi

ROWS, WIDTH = 24, 4
B1, B2, EPS, LR, FLOOR = 0.9, 0.999, 1e-8, 0.01, 0.01
W = torch.tensor([1.0, -1.0, 1.0, -1.0])
USED = torch.arange(ROWS) % 2 == 0            # the even rows: used from step 1


def _comm(comm):
    return Communicator(comm, topo.ring(comm.Get_size()))


def _embedding():
    torch.manual_seed(0)
    return torch.nn.Embedding(ROWS, WIDTH)


def _weights_at(t: int, switch: int, c: float):
    """Step t's gradient weights when the 1-bit phase starts after step ``switch`` (m of a used row is ``c`` along
    w then): used rows only before it; at its first step b1 m + (1 - b1) a = 1 on both halves, so the 1-bit
    exchange is exact; every row afterwards."""
    if t <= switch:
        return _weights(1, 0)
    if t == switch + 1:
        return _weights((1 - B1 * c) / (1 - B1), 1 / (1 - B1))
    return _weights(1, 1)


def _step(algo, model, weights):
    """One step of the loss sum_r weights[r] <E[r], w> (rows of weight 0 are not looked up: no gradient)."""
    rows = torch.nonzero(weights).flatten()
    algo.zero_grad()
    (model(rows) @ W * weights[rows]).sum().backward()
    algo.step()


def _moved(algo, model, weights):
    """Take one :func:`_step` and return the (used rows', unused rows') displacement it made (:func:`_moves`)."""
    before = model.weight.detach().clone()
    _step(algo, model, weights)
    return _moves(before, model.weight.detach())


def _weights(used, unused):
    return torch.where(USED, torch.tensor(float(used)), torch.tensor(float(unused)))


def _moves(before, after):
    """(used rows', unused rows') displacement along w: (after - before) * w, one value per row class.

    Checks that every coordinate of a class moved by the same amount along w (the case is built so)."""
    along = ((after - before).view(ROWS, WIDTH) * W)
    used, unused = along[USED], along[~USED]
    for part in (used, unused):
        assert torch.allclose(part, part[0, 0].expand_as(part), rtol=1e-5, atol=1e-12), part
    return float(used[0, 0]), float(unused[0, 0])


def _close(got, want, what):
    assert math.isclose(got, want, rel_tol=2e-4), f"{what}: moved {got!r} along w, expected {want!r}"


@pytest.mark.parametrize("variant", ["paper", "deepspeed"])
@pytest.mark.parametrize("floor", [None, 0.0])
def test_apmsqueeze_rows_first_used_after_the_warmup_step_like_the_rows_used_in_it(comm, variant, floor):
    """Warm-up of 3 steps on the even rows, then 3 compression steps on all rows. Paper variant: Adam's
    bias-corrected m / sqrt(v) is exactly w on the used rows (each warm-up step moves them by -lr w) and the
    frozen denominator is s = 1; deepspeed: no bias correction, warm-up step t moves them by
    -lr (1 - b1^t) / sqrt(1 - b2^t) w and s = sqrt(1 - b2^3). Compression step t: m = w exactly, so a used row
    moves by -lr / c1(t) / (s + eps) w (c1 = 1 - b1^t, or 1 for deepspeed), and so does a row first used then,
    whose vhat is the mean of the used rows' (with the floor F = 0.01 s / 2 it moved by lr / (F + eps), 200 times
    as far; ``floor=0.0``, the published method, by lr / eps)."""
    warmup = 3

    def body():
        model = _embedding()
        options = {} if floor is None else {"denominator_floor": floor}
        algo = make_algorithm("apmsqueeze", model, _comm(comm), lr=LR, beta1=B1, beta2=B2, eps=EPS,
                              warmup_steps=warmup, variant=variant, **options)
        paper = variant == "paper"
        c1 = (lambda t: 1 - B1**t) if paper else (lambda t: 1.0)
        s = 1.0 if paper else math.sqrt(1 - B2**warmup)
        c = 1 - B1**warmup                    # m of a used row after the warm-up, along w
        for t in range(1, warmup + 4):
            used, unused = _moved(algo, model, _weights_at(t, warmup, c))
            if t <= warmup:
                want = -LR if paper else -LR * (1 - B1**t) / math.sqrt(1 - B2**t)
                _close(used, want, f"step {t}, a used row")
                assert unused == 0.0
            else:
                _close(used, -LR / c1(t) / (s + EPS), f"step {t}, a used row")
                _close(unused, -LR / c1(t) / (s + EPS), f"step {t}, a row first used after the warm-up")

    run_all(comm, body)


def test_zeroone_adam_rows_first_used_on_a_compressed_step_move_by_lr_over_the_floor(comm):
    """var_update_scaler = 1: steps 1, 2 and 4 update v (exact mean), step 3 is a 1-bit step. The even rows are
    used from step 1, the odd rows from step 3, where v = 0 for them. No bias correction:
    m_1 = 0.1, m_2 = 0.19 and v_2 = 1 - b2^2 on the used rows; at step 3 every gradient is w, so the 1-bit
    average is exact, m = 0.271 on the used rows and 0.1 on the others, whose denominator is the floor
    F = 0.01 sqrt(1 - b2^2) / 2. Step 4 (exact) gives the odd rows v = 1 - b2, above the floor."""

    def body():
        model = _embedding()
        algo = make_algorithm("zeroone_adam", model, _comm(comm), lr=LR, beta1=B1, beta2=B2, eps=EPS,
                              var_freeze_step=10, var_update_scaler=1)
        m_used, m_unused, v_used, v_unused = 0.0, 0.0, 0.0, 0.0
        for t in range(1, 5):
            used, unused = _moved(algo, model, _weights(1, 0) if t < 3 else _weights(1, 1))
            assert algo.last_kind == ("compressed" if t == 3 else "variance")
            m_used = B1 * m_used + (1 - B1)
            if t >= 3:
                m_unused = B1 * m_unused + (1 - B1)
            if t != 3:
                v_used = B2 * v_used + (1 - B2)
                v_unused = B2 * v_unused + (1 - B2) * (t >= 3)
            big_f = FLOOR * (math.sqrt(v_used) + math.sqrt(v_unused)) / 2
            _close(used, -LR * m_used / (max(math.sqrt(v_used), big_f) + EPS), f"step {t}, a used row")
            want = -LR * m_unused / (max(math.sqrt(v_unused), big_f) + EPS)
            if t < 3:
                assert unused == 0.0
            else:
                _close(unused, want, f"step {t}, a row first used at step 3")

    run_all(comm, body)


def test_onebit_lamb_rows_first_used_after_the_warmup_step_like_the_rows_used_in_it(comm):
    """LAMB warm-up of 3 steps on the even rows (v = 1 - b2^3 there, 0 on the odd rows), then 3 compression
    steps on all rows with m = w exactly (as above). The one layer's step is -lr * coeff * m / denom, the same
    coeff = rbar f for every coordinate: a row unused in the warm-up gets the used rows' mean v (and fresh v)
    when first used, so it moves exactly as far as a used row (with the floor alone, (s + eps) / (F + eps) = 200
    times as far, s = sqrt(1 - b2^3), F = 0.01 s / 2); and, as rbar <= max_coeff = 10 and f <= factor_max = 4,
    by at most 40 lr / (s + eps)."""
    freeze = 3

    def body():
        model = _embedding()
        algo = make_algorithm("onebit_lamb", model, _comm(comm), lr=LR, beta1=B1, beta2=B2, eps=EPS,
                              freeze_step=freeze)
        s = math.sqrt(1 - B2**freeze)
        c = 1 - B1**freeze
        for t in range(1, freeze + 4):
            used, unused = _moved(algo, model, _weights_at(t, freeze, c))
            if t <= freeze:
                assert unused == 0.0 and used < 0
                continue
            _close(unused / used, 1.0, f"step {t}: unused rows' move / used rows' move")
            assert -40 * LR / (s + EPS) <= unused < 0, f"step {t}: a row first used after the warm-up moved " \
                                                       f"{unused} along w"

    run_all(comm, body)


@pytest.mark.parametrize("name, option", [("apmsqueeze", {"warmup_steps": 2}), ("zeroone_adam", {}),
                                          ("onebit_lamb", {})])
@pytest.mark.parametrize("floor", [-0.01, 1.5, float("nan")])
def test_a_floor_outside_zero_to_one_is_refused_on_every_rank(comm, name, option, floor):
    def body():
        with pytest.raises(ValueError, match=r"denominator_floor must be in \[0.0, 1.0\]"):
            make_algorithm(name, make_model(), _comm(comm), denominator_floor=floor, **option)

    run_all(comm, body)
