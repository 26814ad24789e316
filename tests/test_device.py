"""Device plumbing without a GPU: device choice with a fake device count, batch moves, checkpoint
mapping, RNG restore across devices, codec generators across device types, bf16/fp16 autocast."""

import pytest
import torch

from mpicomm.checkpoint import capture_rng_state, map_location, restore_rng_state
from mpicomm.codecs import make_codec
from mpicomm.training.device import placement_text, select_device, to_device
from mpicomm.training.loop import TrainConfig
from mpicomm.training.precision import Precision


@pytest.mark.parametrize("spec, local_rank, count, expected", [
    ("auto", 0, 0, "cpu"),          # no CUDA: auto falls back to the CPU
    ("auto", 5, 0, "cpu"),
    ("auto", 3, 1, "cuda:0"),       # srun --gpus-per-task=1: every task sees its own GPU as index 0
    ("auto", 3, 4, "cuda:3"),       # mpirun, 4 GPUs visible: local rank r takes GPU r
    ("auto", 6, 4, "cuda:2"),       # more ranks than GPUs: round-robin
    ("cuda", 5, 8, "cuda:5"),
    ("cuda:1", 0, 2, "cuda:1"),
    ("cpu", 2, 8, "cpu"),
])
def test_select_device(spec, local_rank, count, expected):
    assert select_device(spec, local_rank, device_count=count) == torch.device(expected)


@pytest.mark.parametrize("spec, count, message", [
    ("cuda", 0, "--device cuda: CUDA is not available"),
    ("cuda:0", 0, "--device cuda:0: CUDA is not available"),
    ("cuda:2", 2, "sees 2 CUDA device"),
    ("gpu", 1, "expected auto, cpu, cuda or cuda:N, got 'gpu'"),
    ("cpu:0", 1, "expected auto, cpu, cuda or cuda:N"),
    ("cuda:-1", 1, "expected auto, cpu, cuda or cuda:N"),
])
def test_select_device_refuses(spec, count, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        select_device(spec, 0, device_count=count)


def test_placement_text_groups_ranks_by_host():
    rows = [("a", "cuda:0"), ("a", "cuda:1"), ("b", "cuda:0")]
    assert placement_text(rows) == "placement a: 0 → cuda:0, 1 → cuda:1\nplacement b: 2 → cuda:0\n"


def test_to_device_moves_nested_batches_and_keeps_tensors_already_there():
    x = torch.arange(6.0)
    batch = {"x": x, "pair": (x, [x]), "n": 3}
    moved = to_device(batch, torch.device("meta"))
    assert moved["x"].device.type == "meta" and moved["pair"][1][0].device.type == "meta"
    assert isinstance(moved["pair"], tuple) and isinstance(moved["pair"][1], list) and moved["n"] == 3
    assert to_device(batch, torch.device("cpu"))["x"] is x


def test_map_location_moves_floating_state_and_keeps_rng_and_steps_on_the_host():
    optimizer = {"state": {0: {"momentum_buffer": torch.randn(4), "step": torch.tensor(3.0)}}}
    codec = {"rng_state": torch.zeros(8, dtype=torch.uint8)}
    state = {"algorithm": {"params": torch.randn(4), "extra": {"optimizer": optimizer, "codec": codec}},
        "buffers": {"bn.running_mean": torch.randn(2), "bn.num_batches_tracked": torch.tensor(5)},
        "rng": {"torch": torch.get_rng_state(), "cuda": [], "numpy": {"pos": 3}}, "position": {"step": 7}}
    out = map_location(state, "meta")
    assert out["algorithm"]["params"].device.type == "meta"
    assert out["algorithm"]["extra"]["optimizer"]["state"][0]["momentum_buffer"].device.type == "meta"
    assert out["buffers"]["bn.running_mean"].device.type == "meta"
    for kept in (out["algorithm"]["extra"]["optimizer"]["state"][0]["step"], out["rng"]["torch"],
                 out["algorithm"]["extra"]["codec"]["rng_state"], out["buffers"]["bn.num_batches_tracked"]):
        assert kept.device.type == "cpu"
    assert out["position"] == {"step": 7} and state["algorithm"]["params"].device.type == "cpu"  # a copy
    same = map_location(state, "cpu")  # tensors already on the run's device are not copied
    assert same["algorithm"]["params"] is state["algorithm"]["params"]


def test_rng_state_of_a_gpu_run_restores_on_a_cpu_run():
    saved = capture_rng_state("cpu")
    assert saved["cuda"] == [] and saved["cuda_device"] == -1  # a CPU run stores no CUDA state
    first = torch.rand(3)
    gpu_like = dict(saved, cuda=[torch.zeros(16, dtype=torch.uint8)] * 2, cuda_device=1)
    restore_rng_state(gpu_like, "cpu")  # the CUDA states are ignored, the CPU generator restored
    assert torch.equal(torch.rand(3), first)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA RNG states for 2 device"):
            restore_rng_state(gpu_like)  # without a device: every saved CUDA state must find its GPU


@pytest.mark.parametrize("name, options", [("qsgd", {"bits": 4}), ("uniform", {"bits": 2, "rounding": "stochastic"})])
def test_codec_generator_resumed_on_another_device_type_reseeds_deterministically(name, options):
    x = torch.randn(4096)
    codec = make_codec(name, **options)
    codec.encode(x)
    state = codec.state_dict()
    state_gpu = dict(state, device="cuda:3")  # as if saved by a GPU run, resumed here on the CPU
    a, b = make_codec(name, **options), make_codec(name, **options)
    a.load_state_dict(state_gpu)
    b.load_state_dict(state_gpu)
    assert torch.equal(a.encode(x), b.encode(x))  # deterministic
    same_device = make_codec(name, **options)
    same_device.load_state_dict(state)
    assert not torch.equal(same_device.encode(x), make_codec(name, **options).encode(x))  # a different stream


def test_precision_is_validated():
    with pytest.raises(ValueError, match="--precision: expected one of fp32, bf16, fp16, got 'fp8'"):
        TrainConfig(precision="fp8")
    with pytest.raises(ValueError, match="communicator"):
        Precision("fp16", "cpu")


def test_bf16_autocast_runs_the_forward_in_bf16_on_the_cpu_and_keeps_fp32_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    p = Precision("bf16", "cpu")
    with p.autocast():
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    p.backward(loss)
    assert all(q.grad.dtype == torch.float32 for q in model.parameters())
    with torch.no_grad():
        reference = float(torch.nn.functional.cross_entropy(model(x), y))
    assert abs(float(loss.detach()) - reference) <= 0.02 * reference  # bf16 keeps ~3 significant digits
    assert p.ready(None) and p.state_dict()["scale"] == 1.0


def test_fp32_changes_nothing():
    p = Precision("fp32", "cpu")
    with p.autocast():
        assert torch.is_autocast_enabled("cpu") is False
    assert p.ready(None) and p.scale == 1.0


def test_cuda_awareness_is_overridden_by_the_environment_and_probed_once_per_process(monkeypatch):
    """MPICOMM_CUDA_AWARE=0/1 decides alone (another value is refused by name); without it the answer is
    the loaded libmpi's MPIX_Query_cuda_support, read from /proc/self/maps once, not per communicator."""
    import builtins
    import ctypes

    from mpicomm.comm import buffers

    monkeypatch.setenv("MPICOMM_CUDA_AWARE", "1")
    assert buffers.query_cuda_aware() is True
    monkeypatch.setenv("MPICOMM_CUDA_AWARE", "0")
    assert buffers.query_cuda_aware() is False
    monkeypatch.setenv("MPICOMM_CUDA_AWARE", "yes")
    with pytest.raises(ValueError, match="MPICOMM_CUDA_AWARE must be 0 or 1, got 'yes'"):
        buffers.query_cuda_aware()
    monkeypatch.delenv("MPICOMM_CUDA_AWARE")
    buffers._loaded_mpi_is_cuda_aware.cache_clear()
    opened, real_open = [], builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: (opened.append(path), real_open(path, *a, **k))[1])
    first = buffers.query_cuda_aware()
    assert [buffers.query_cuda_aware() for _ in range(3)] == [first] * 3
    assert opened == ["/proc/self/maps"]
    with real_open("/proc/self/maps") as maps:
        libs = {line.split()[-1] for line in maps if "/libmpi" in line and ".so" in line}
    assert libs, "mpi4py's libmpi is not mapped"
    answers = {bool(q()) for q in (getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None) for path in libs) if q}
    assert first is (answers == {True})
