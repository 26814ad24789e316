"""The training loop of the bucket-overlap tests: counts the buckets launched during each step's backward."""


def train(algo, steps, loss_fn, bucketed, micro=1):
    """``steps`` updates of ``micro`` micro-batches each (``loss_fn(model, rank, index)`` for micro-batch
    ``index``, the same with and without overlap); returns, per update, how many buckets ``bucketed`` (the
    algorithm's overlapped exchange, holding a ``GradBuckets``, or None) had launched before ``step()``."""
    launched = []
    for t in range(steps * micro):
        algo.zero_grad()
        loss_fn(algo.model, algo.comm.rank, algo.step_count * micro + t % micro).backward()
        if (t + 1) % micro == 0:
            launched.append(len(bucketed.buckets.handles) if bucketed is not None else 0)
        algo.step()
    return launched


def resume_matches_straight(build, train_steps, before: int, after: int, same) -> None:
    """``before`` steps, a save between steps (nothing in flight), ``after`` more steps == a fresh algorithm
    loaded from that save and trained ``after`` steps: ``same(straight, resumed)`` asserts it. ``build()``
    makes the overlapped algorithm, ``train_steps(algo, k)`` trains it k steps."""
    straight = build()
    train_steps(straight, before)
    state = straight.state_dict()
    train_steps(straight, after)
    resumed = build()
    resumed.load_state_dict(state)
    train_steps(resumed, after)
    same(straight, resumed)
