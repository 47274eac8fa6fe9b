"""allocator_ext.workloads, the torch workloads of the benchmarks, trace recordings and demo, on
the CPU build of torch: shapes come from the seed alone, so two processes (two allocators
compared step by step) see the same steps, and a new seed gives new ones."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch, CPU build)")

from allocator_ext import workloads  # noqa: E402

META = torch.device("meta")  # shapes without memory: the full-size workloads' draws


def _shapes(work: workloads.Workload, steps: int) -> list[tuple]:
    return [tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in work.draw())
            for _ in range(steps)]


@pytest.mark.parametrize("name", workloads.NAMES)
def test_every_workload_steps_on_the_cpu_at_its_tiny_size(name: str) -> None:
    work = workloads.build(name, torch.device("cpu"), tiny=True, seed=1)
    work.step()
    assert workloads.timed_step(work, work.draw()) > 0
    seconds, enqueued = workloads.timed_step_and_enqueue(work, work.draw())
    assert 0 < enqueued <= seconds  # queuing is part of the step, never more than it
    assert work.parameter_count() > 0


@pytest.mark.parametrize("name", workloads.NAMES)
def test_the_seed_alone_decides_the_shapes(name: str) -> None:
    one, two = (workloads.build(name, META, seed=0) for _ in range(2))
    first = _shapes(one, 12)
    assert _shapes(two, 12) == first
    assert len(set(first)) > 6                      # they vary from step to step
    one.reseed(1)
    two.reseed(1)
    fresh = _shapes(one, 12)
    assert fresh == _shapes(two, 12) and fresh != first


def test_the_convnet_draws_batches_of_8_to_64_images_of_side_128_to_416() -> None:
    work = workloads.build("convnet", META, seed=0)
    shapes = [shape[0] for shape in _shapes(work, 400)]
    batches = {s[0] for s in shapes}
    sides = {s[2] for s in shapes}
    assert min(batches) == 8 and max(batches) == 64
    assert sides == set(range(128, 417, 32))
    assert all(s[1] == 3 and s[2] == s[3] for s in shapes)


def test_experts_get_random_token_counts_that_two_processes_draw_alike() -> None:
    def expert_tokens(seed: int) -> list[int]:
        work = workloads.build("moe", torch.device("cpu"), tiny=True, seed=seed)
        seen: list[int] = []
        for module in work.model.modules():
            if isinstance(module, workloads.MixtureOfExperts):
                assert len(module.experts) == 4  # 16 at full size
                for expert in module.experts:
                    expert.register_forward_hook(lambda m, args, out: seen.append(len(args[0])))
        for _ in range(3):
            work.step()
        return seen

    counts = expert_tokens(0)
    assert counts == expert_tokens(0)
    assert len(set(counts)) > 3                     # uneven: routing, not a fixed split
    assert counts != expert_tokens(1)
    full = workloads.build("moe", META, seed=0)
    assert {len(m.experts) for m in full.model.modules()
            if isinstance(m, workloads.MixtureOfExperts)} == {16}


def test_an_unknown_workload_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown workload 'resnet'; known: transformer"):
        workloads.build("resnet", META)


LARGEST = {"transformer": ((16, 1025),), "convnet": ((64, 3, 416, 416), (64,))}


@pytest.mark.parametrize("name", sorted(LARGEST))
def test_the_largest_shapes_are_the_top_of_every_range_and_leave_the_sequence_alone(
        name: str) -> None:
    one, two = (workloads.build(name, META, seed=0) for _ in range(2))
    largest = tuple(tuple(t.shape) for t in one.draw(largest=True))
    assert largest == LARGEST[name]
    drawn = _shapes(one, 40)
    assert drawn == _shapes(two, 40)                # drawing the largest did not advance it
    assert all(d <= top for shape in drawn for dims, tops in zip(shape, largest, strict=True)
               for d, top in zip(dims, tops, strict=True))


@pytest.mark.parametrize("name", sorted(LARGEST))
def test_fixed_shapes_draw_the_largest_every_step(name: str) -> None:
    work = workloads.build(name, META, seed=0, fixed_shapes=True)
    assert set(_shapes(work, 12)) == {LARGEST[name]}


def test_a_wrapped_model_trains_the_parameters_its_wrapper_gave_it() -> None:
    """As FSDP's fully_shard does, the wrapper here replaces every parameter: the optimizer
    must step the new ones, and the old ones stay as they were."""
    import copy

    work = workloads.build("transformer", torch.device("cpu"), tiny=True, seed=1)
    old = [p.detach().clone() for p in work.model.parameters()]
    originals = list(work.model.parameters())
    work.wrap(copy.deepcopy)
    before = [p.detach().clone() for p in work.model.parameters()]
    work.step()
    assert all(torch.equal(p, o) for p, o in zip(originals, old, strict=True))
    assert any(not torch.equal(p, b) for p, b in zip(work.model.parameters(), before,
                                                    strict=True))
    with pytest.raises(RuntimeError, match="before its first step"):
        work.wrap(copy.deepcopy)


def test_the_warm_up_meets_the_peak_then_steps_the_sequence_its_seed_draws() -> None:
    work = workloads.build("convnet", torch.device("cpu"), tiny=True, seed=0)
    shapes = workloads.warm_up(work, 3, seed=7)
    other = workloads.build("convnet", META, tiny=True, seed=0)
    other.reseed(7)
    assert shapes == [workloads.batch_shape(other.draw()) for _ in range(3)]
    assert work.optimizer.state  # the peak's two steps created the optimizer's state
