"""Resize rules on saved states read lazily from HDF5 (serial, no MPI): the values against hand-computed ones,
slice by slice, and the refusals of what no rule declares.

A checkpoint of another world size is read with every large tensor left in its file (``LazyTensor``); the rules
fold the saved ranks' entries a slice at a time. Here the slice is shrunk to a few elements so that every fold
crosses slice boundaries, and each result is compared with numbers worked out by hand.
"""

import h5py
import numpy as np
import pytest
import torch

from mpicomm.checkpoint import CheckpointError, read_tree, write_tree
from mpicomm.checkpoint import resize_rules as resize
from mpicomm.checkpoint.tree import LIBVER, LazyTensor


def saved(tmp_path, trees: list[dict], lazy_bytes: int = 1) -> list[dict]:
    """Each tree written to a file of its own (one per saved rank) and read back with tensors left lazy."""
    out = []
    for r, tree in enumerate(trees):
        path = tmp_path / f"rank{r}.h5"
        with h5py.File(path, "w", libver=LIBVER) as f:
            write_tree(f, tree)
        with h5py.File(path, "r") as f:
            out.append(read_tree(f, lazy_bytes))
    return out


@pytest.fixture(autouse=True)
def tiny_slices(monkeypatch):
    """Slices of 3 elements: every fold below crosses slice boundaries."""
    monkeypatch.setattr(resize, "SLICE_ELEMENTS", 3)


def test_large_tensors_stay_in_the_file_and_read_back_whole_or_by_rows(tmp_path):
    w = torch.arange(12.0).reshape(4, 3)                                    # 48 bytes
    half = torch.linspace(-2, 2, 12).to(torch.bfloat16)                      # 24 bytes, stored as uint16
    [tree] = saved(tmp_path, [{"w": w, "half": half, "small": torch.tensor([7]), "n": 3}], lazy_bytes=20)
    assert isinstance(tree["w"], LazyTensor) and isinstance(tree["half"], LazyTensor)
    assert torch.equal(tree["small"], torch.tensor([7])) and tree["n"] == 3  # 8 bytes: read at once
    assert torch.equal(tree["w"].read(), w) and torch.equal(tree["w"].read(slice(1, 3)), w[1:3])
    assert tree["half"].dtype == torch.bfloat16 and torch.equal(tree["half"].read(), half)


def test_a_corrupted_lazy_tensor_fails_when_read(tmp_path):
    [tree] = saved(tmp_path, [{"w": torch.arange(1000, dtype=torch.float32)}])
    with h5py.File(tmp_path / "rank0.h5", "r") as f:
        offset = f["w"].id.get_chunk_info(0).byte_offset + 8
    with open(tmp_path / "rank0.h5", "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match="corrupted"):
        tree["w"].read()


def _resize(states, rank=0, size=3, built=None):
    return resize.Resize(states, built or {"params": torch.zeros(7)}, rank, size, "method")


def test_replica_and_residual_means_by_hand(tmp_path):
    """Three saved ranks' 7-element entries i, 7 + i and 2 (i - 7): their elementwise sum is 4 i - 7, so the mean
    is (-7, -3, 1, 5, 9, 13, 17) / 3."""
    a = torch.arange(7.0)
    b = torch.arange(7.0, 14.0)
    c = torch.arange(-7.0, 0.0) * 2
    states = saved(tmp_path, [{"x": a}, {"x": b}, {"x": c}])
    expected = torch.tensor([-7.0, -3.0, 1.0, 5.0, 9.0, 13.0, 17.0]) / 3
    values = [s["x"] for s in states]
    torch.testing.assert_close(resize.replica_mean(values, None, _resize(states), "x"), expected)
    torch.testing.assert_close(resize.residual_mean(values, torch.zeros(7), _resize(states), "x"), expected)


def test_agreed_carries_identical_entries_and_refuses_differing_ones_by_name(tmp_path):
    same = torch.tensor([0.1, -0.0, float("nan"), 4.0, 5.0])
    states = saved(tmp_path, [{"x": same}, {"x": same.clone()}])
    out = resize.agreed([s["x"] for s in states], None, _resize(states), "extra.x")
    assert torch.equal(out.view(torch.int32), same.view(torch.int32))
    other = same.clone()
    other[4] = 5.5  # differs only in the second slice
    states = saved(tmp_path, [{"x": same}, {"x": other}])
    with pytest.raises(ValueError, match=r"'extra\.x' differs across the saved ranks and no resize rule"):
        resize.agreed([s["x"] for s in states], None, _resize(states), "extra.x")


def test_own_rank_reads_old_rank_r_or_takes_the_value_built_at_the_new_size(tmp_path):
    states = saved(tmp_path, [{"g": torch.full((4,), r, dtype=torch.uint8)} for r in range(2)])
    values = [s["g"] for s in states]
    mine = resize.own_rank(values, None, _resize(states, rank=1), "g")
    assert torch.equal(mine, torch.full((4,), 1, dtype=torch.uint8))
    built = torch.full((4,), 9, dtype=torch.uint8)
    assert resize.own_rank(values, built, _resize(states, rank=2), "g") is built


def test_a_generator_not_yet_drawn_from_stays_as_built_past_the_saved_ranks(tmp_path):
    """A codec's generator is ``{seed, rng_state}`` with no state until its first draw: new rank 2 of a 2-rank
    save keeps its own seed and no state (rank 0's state would make it draw rank 0's numbers)."""
    trees = [{"codec": {"seed": r, "rng_state": torch.full((4,), r, dtype=torch.uint8)}} for r in range(2)]
    states = saved(tmp_path, trees)
    built = {"codec": {"seed": 7, "rng_state": None}}
    out = resize.reshard_tree(states, built, _resize(states, rank=2, built=built), {"codec": resize.own_rank})
    assert out == {"codec": {"seed": 7, "rng_state": None}}


def test_server_errors_of_two_owners_re_cut_into_three_chunks(tmp_path):
    """d = 7, saved at 2 ranks with chunks of 4 (0 1 2 3 | 4 5 6 pad): at 3 ranks chunks of 3 are (0 1 2), (3 4 5),
    (6 0 0)."""
    states = saved(tmp_path, [{"e": torch.tensor([0.0, 1, 2, 3])}, {"e": torch.tensor([4.0, 5, 6, 99])}])
    values = [s["e"] for s in states]
    pieces = [resize.onebit_server_errors(values, torch.zeros(3), _resize(states, rank=r), "e") for r in range(3)]
    assert [p.tolist() for p in pieces] == [[0, 1, 2], [3, 4, 5], [6, 0, 0]]


def test_worker_errors_mean_on_the_model_part_padded_anew(tmp_path, monkeypatch):
    """d = 7 over 2 saved ranks (padded to 8): each new rank gets the mean of the first 7, zeros after, read from
    the files 3 elements at a time (never a rank's whole entry)."""
    states = saved(tmp_path, [{"e": torch.arange(8.0)}, {"e": torch.arange(8.0) + 2}])
    read, sizes = LazyTensor.read, []
    monkeypatch.setattr(LazyTensor, "read", lambda self, rows=None: sizes.append(rows) or read(self, rows))
    out = resize.onebit_worker_errors([s["e"] for s in states], torch.zeros(9), _resize(states), "e")
    assert out.tolist() == [1, 2, 3, 4, 5, 6, 7, 0, 0]
    assert sizes == [slice(0, 3)] * 2 + [slice(3, 6)] * 2 + [slice(6, 7)] * 2, sizes


def test_walk_declared_paths_cover_their_subtrees_and_undeclared_differences_are_refused(tmp_path):
    trees = [{"params": torch.full((5,), float(r)), "extra": {"m": torch.full((5,), 2.0 * r), "step": 3,
                                                              "error": torch.full((5,), 3.0 * r)}} for r in range(2)]
    states = saved(tmp_path, trees)
    built = {"params": torch.zeros(5), "extra": {"m": torch.zeros(5), "step": 0, "error": torch.zeros(5)}}
    rules = {"params": resize.replica_mean, "extra": resize.replica_mean, "extra.error": resize.residual_mean}
    out = resize.reshard_tree(states, built, _resize(states, built=built), rules)
    assert out["params"].tolist() == [0.5] * 5 and out["extra"]["m"].tolist() == [1.0] * 5
    assert out["extra"]["error"].tolist() == [1.5] * 5 and out["extra"]["step"] == 3
    with pytest.raises(ValueError, match=r"'extra\.m' differs across the saved ranks"):
        resize.reshard_tree(states, built, _resize(states, built=built), {"params": resize.replica_mean})


def test_a_rule_path_naming_no_entry_is_refused():
    state = {"params": torch.zeros(2), "extra": {"error": torch.zeros(2), "q": [torch.zeros(1)]}}
    resize.check_rule_paths("m", {"extra.error": resize.residual_mean, "extra.q.0": resize.saved_rank0}, state)
    with pytest.raises(ValueError, match=r"m: its resize rule path 'extra\.eror' names no entry of its state "
                                         r"\(extra holds \['error', 'q'\]\)"):
        resize.check_rule_paths("m", {"extra.eror": resize.residual_mean}, state)
    with pytest.raises(ValueError, match="'extra.q.1' names no entry"):
        resize.check_rule_paths("m", {"extra.q.1": resize.saved_rank0}, state)


def test_numpy_reference_for_a_mean_over_many_slices(tmp_path):
    """A 2-D entry (rows of 4) over 5 ranks against numpy's float64 mean."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((6, 4)).astype(np.float32) for _ in range(5)]
    states = saved(tmp_path, [{"x": torch.from_numpy(a)} for a in arrays])
    out = resize.replica_mean([s["x"] for s in states], None, _resize(states), "x")
    np.testing.assert_allclose(out.numpy(), np.mean(np.stack(arrays).astype(np.float64), axis=0).astype(np.float32),
                               rtol=0, atol=1e-7)
