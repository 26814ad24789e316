"""The resize rules of docs/checkpoints.md (Another world size), written out on plain tensors for the tests.

Each function takes the states of the saved ranks (read from the checkpoint with plain h5py,
:mod:`tests.h5_state`), and a new rank's state as built at the new size (``fresh``) and as restored, and
asserts the rule the documentation states for that entry; nothing here calls the code that resizes.
"""

import torch

CENTRALIZED = {"allreduce_sgd", "allreduce_adam", "compressed_sgd", "qsgd", "terngrad", "signsgd", "ef_signsgd",
               "hsq", "lamb", "powersgd", "apmsqueeze", "zeroone_adam", "onebit_lamb"}
DECENTRALIZED = {"dpsgd", "d2", "adpsgd", "choco", "dcd", "moniqua", "moniqua_d2", "moniqua_adpsgd", "pdsgdm",
                 "cpdsgdm", "powergossip", "decentralized_diloco"}
OUTER = {"diloco", "sparseloco", "streaming_diloco"}
ONEBIT = {"apmsqueeze", "zeroone_adam", "onebit_lamb"}
RESIDUAL = {**dict.fromkeys(("compressed_sgd", "ef_signsgd", "powersgd", "diloco", "sparseloco", "streaming_diloco"),
                            "extra.error"), **dict.fromkeys(ONEBIT, "extra.worker_error")}
"""Each error-feedback method's worker-side residual: every new rank gets the mean over the saved ranks."""
PUBLIC_COPIES = {"choco", "dcd", "cpdsgdm"}
RESTARTED = {name: ("extra.x_prev", "extra.g_prev", "extra.lr_prev", "extra.started") for name in ("d2", "moniqua_d2")}
"""D²'s previous step, restarted on a resize: as freshly built at the new size."""
PER_EDGE = {"powergossip": "extra.q"}
"""Per-edge state re-derived for the new graph: as freshly built at the new size."""
IN_FLIGHT = {"streaming_diloco": ("extra.pending", "extra.outer_grad")}
"""Streaming DiLoCo's fragments in flight: as on saved rank 0."""
REFUSED = {"moniqua_adpsgd": "moniqua_adpsgd cannot change world size: "}
"""Methods that cannot resize at the test's settings: the start of their one-line refusal."""


def leaves(tree, path: str = "") -> dict:
    """``{dotted path: value}`` of a state tree (dicts by key, lists of tensors or trees by index)."""
    if isinstance(tree, dict):
        return {p: v for key, value in tree.items() for p, v in leaves(value, f"{path}.{key}" if path else str(key))
                .items()}
    if isinstance(tree, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) or torch.is_tensor(v) for v in tree):
        return {p: v for i, value in enumerate(tree) for p, v in leaves(value, f"{path}.{i}").items()}
    return {path: tree}


def identical(a, b) -> bool:
    """Bit for bit: tensors of one dtype and shape with the same bytes, other values of one type and equal."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and a.contiguous().numpy().tobytes() == b.contiguous().numpy().tobytes())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def mean(values: list) -> torch.Tensor:
    """The elementwise mean of same-shaped tensors, in float64."""
    return torch.stack([v.double() for v in values]).mean(0)


def assert_mean(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """``got`` equals the float64 ``want`` to relative 1e-6 (and 1e-6 of its largest magnitude near zero)."""
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6 * scale + 1e-12, msg=lambda m: f"{what}: {m}")


def _float(values: list) -> bool:
    return all(torch.is_tensor(v) and v.is_floating_point() for v in values) or all(type(v) is float for v in values)


def assert_state_exists(name: str, saved: list) -> None:
    """The state each rule is about is there at the save (else the test would check nothing)."""
    flat = [leaves(s) for s in saved]
    if name in RESIDUAL:
        errors = [f[RESIDUAL[name]] for f in flat]
        assert any(bool(e.ne(0).any()) for e in errors), f"{name}: no residual at the save"
        assert not all(identical(errors[0], e) for e in errors), f"{name}: residuals equal on every rank"
    if name in DECENTRALIZED | OUTER:  # (D²'s replicas agree at 2 ranks, where one mixing step is exact)
        apart = [p for p, v in flat[0].items() if _float([v]) and not all(identical(v, f.get(p)) for f in flat[1:])]
        assert apart, f"{name}: no per-rank floating-point state (replicas, momenta) differs at the save"
    if name in PUBLIC_COPIES:
        assert any(p.startswith("extra.gossip.own_and_sum.") for p in flat[0]), f"{name}: no public copies"
    if name in RESTARTED:
        assert all(f["extra.started"] for f in flat), f"{name}: D²'s recursion not started at the save"
    if name in PER_EDGE:
        assert any(p.startswith(PER_EDGE[name] + ".") for p in flat[0]), f"{name}: no per-edge state"
    if name in IN_FLIGHT:
        assert flat[0]["extra.pending"].numel(), f"{name}: no fragment in flight at the save"


def assert_family_agreement(name: str, saved: list) -> None:
    """What the rules carry as agreed is identical on every saved rank: a centralized method's parameters and
    optimizer state, the DiLoCo family's global copy and outer optimizer."""
    flat = [leaves(s) for s in saved]
    prefixes = (("params", "extra.optimizer", "extra.m", "extra.v", "extra.q") if name in CENTRALIZED else
                ("extra.global_params", "extra.outer_optimizer") if name in OUTER else ())
    for path, value in flat[0].items():
        if path.startswith(prefixes):
            assert all(identical(value, f[path]) for f in flat[1:]), f"{name}: {path} differs on the saved ranks"


def _server_chunk(values: list, got: torch.Tensor, d: int, rank: int, size: int) -> torch.Tensor:
    """New rank ``rank``'s chunk of the saved server errors concatenated in rank order (the whole vector's
    first d elements), cut into ``size`` chunks of ``got``'s length, zero-padded."""
    whole = torch.cat([v.reshape(-1) for v in values])[:d]
    padded = torch.zeros(got.numel() * size, dtype=got.dtype)
    padded[:d] = whole
    return padded[rank * got.numel():(rank + 1) * got.numel()]


def _assert_generator(unit: str, flat: list, new: dict, built: dict, rank: int) -> None:
    """A codec's generator (``seed``, ``device``, ``rng_state``) as one: carried when identical on every saved
    rank (a shared seed); else old rank r's on new rank r < N, and as freshly built (its own seed, no state
    drawn yet) on the others."""
    part = {key: unit + "." + key for key in ("seed", "device", "rng_state")}
    saved = [{key: f[p] for key, p in part.items()} for f in flat]
    mine = {key: new[p] for key, p in part.items()}
    where = f"{unit} on rank {rank}"
    if all(all(identical(saved[0][k], s[k]) for k in part) for s in saved[1:]):
        assert all(identical(mine[k], saved[0][k]) for k in part), f"{where} agreed but not carried"
    elif rank < len(saved):
        assert all(identical(mine[k], saved[rank][k]) for k in part), f"{where} not old rank {rank}'s"
    else:
        fresh = {key: built[p] for key, p in part.items()}
        assert identical(mine["seed"], fresh["seed"]), f"{where} seed {mine['seed']}, as built {fresh['seed']}"
        assert identical(mine["rng_state"], fresh["rng_state"]), f"{where} state not as freshly seeded"


def _assert_entry(name: str, path: str, flat: list, got, built: dict, rank: int, size: int) -> None:
    """One entry of new rank ``rank``'s restored state (``got``) against its rule."""
    values, where, d = [f[path] for f in flat], f"{path} on rank {rank}", flat[0]["params"].numel()
    if path in RESTARTED.get(name, ()):
        assert identical(got, built[path]), f"{where} not restarted (as built): {got!r}, built {built[path]!r}"
    elif path in IN_FLIGHT.get(name, ()):
        assert identical(got, values[0]), f"{where} not saved rank 0's"
    elif name in PUBLIC_COPIES and path.startswith("extra.gossip.own_and_sum."):
        for row in got.reshape(-1, d):
            assert_mean(row, mean([f["params"] for f in flat]), f"{where}: a public copy is not the new replica")
    elif name in ONEBIT and path == "extra.worker_error":
        assert_mean(got[:d], mean([v[:d] for v in values]), f"{where} (first d): not the saved ranks' mean")
    elif name in ONEBIT and path == "extra.server_error":
        assert identical(got, _server_chunk(values, got, d, rank, size)), f"{where} not chunk {rank} of the whole"
    elif all(identical(values[0], v) for v in values[1:]):
        assert identical(got, values[0]), f"{where} identical on every saved rank but not carried bit for bit"
    elif _float(values):
        want = mean([torch.tensor(v, dtype=torch.float64) if type(v) is float else v for v in values])
        assert_mean(torch.as_tensor(got), want, f"{where}: not the saved ranks' mean")
    else:  # a per-rank generator, codec seed or counter
        own, whose = (values[rank], f"old rank {rank}'s") if rank < len(values) else (built[path], "as built")
        assert identical(got, own), f"{where} not {whose}"


def rank_problems(name: str, saved: list, fresh: dict, restored: dict, rank: int, size: int) -> list[str]:
    """Every entry of new rank ``rank``'s restored state against its rule, from the saved ranks' entries: one
    line per entry that breaks it."""
    flat, new, built = [leaves(s) for s in saved], leaves(restored), leaves(fresh)
    problems = []

    def check(what, *args) -> None:
        try:
            what(*args)
        except (AssertionError, KeyError) as exc:
            problems.append(" ".join(str(exc).split("\n")[:3]))

    edge = PER_EDGE.get(name)
    if edge:
        mine = {p: v for p, v in new.items() if p.startswith(edge + ".")}
        want = {p: v for p, v in built.items() if p.startswith(edge + ".")}
        if sorted(mine) != sorted(want) or not all(identical(mine[p], want[p]) for p in want):
            problems.append(f"{edge} on rank {rank} not as built for the new graph")
    units = {p[:-len(".rng_state")] for p in flat[0] if p.endswith(".rng_state")}
    for unit in sorted(units):
        check(_assert_generator, unit, flat, new, built, rank)
    for path in flat[0]:
        if (edge and path.startswith(edge + ".")) or path.rpartition(".")[0] in units:
            continue
        if path not in new:
            problems.append(f"{path} on rank {rank} missing after the restore")
            continue
        check(_assert_entry, name, path, flat, new[path], built, rank, size)
    return problems


def assert_residual_mean_kept(name: str, saved: list, restored: list) -> None:
    """The mean of the residual over the new ranks is the mean over the saved ranks (relative 1e-6): what the
    next steps still owe the model. Keeping their sum instead scales it by N / M."""
    path, d = RESIDUAL[name], saved[0]["params"].numel()
    before = mean([leaves(s)[path][:d] for s in saved])
    after = mean([leaves(s)[path][:d] for s in restored])
    assert_mean(after, before, f"{name}: mean residual over the {len(restored)} new ranks")
