"""allocator_ext.workloads, the torch workloads of the benchmarks, trace recordings and demo, on
the CPU build of torch: shapes come from the seed alone, so two processes (two allocators
compared step by step) see the same steps, and a new seed gives new ones. The workloads of
other libraries run where the library imports (transformers and torch_geometric in CI; PyPI's
torchvision does not import beside the CPU build of torch, so detection's tests skip, saying
so)."""

from __future__ import annotations

import json
import random

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch, CPU build)")

from allocator_ext import workloads  # noqa: E402
from allocator_ext.workloads import streams  # noqa: E402

META = torch.device("meta")  # shapes without memory: the full-size workloads' draws
CPU = torch.device("cpu")
# Built at full size on the meta device to draw shapes: all but the one that needs a process
# group on a real device.
ON_META = [n for n in workloads.NAMES if n != "fsdp2"]


def needs(name: str) -> None:
    why = workloads.unavailable(name)
    if why:
        pytest.skip(why)


def _shapes(work: workloads.Workload, steps: int) -> list[str]:
    return [json.dumps(workloads.batch_shape(work.draw())) for _ in range(steps)]


@pytest.mark.parametrize("name", workloads.NAMES)
def test_every_workload_steps_on_the_cpu_at_its_tiny_size(name: str) -> None:
    needs(name)
    work = workloads.build(name, CPU, tiny=True, seed=1)
    work.step()
    assert workloads.timed_step(work, work.draw()) > 0
    seconds, enqueued = workloads.timed_step_and_enqueue(work, work.draw())
    assert 0 < enqueued <= seconds  # queuing is part of the step, never more than it
    # Every workload trains or runs a model, but the pipeline, whose streams are the workload.
    assert (work.parameter_count() > 0) == (name != "stream_pipeline")


@pytest.mark.parametrize("name", ON_META)
def test_the_seed_alone_decides_the_shapes(name: str) -> None:
    needs(name)
    one, two = (workloads.build(name, META, seed=0) for _ in range(2))
    first = _shapes(one, 12)
    assert _shapes(two, 12) == first
    # They vary from step to step (the compiled model among three shapes: all three).
    assert len(set(first)) == 3 if name == "reduce_overhead" else len(set(first)) > 6
    one.reseed(1)
    two.reseed(1)
    fresh = _shapes(one, 12)
    assert fresh == _shapes(two, 12) and fresh != first


@pytest.mark.parametrize("name", workloads.NAMES)
def test_fixed_shapes_repeat_one_shape_exactly_and_it_is_the_largest(name: str) -> None:
    needs(name)
    device, tiny = (CPU, True) if name == "fsdp2" else (META, False)
    work = workloads.build(name, device, tiny=tiny, seed=0, fixed_shapes=True)
    shapes = set(_shapes(work, 6))
    assert len(shapes) == 1
    varying = workloads.build(name, device, tiny=tiny, seed=0)
    assert shapes == {json.dumps(workloads.batch_shape(varying.draw(largest=True)))}


def test_the_convnet_draws_batches_of_8_to_64_images_of_side_128_to_416() -> None:
    work = workloads.build("convnet", META, seed=0)
    shapes = [work.draw()[0].shape for _ in range(400)]
    batches = {s[0] for s in shapes}
    sides = {s[2] for s in shapes}
    assert min(batches) == 8 and max(batches) == 64
    assert sides == set(range(128, 417, 32))
    assert all(s[1] == 3 and s[2] == s[3] for s in shapes)


def test_experts_get_random_token_counts_that_two_processes_draw_alike() -> None:
    def expert_tokens(seed: int) -> list[int]:
        work = workloads.build("moe", CPU, tiny=True, seed=seed)
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
    for call in (lambda: workloads.build("resnet", META), lambda: workloads.unavailable("resnet")):
        with pytest.raises(ValueError, match="unknown workload 'resnet'; known: transformer"):
            call()


def test_a_workload_whose_library_does_not_import_says_which(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(workloads.REQUIRES, "graph", ("no_such_library_here",))
    why = workloads.unavailable("graph")
    assert why is not None and why.startswith("the graph workload needs no_such_library_here")
    assert workloads.unavailable("transformer") is None  # torch alone


LARGEST = {"transformer": ((16, 1025),), "convnet": ((64, 3, 416, 416), (64,))}


@pytest.mark.parametrize("name", sorted(LARGEST))
def test_the_largest_shapes_are_the_top_of_every_range_and_leave_the_sequence_alone(
        name: str) -> None:
    one, two = (workloads.build(name, META, seed=0) for _ in range(2))
    largest = tuple(tuple(t.shape) for t in one.draw(largest=True))
    assert largest == LARGEST[name]
    drawn = [tuple(tuple(t.shape) for t in one.draw()) for _ in range(40)]
    assert drawn == [tuple(tuple(t.shape) for t in two.draw()) for _ in range(40)]
    assert all(d <= top for shape in drawn for dims, tops in zip(shape, largest, strict=True)
               for d, top in zip(dims, tops, strict=True))


def test_a_wrapped_model_trains_the_parameters_its_wrapper_gave_it() -> None:
    """As FSDP's fully_shard does, the wrapper here replaces every parameter: the optimizer
    must step the new ones, and the old ones stay as they were."""
    import copy

    work = workloads.build("transformer", CPU, tiny=True, seed=1)
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
    work = workloads.build("convnet", CPU, tiny=True, seed=0)
    shapes = workloads.warm_up(work, 3, seed=7)
    other = workloads.build("convnet", META, tiny=True, seed=0)
    other.reseed(7)
    assert shapes == [workloads.batch_shape(other.draw()) for _ in range(3)]
    assert work.optimizer.state  # the peak's two steps created the optimizer's state


# ---- the stream pipeline: every result checked

def test_the_pipelines_expected_checksums_are_the_sums_themselves() -> None:
    draw = random.Random(0)
    for _ in range(200):
        n = draw.randint(1, 300)
        a, b, c, d = (draw.randint(1, 127), draw.randint(0, 1 << 20), draw.randint(1, 3),
                      draw.randint(-1000, 1000))
        z = [c * (a * j + b) + d for j in range(n)]
        assert streams.expected_checksums(n, a, b, c, d) == (sum(z), sum(z[::3]))


def test_the_pipeline_draws_items_of_1_to_16_mib() -> None:
    work = workloads.build("stream_pipeline", META, seed=0)
    sizes = [n * streams.ELEMENT for _ in range(100) for n in work.draw()[0]]
    assert min(sizes) >= 1 << 20 and max(sizes) <= 16 << 20
    assert max(sizes) - min(sizes) > 12 << 20
    counts = {len(work.draw()[0]) for _ in range(100)}
    assert counts == set(range(4, 13))


def test_the_pipeline_fails_loudly_when_an_item_is_overwritten_while_in_use(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # An allocator that handed an item's memory to the producer too early would change what the
    # consumer reads: here one element of one item changes after it was produced.
    work = workloads.build("stream_pipeline", CPU, tiny=True, seed=3)
    batch = work.draw()
    work.run(batch)  # as produced, every checksum matches
    produce = work._produce

    def overwritten(n: int, a: int, b: int) -> torch.Tensor:
        y = produce(n, a, b)
        y[n // 2] += 1
        return y

    monkeypatch.setattr(work, "_produce", overwritten)
    with pytest.raises(workloads.WrongResult, match=r"item 0 of the step \(\d+ bytes"):
        work.run(batch)


# ---- the libraries' workloads

def test_generate_makes_every_new_token_it_drew() -> None:
    needs("kv_generate")
    work = workloads.build("kv_generate", CPU, tiny=True, seed=2)
    calls: list[int] = []
    work.model.register_forward_hook(lambda m, args, kwargs, out: calls.append(1),
                                     with_kwargs=True)
    tokens, new_tokens = work.draw()
    work.run((tokens, new_tokens))
    assert len(calls) == new_tokens  # the prompt's pass, then one a token after the first


def test_the_trainer_pads_each_batch_to_its_longest_example_and_checkpoints_every_layer() -> None:
    needs("trainer")
    work = workloads.build("trainer", CPU, tiny=True, seed=4)
    for _ in range(10):
        input_ids, attention_mask, labels = work.draw()
        lengths = attention_mask.sum(dim=1)
        assert input_ids.shape[1] % 8 == 0
        assert input_ids.shape[1] - 8 < int(lengths.max()) <= input_ids.shape[1]
        assert labels.shape == (input_ids.shape[0],)
        assert (input_ids[attention_mask == 0] == 0).all()  # padding, by the collator
    layers = work.model.bert.encoder.layer
    assert all(layer.gradient_checkpointing for layer in layers)


def test_graphs_span_a_thousand_to_a_hundred_thousand_nodes() -> None:
    needs("graph")
    work = workloads.build("graph", META, seed=0)
    nodes = [work.draw()[0].shape[0] for _ in range(200)]
    assert 1000 <= min(nodes) < 2000 and 50_000 < max(nodes) <= 100_000
    assert sum(n < 10_000 for n in nodes) > 60  # log-uniform: as many small as large


def test_fsdp2_trains_the_shards_fully_shard_made() -> None:
    from torch.distributed.tensor import DTensor

    work = workloads.build("fsdp2", CPU, tiny=True, seed=5)
    params = list(work.model.parameters())
    assert params and all(isinstance(p, DTensor) for p in params)
    assert work.optimizer.param_groups[0]["params"] == params
    before = [p.detach().full_tensor().clone() for p in params]
    work.step()
    assert any(not torch.equal(p.detach().full_tensor(), b)
               for p, b in zip(params, before, strict=True))
