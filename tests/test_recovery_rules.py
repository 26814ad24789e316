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
