"""The pure parts of continuing after a lost rank, on hand-computed cases: the 1-bit server errors when one old
rank's chunk is gone, and the refusals of a policy the job cannot keep."""

from __future__ import annotations

import pytest
import torch

from mpicomm.checkpoint.resize_rules import Resize, onebit_server_errors
from mpicomm.training.config import TrainConfig
from mpicomm.training.recovery import check_on_rank_loss


def _server_chunk(values, places, new_rank, new_size, d):
    chunk = -(-d // new_size)
    resize = Resize(states=[{} for _ in values], built={"params": torch.zeros(d)}, rank=new_rank, size=new_size,
                    places=places)
    return onebit_server_errors(values, torch.zeros(chunk), resize, "extra.server_error")


def test_server_errors_of_the_survivors_keep_their_places_and_the_lost_chunk_restarts_at_zero():
    # d = 12 over 4 old ranks: chunks of 3 (old rank k served elements 3k .. 3k+2); old rank 2 is gone
    d = 12
    old = {k: torch.arange(3 * k, 3 * k + 3, dtype=torch.float32) + 100 for k in range(4)}
    survivors = [old[0], old[1], old[3]]
    # the 3 survivors serve chunks of 4: [0..3], [4..7], [8..11]; elements 6, 7, 8 were old rank 2's
    expected = [[100, 101, 102, 103], [104, 105, 0, 0], [0, 109, 110, 111]]
    for new_rank in range(3):
        got = _server_chunk(survivors, [0, 1, 3], new_rank, 3, d)
        assert got.tolist() == expected[new_rank], new_rank


def test_server_errors_without_places_are_the_saved_chunks_in_rank_order():
    d = 12
    saved = [torch.arange(3 * k, 3 * k + 3, dtype=torch.float32) for k in range(4)]
    assert _server_chunk(saved, None, 1, 3, d).tolist() == [4, 5, 6, 7]


def test_continue_is_refused_where_mpi_cannot_survive_a_lost_rank():
    # this suite's MPI is MPICH: the refusal names how to get the stack that can
    with pytest.raises(ValueError, match=r"scripts/setup_env.sh --ft.*scripts/ft_run.sh"):
        check_on_rank_loss("continue", 1, 4)
    check_on_rank_loss("stop", 1, 4)
    with pytest.raises(ValueError, match="--min-ranks must be between 1 and the job's 4 ranks, got 5"):
        check_on_rank_loss("stop", 5, 4)
    with pytest.raises(ValueError, match="--on-rank-loss continue cannot be combined with --free-running"):
        TrainConfig(on_rank_loss="continue", free_running=True)


# ------------------------------------------------------------------ sharded Adam after a lost rank
LR, STEP_BEFORE = 0.01, 10_000


def _adam_shard(lo: int, hi: int, pieces: dict[str, tuple[int, int]], step: float) -> dict:
    """A saved rank's sharded state (as Sharding.state_dict writes it) after ``step`` AdamW steps: the moments of
    its shard ``[lo, hi)`` in flat form, and per piece (``pieces``: key -> flat range) its step count."""
    m = torch.ones(hi - lo)  # the moments of a gradient of ones so far: its next step moves each coordinate by lr
    v = m * m
    return {"flat": {"exp_avg": m.clone(), "exp_avg_sq": v.clone()},
            "scalars": {key: {"step": torch.tensor(float(step))} for key, (a, b) in pieces.items()
                        if max(a, lo) < min(b, hi)},
            "groups": [{"lr": LR, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}],
            "bounds": torch.tensor([lo, hi]), "exchange": {}, "gather": {}}


def _recut(saved: list, places: list[int], new_rank: int, new_size: int, d: int, built_scalars=None) -> dict:
    from mpicomm.checkpoint.resize_rules import sharded_optimizer_state

    chunk = -(-d // new_size)
    lo, hi = new_rank * chunk, min(d, (new_rank + 1) * chunk)
    built = {"flat": {}, "scalars": built_scalars or {}, "groups": saved[0]["groups"],
             "bounds": torch.tensor([lo, hi]), "exchange": {}, "gather": {}}
    resize = Resize(states=[{} for _ in saved], built={"params": torch.zeros(d)}, rank=new_rank, size=new_size,
                    places=places)
    return sharded_optimizer_state(saved, built, resize, "extra.shard")


def _one_adamw_step(state: dict, pieces: dict[str, tuple[int, int]]) -> dict[str, tuple[float, torch.Tensor]]:
    """Load ``state`` into torch's AdamW over this rank's pieces as Sharding.load_state_dict does, take one step
    with a gradient of ones; per piece: (its step count before the step, how far each coordinate moved)."""
    lo, hi = (int(b) for b in state["bounds"].tolist())
    mine = {key: (max(a, lo), min(b, hi)) for key, (a, b) in pieces.items() if max(a, lo) < min(b, hi)}
    params = {key: torch.nn.Parameter(torch.zeros(b - a)) for key, (a, b) in mine.items()}
    opt = torch.optim.AdamW(list(params.values()), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    loaded = {}
    for i, (key, (a, b)) in enumerate(mine.items()):
        kept = state["scalars"].get(key)
        if kept is None:
            continue  # no state: the optimizer starts this piece afresh
        loaded[i] = {**{k: v.clone() for k, v in kept.items()},
                     **{k: vec[a - lo:b - lo].clone() for k, vec in state["flat"].items()}}
    opt.load_state_dict({"state": loaded, "param_groups": [{**state["groups"][0], "params": list(range(len(mine)))}]})
    before = {key: float(opt.state[p]["step"]) if p in opt.state else 0.0 for key, p in params.items()}
    for p in params.values():
        p.grad = torch.ones_like(p)
    opt.step()
    return {key: (before[key], p.detach().abs()) for key, p in params.items()}


def test_sharded_adam_restarts_a_lost_shard_at_step_0_and_the_survivors_keep_their_count():
    # d = 12 over 4 old ranks (shards of 3), the built-in optimizer: one piece, "flat", per shard; old rank 2 lost.
    # The 3 survivors' new shards: [0, 4) (old ranks 0 and 1: survivors only), [4, 8) and [8, 12) (old rank 2's
    # [6, 9) inside)
    d, whole = 12, {"flat": (0, 12)}
    saved = [_adam_shard(3 * k, 3 * k + 3, whole, STEP_BEFORE) for k in (0, 1, 3)]
    kept = _recut(saved, [0, 1, 3], 0, 3, d)
    assert float(kept["scalars"]["flat"]["step"]) == STEP_BEFORE  # the survivors' shard keeps its count
    assert torch.equal(kept["flat"]["exp_avg"][:3], saved[0]["flat"]["exp_avg"])  # and its moments
    (count, moved), = _one_adamw_step(kept, whole).values()
    assert count == STEP_BEFORE and torch.allclose(moved, torch.full_like(moved, LR), rtol=1e-3), moved
    for new_rank in (1, 2):
        restarted = _recut(saved, [0, 1, 3], new_rank, 3, d)
        assert "flat" not in restarted["scalars"]  # no step count of another shard's
        (count, moved), = _one_adamw_step(restarted, whole).values()
        # a fresh Adam's first step: every coordinate moves by the learning rate, never ~3x it (as with the
        # survivors' step count and zero moments)
        assert count == 0 and torch.allclose(moved, torch.full_like(moved, LR), rtol=1e-3), (new_rank, moved)


def test_sharded_user_adam_restarts_only_the_parameter_that_reaches_into_the_lost_shard():
    # a user's optimizer: one piece per parameter; parameter 0 holds [0, 5), parameter 1 [5, 12). Old rank 2
    # ([6, 9), all parameter 1's) is lost; parameter 0 lies on survivors only and keeps its count everywhere
    d, pieces = 12, {"0": (0, 5), "1": (5, 12)}
    saved = [_adam_shard(3 * k, 3 * k + 3, pieces, STEP_BEFORE) for k in (0, 1, 3)]
    steps = {}
    for new_rank in range(3):
        state = _recut(saved, [0, 1, 3], new_rank, 3, d)
        for key, (count, moved) in _one_adamw_step(state, pieces).items():
            steps[(new_rank, key)] = count
            if count == 0:
                assert torch.allclose(moved, torch.full_like(moved, LR), rtol=1e-3), (new_rank, key, moved)
    assert steps == {(0, "0"): STEP_BEFORE, (1, "0"): STEP_BEFORE, (1, "1"): 0.0, (2, "1"): 0.0}, steps


def test_a_resize_without_a_lost_rank_keeps_every_step_count():
    d, whole = 12, {"flat": (0, 12)}
    saved = [_adam_shard(3 * k, 3 * k + 3, whole, STEP_BEFORE) for k in range(4)]
    for new_rank in range(3):
        state = _recut(saved, None, new_rank, 3, d)
        assert float(state["scalars"]["flat"]["step"]) == STEP_BEFORE


def test_an_optimizer_built_with_state_gets_its_restarted_piece_as_built():
    # Adagrad makes its state (step 0) when built: the restarted piece gets those scalars, not none
    d, whole = 12, {"flat": (0, 12)}
    saved = [_adam_shard(3 * k, 3 * k + 3, whole, STEP_BEFORE) for k in (0, 1, 3)]
    built = {"flat": {"step": torch.tensor(0.0)}}
    assert float(_recut(saved, [0, 1, 3], 1, 3, d, built)["scalars"]["flat"]["step"]) == 0.0
    assert float(_recut(saved, [0, 1, 3], 0, 3, d, built)["scalars"]["flat"]["step"]) == STEP_BEFORE
