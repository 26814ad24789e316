"""APMSqueeze with shard=True: the independent all-ranks reference step by step, each rank's state a shard of it,
a state round trip in the compression phase (exact and with the quantized parameter gather), the quantized
gather's bytes by hand, and 0/1 Adam's refusal."""

import math

import pytest
import torch

from mpicomm import topology as topo
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator

from .algo_common import make_model, train
from .conftest import run_all
from .test_apmsqueeze_mpi import reference_apmsqueeze

pytestmark = pytest.mark.mpi


def _comm(comm):
    return Communicator(comm, topo.ring(comm.Get_size()))


def _shard(d: int, n: int, rank: int) -> slice:
    """Rank ``rank``'s range of d elements over n ranks: chunks of 8 ceil(d / 8n), the 1-bit servers' chunks."""
    c = 8 * math.ceil(d / (8 * n))
    return slice(min(rank * c, d), min((rank + 1) * c, d))


def test_sharded_apmsqueeze_matches_the_reference_and_holds_a_shard_of_its_state(comm):
    """x on every rank is the reference's; m, vhat's source and the server error are this rank's slice of it."""
    def body():
        n, rank, warmup, steps = comm.Get_size(), comm.Get_rank(), 3, 9
        options = {"lr": 0.01, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.05}
        algo = make_algorithm("apmsqueeze", make_model(seed=rank), _comm(comm), warmup_steps=warmup,
                              denominator_floor=0.0, shard=True, **options)
        expected = reference_apmsqueeze(n, warmup, steps, **options)
        d = algo.flat.numel
        mine = _shard(d, n, rank)
        tol = {"rtol": 1e-5, "atol": 1e-6}
        for t, (x, m, e, e_srv) in enumerate(expected, start=1):
            train(algo, 1)
            torch.testing.assert_close(algo.flat.data, x, **tol, msg=f"x at step {t}")
            torch.testing.assert_close(algo.adam_state()["exp_avg"], m[mine], **tol, msg=f"m at step {t}")
            torch.testing.assert_close(algo.worker_error, e[rank], **tol, msg=f"worker error at step {t}")
            torch.testing.assert_close(algo.server_error, e_srv[rank], **tol, msg=f"server error at step {t}")
        assert algo.adam_state()["exp_avg_sq"].numel() == mine.stop - mine.start

    run_all(comm, body)


def test_sharded_equals_unsharded_bit_for_bit(comm):
    def body():
        options = {"lr": 0.01, "weight_decay": 0.01, "warmup_steps": 4, "denominator_floor": 0.0}
        whole = make_algorithm("apmsqueeze", make_model(seed=comm.Get_rank()), _comm(comm), **options)
        shards = make_algorithm("apmsqueeze", make_model(seed=comm.Get_rank()), _comm(comm), shard=True,
                                shard_order="exact", **options)
        train(whole, 12)
        train(shards, 12)
        assert torch.equal(shards.flat.data, whole.flat.data)

    run_all(comm, body)


@pytest.mark.parametrize("gather_bits", [32, 4])
def test_sharded_state_round_trip_in_the_compression_phase(comm, gather_bits):
    """4 + 4 steps == 8 steps (warm-up 2): m rebuilt from the shards, the gather's residual and generator kept."""
    def body():
        options = {"lr": 0.01, "warmup_steps": 2, "shard": True, "gather_bits": gather_bits}
        straight = make_algorithm("apmsqueeze", make_model(), _comm(comm), **options)
        train(straight, 8)
        first = make_algorithm("apmsqueeze", make_model(), _comm(comm), **options)
        train(first, 4)
        state = first.state_dict()
        if gather_bits != 32:
            assert state["extra"]["shard"]["gather"]["error"].abs().sum() > 0
        resumed = make_algorithm("apmsqueeze", make_model(seed=9), _comm(comm), **options)
        resumed.load_state_dict(state)
        train(resumed, 4)
        assert torch.equal(resumed.flat.data, straight.flat.data)
        assert torch.equal(resumed.worker_error, straight.worker_error)
        assert torch.equal(resumed.server_error, straight.server_error)

    run_all(comm, body)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_parameter_gather_sends_one_payload_per_peer(comm, bits):
    """Bytes of the parameter gather per step: (n - 1) rows of the longest shard's payload, 4 bytes of scale per
    512 elements and ``bits`` per element (QSGD's layout); the ranks' parameters stay identical."""
    def body():
        n = comm.Get_size()
        algo = make_algorithm("allreduce_adam", make_model(seed=comm.Get_rank()), _comm(comm), shard=True,
                              gather_bits=bits)
        c = 8 * math.ceil(algo.flat.numel / (8 * n))
        row = 4 * math.ceil(c / 512) + math.ceil(c * bits / 8)
        before = algo.comm.ledger.bytes_sent("allgather")
        train(algo, 3)
        assert algo.comm.ledger.bytes_sent("allgather") - before == 3 * (n - 1) * row
        sums = comm.allgather(algo.flat.data.double().sum().item())
        assert len(set(sums)) == 1, sums

    run_all(comm, body)


@pytest.mark.parametrize("name, options, message", [
    ("zeroone_adam", {}, "zeroone_adam does not take shard=True: after its variance freezes"),
    ("apmsqueeze", {"warmup_steps": 2, "variant": "deepspeed"}, "apmsqueeze shards the paper variant only"),
    ("apmsqueeze", {"warmup_steps": 2, "shard_bits": 4}, "apmsqueeze with shard=True reduce-scatters its warm-up"),
    ("allreduce_adam", {"gather_bits": 8, "shard": False}, "gather_bits=8 sets the sharded parameter allgather"),
])
def test_bad_sharded_one_bit_options_fail_on_every_rank(comm, name, options, message):
    def body():
        with pytest.raises(ValueError, match=message):
            make_algorithm(name, make_model(), _comm(comm), **{"shard": True, **options})

    run_all(comm, body)


def test_sharded_apmsqueeze_resumes_at_another_size_as_the_unsharded_method(comm, tmp_path_factory):
    """Saved in the compression phase at 2 ranks (1 in the 2-rank job), sharded and unsharded, resumed at this job's
    size: the new ranks' m is their slice of the saved m put end to end (read with h5py), and 3 more steps keep
    the sharded run bit for bit on the unsharded one (both re-cut their 1-bit errors by the same rules)."""
    import mpicomm

    from .h5_state import saved_states
    from .test_sharding_mpi import _in_world, shared_dir

    root, n = shared_dir(comm, tmp_path_factory), comm.Get_size()
    old = 2 if n > 2 else 1
    options = {"lr": 0.01, "warmup_steps": 2, "denominator_floor": 0.0}

    def save(world):
        for tag, shard in (("plain", {}), ("sharded", {"shard": True})):
            algo = make_algorithm("apmsqueeze", make_model(seed=world.Get_rank()), _comm(world), **options, **shard)
            train(algo, 4)
            mpicomm.save(f"{root}/{tag}", algo, step=4)

    _in_world(comm, old, save)

    def body():
        algos = {}
        for tag, shard in (("plain", {}), ("sharded", {"shard": True})):
            algo = make_algorithm("apmsqueeze", make_model(seed=5), _comm(comm), **options, **shard)
            assert mpicomm.restore(f"{root}/{tag}", algo)[0] == 4
            algos[tag] = algo
        saved = torch.cat([s["extra"]["shard"]["flat"]["exp_avg"] for s in saved_states(f"{root}/sharded")])
        mine = _shard(algos["sharded"].flat.numel, n, comm.Get_rank())
        assert torch.equal(algos["sharded"].adam_state()["exp_avg"], saved[mine])
        train(algos["plain"], 3)
        train(algos["sharded"], 3)
        assert torch.equal(algos["sharded"].flat.data, algos["plain"].flat.data)

    run_all(comm, body)
