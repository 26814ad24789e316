"""The planner's overlap figures against timelines worked out by hand.

Every case uses round numbers so the timeline can be checked on paper; nothing here re-derives the planner's
formulas. U is 2**18 elements, 1 MiB of fp32: the least size of the first gradient bucket (DDP's rule, the
``OverlapConfig`` default), and 25 U the least size of the others. Buckets are cut from the last layer down,
so backward (2/3 of the compute, making gradients at a constant rate per element, last layer first) makes
them ready in that order. The link prices an allreduce of m > 2 KiB bytes over n ranks as Rabenseifner's,
``2 ceil(log2 n) alpha + 2 (n - 1) / n * m / beta`` (mpicomm/net/model.py): at 2 ranks ``2 alpha + m / beta``.

Times in the docstrings are seconds from the start of backward, unless said otherwise.
"""

import pytest

from mpicomm.plan import Job
from mpicomm.plan.candidates import candidate
from mpicomm.plan.model import predict
from mpicomm.plan.shapes import layers_from_params, layers_of

U = 2**18
MIB_PER_S = "8388608bit"  # 2**20 bytes per second: an fp32 allreduce of k U at 2 ranks takes k seconds

# flat order [A, B, C] = [24 U, 26 U, 2 U]; launch order [C] (2 U >= 1 U), [B] (26 U >= 25 U), [A] (the rest)
THREE = layers_of([(24 * U,), (26 * U,), (2 * U,)])


def _predict(layers, ranks, net, compute, key="allreduce_sgd"):
    return predict(Job(layers, ranks, net, compute, 1, 32, {}), candidate(key), {})


def _close(value):
    return pytest.approx(value, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("ranks, net", [(2, f"{MIB_PER_S},0s"), (4, "12582912bit,0s")])
def test_buckets_queue_behind_each_other_and_the_last_runs_past_backward(ranks, net):
    """1 s per U on the link (2 ranks at 1 MiB/s; 4 ranks at 1.5 MiB/s, whose ring sends 1.5 m), compute 78 s:
    backward takes 52 s, 1 s per U. C is ready at 2 and sent 2-4; B is ready at 28 and sent 28-54; A is
    ready at 52 but waits for the link until 54 and is sent 54-78. Exposed: 78 - 52 = 26 s; without overlap
    the whole 52 s; the step takes the smaller: 78 + 26 = 104 s."""
    p = _predict(THREE, ranks, net, 78.0)
    assert p.comm_s == _close(52.0)
    assert p.exposed_overlap_s == _close(26.0)
    assert p.step_s == _close(104.0) and p.overlap_helps


def test_a_link_slower_than_backward_backs_the_buckets_up():
    """2 s per U (512 KiB/s at 2 ranks), compute 78 s (backward 52 s): C ready at 2, sent 2-6; B ready at 28,
    sent 28-80; A ready at 52, waits until 80, sent 80-128. Exposed 128 - 52 = 76 s of the 104 s; step 154 s."""
    p = _predict(THREE, 2, "4194304bit,0s", 78.0)
    assert p.comm_s == _close(104.0)
    assert p.exposed_overlap_s == _close(76.0)
    assert p.step_s == _close(154.0)


def test_a_long_backward_leaves_only_the_last_bucket_exposed():
    """1 s per U, compute 780 s: backward takes 520 s, 10 s per U. C ready at 20, sent 20-22; B ready at 280,
    sent 280-306; A ready at 520 (the end of backward), sent 520-544. Exposed: A's own 24 s; step 804 s."""
    p = _predict(THREE, 2, f"{MIB_PER_S},0s", 780.0)
    assert p.comm_s == _close(52.0)
    assert p.exposed_overlap_s == _close(24.0)
    assert p.step_s == _close(804.0)


def test_every_bucket_pays_its_own_latency():
    """1 s per U and 0.5 s latency (2 alpha = 1 s per allreduce at 2 ranks), compute 78 s (backward 52 s):
    C ready at 2, sent 2-5 (1 + 2); B ready at 28, sent 28-55 (1 + 26); A ready at 52, waits until 55, sent
    55-80 (1 + 24). Exposed 80 - 52 = 28 s. Without overlap one allreduce: 1 + 52 = 53 s. Step 106 s."""
    p = _predict(THREE, 2, f"{MIB_PER_S},0.5s", 78.0)
    assert p.comm_s == _close(53.0)
    assert p.exposed_overlap_s == _close(28.0)
    assert p.step_s == _close(106.0)


def test_overlap_is_left_off_where_the_bucket_latencies_cost_more_than_it_hides():
    """Two layers of 1 U (two buckets of 1 U), 1 s per U and 10 s latency (20 s per allreduce at 2 ranks),
    compute 3 s (backward 2 s): the last layer's bucket is ready at 1, sent 1-22; the first's ready at 2,
    waits until 22, sent 22-43. Exposed with overlap 43 - 2 = 41 s; without, one allreduce of 2 U: 20 + 2
    = 22 s. The step takes the 22 s: 3 + 22 = 25 s, and overlap does not help."""
    p = _predict(layers_of([(U,), (U,)]), 2, f"{MIB_PER_S},10s", 3.0)
    assert p.comm_s == _close(22.0)
    assert p.exposed_overlap_s == _close(41.0)
    assert p.step_s == _close(25.0) and not p.overlap_helps


def test_a_model_within_the_first_bucket_hides_nothing():
    """200,000 fp32 parameters (800,000 bytes, under the 1 MiB first bucket) at 4 ranks on ``slow`` (100 Mbit/s
    = 12.5 MB/s, 1 ms): one allreduce, 2 x log2 4 = 4 x 1 ms + 1.5 x 800,000 / 12.5e6 s = 4 + 96 = 100 ms, whose
    single bucket is ready only when backward ends, so all 100 ms are exposed however long the compute (10 s)."""
    p = _predict(layers_from_params(200_000), 4, "slow", 10.0)
    assert p.comm_s == _close(0.100)
    assert p.exposed_overlap_s == _close(0.100)
    assert p.step_s == _close(10.100)


def test_compressed_buckets_carry_their_share_of_the_payload():
    """qsgd 4-bit (bucket 512) on the three layers: per U, 2**18 / 2 = 131,072 bytes of codes + 512 scales x 4
    = 2,048 bytes, 133,120 bytes; at 2 ranks an allgather of P bytes takes P / beta, so at 133,120 bytes/s
    (1,064,960 bit/s) a bucket of k U takes k seconds: the timeline of the fp32 case above, exposed 26 s of
    52 s with compute 78 s."""
    p = _predict(THREE, 2, "1064960bit,0s", 78.0, "qsgd4")
    assert p.comm_s == _close(52.0)
    assert p.exposed_overlap_s == _close(26.0)
    assert p.step_s == _close(104.0)


def test_a_method_without_overlap_exposes_all_of_its_exchange():
    """TernGrad cannot overlap: the three layers (52 U) at 2 bits are 13 U bytes (3.25 MiB) + a 4-byte scale, one
    allgather at 2 ranks and 1 MiB/s: 3.25 s + 4 / 2**20 s, all exposed even behind a 52 s backward."""
    p = _predict(THREE, 2, f"{MIB_PER_S},0s", 78.0, "terngrad")
    assert p.comm_s == _close(3.25 + 4 / 2**20)
    assert p.exposed_overlap_s == _close(3.25 + 4 / 2**20)
    assert p.step_s == _close(78 + 3.25 + 4 / 2**20)


@pytest.mark.parametrize("compute, exposed", [(0.5, 1.5), (2.4, 0.0), (5.0, 0.0)])
def test_gossip_hides_behind_the_whole_step(compute, exposed):
    """D-PSGD at 4 ranks on the ring (2 out-neighbours), one layer of 1 U: 1 MiB of fp32 to each neighbour,
    2 MiB on one 1 MiB/s link: 2 s, started before forward and waited for after backward. Compute 0.5 s
    leaves 1.5 s exposed; 2.4 s hides it all (behind backward alone, 1.6 s, 0.4 s would remain); 5 s too."""
    p = _predict(layers_of([(U,)]), 4, f"{MIB_PER_S},0s", compute, "dpsgd")
    assert p.comm_s == _close(2.0)
    assert p.exposed_overlap_s == _close(exposed)
    assert p.step_s == _close(compute + exposed)
