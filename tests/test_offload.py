"""The activation offload's copies on a side stream, checked on CPU against stand-in streams
(``testkit.offload.FakeStreams``: side-stream work runs only when something waits for it): copies
leave without holding up the compute, a tensor is never freed before its copy leaves nor read before
its copy lands, backward prefetches, the copies in flight stay bounded; a model's step with the
offload equals the step without it, bit for bit."""

from __future__ import annotations

import weakref

import pytest
import torch

import hf_ring
from hf_ring.ops.offload import OffloadActivations
from testkit.models import tiny_batch, tiny_model
from testkit.offload import FakeStreams


def _offload(fake: FakeStreams, **kw) -> OffloadActivations:
    return OffloadActivations(torch.nn.Identity(), streams=fake, **kw)


def _tensors(fake: FakeStreams, n: int, shape=(5, 3)) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``n`` tagged "device" tensors (their freeing is logged) and copies of their values."""
    xs = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    for i, x in enumerate(xs):
        fake.tags[id(x)] = f"x{i}"
        weakref.finalize(x, fake.log.append, ("free", f"x{i}"))
    return xs, [x.clone() for x in xs]


def _freed(fake: FakeStreams, tag: str) -> int:
    return next((i for i, e in enumerate(fake.log) if e == ("free", tag)), -1)


def _after_compute_event(fake: FakeStreams, what: str) -> bool:
    """The side stream was told to wait for an event of the compute stream just before ``what``."""
    i = fake.log.index(("issue", "side0", what))
    kind, stream, wait = fake.log[i - 1]
    return (
        (kind, stream) == ("issue", "side0")
        and wait.startswith("wait ")
        and (("issue", "compute", "record " + wait[5:]) in fake.log[:i])
    )


def test_copies_to_host_leave_on_the_side_stream_and_keep_their_tensor():
    fake = FakeStreams()
    off = _offload(fake)
    xs, _ = _tensors(fake, 3)
    packed = [off.pack(x) for x in xs]
    del xs
    # issued behind an event of the compute stream, on the side stream, and not run yet: the compute
    # stream did not wait for them, and no tensor was freed while its copy waits
    for i in range(3):
        issued = [e for e in fake.log if e[0] == "issue" and e[2] in (f"d2h x{i}",)]
        assert issued and issued[0][1] == "side0" and fake.runs(f"d2h x{i}") == -1
        assert _after_compute_event(fake, f"d2h x{i}")  # where the compute stream has made the tensor
        assert _freed(fake, f"x{i}") == -1
    fake.run_side()
    packed.append(off.pack(torch.zeros(2)))  # the next pack lets go of what has left
    for i in range(3):
        assert 0 <= fake.runs(f"d2h x{i}") < _freed(fake, f"x{i}")
    assert not fake.errors, fake.errors


def test_copies_in_flight_are_bounded():
    """Beyond ``max_in_flight_bytes`` waiting to leave, pack waits for the oldest copy (only)."""
    fake = FakeStreams()
    off = _offload(fake, max_in_flight_bytes=2 * 5 * 3 * 4)  # two [5, 3] float32 tensors
    xs, _ = _tensors(fake, 4)
    packed = [off.pack(xs[0]), off.pack(xs[1])]
    assert fake.runs("d2h x0") == -1
    packed.append(off.pack(xs[2]))
    assert fake.runs("d2h x0") >= 0 and fake.runs("d2h x1") == -1
    del xs
    assert _freed(fake, "x0") >= 0 and _freed(fake, "x1") == _freed(fake, "x2") == -1
    packed.append(off.pack(torch.zeros(5, 3)))
    assert fake.runs("d2h x1") >= 0 and fake.runs("d2h x2") == -1 and _freed(fake, "x1") >= 0
    assert not fake.errors, fake.errors


def test_copies_back_land_before_they_are_read_and_the_next_is_prefetched():
    fake = FakeStreams()
    off = _offload(fake)
    xs, values = _tensors(fake, 3)
    packed = [off.pack(x) for x in xs]
    del xs
    back = off.unpack(packed[2])  # backward: the reverse order of forward
    # the compute stream waited for the copy: the values are there (buffers start as NaN)
    assert torch.equal(back, values[2])
    assert fake.runs("h2d x2") > fake.runs("d2h x2") >= 0
    assert _after_compute_event(fake, "h2d x2")  # where the compute stream has allocated the buffer
    # x1 is on its way already (issued, not waited for), and is not copied a second time
    assert ("issue", "side0", "h2d x1") in fake.log and fake.runs("h2d x1") == -1
    assert torch.equal(off.unpack(packed[1]), values[1]) and torch.equal(off.unpack(packed[0]), values[0])
    assert sum(e == ("issue", "side0", "h2d x1") for e in fake.log) == 1
    assert torch.equal(off.unpack(packed[1]), values[1])  # unpacked again (retain_graph): copied again
    assert not fake.errors, fake.errors


def test_compute_stream_mode_copies_in_line():
    fake = FakeStreams()
    off = _offload(fake, side_stream=False)
    xs, values = _tensors(fake, 2)
    packed = [off.pack(x) for x in xs]
    assert not fake.sides and fake.runs("d2h x0") >= 0 and fake.runs("d2h x1") >= 0
    assert torch.equal(off.unpack(packed[1]), values[1]) and torch.equal(off.unpack(packed[0]), values[0])
    assert not fake.errors, fake.errors


def test_the_stand_in_catches_a_freed_or_unlanded_tensor():
    """What the checks above rely on: the stand-in reports a copy whose device tensor was freed before
    it ran, and a buffer read before its copy landed is NaN."""
    fake = FakeStreams()
    side = fake.new_stream(None)
    x = torch.ones(3)
    host = fake.host_buffer(x)
    with fake.stream(side):
        fake.copy(host, x)
    del x
    fake.run_side()
    assert fake.errors and "freed before the copy ran" in fake.errors[0]
    dst = fake.device_buffer(host, None)
    with fake.stream(side):
        fake.copy(dst, torch.ones(3))
    assert torch.isnan(dst).all()


@pytest.mark.parametrize("side_stream", [True, False])
def test_a_model_step_with_offload_equals_the_step_without(side_stream):
    """Checkpointed layers with the offload on the stand-in streams: loss and every gradient equal to
    checkpointing without offload, bit for bit; every saved tensor went to the host and came back."""
    batch = tiny_batch(2, 23)
    grads = {}
    fake = FakeStreams()

    class Faked(OffloadActivations):
        def __init__(self, module):
            super().__init__(module, streams=fake, side_stream=side_stream)

    for offload in (False, Faked):
        model = tiny_model("llama", "ring")
        hf_ring.enable_activation_checkpointing(model, offload=offload)
        model.train()
        out = model(**hf_ring.shard_batch(batch))
        out.loss.backward()
        grads[offload] = [out.loss.detach(), *(p.grad for p in model.parameters())]
    for a, b in zip(grads[False], grads[Faked]):
        assert torch.equal(a, b)
    to_host = [e for e in fake.log if e[0] == "run" and e[2].startswith("d2h")]
    to_device = [e for e in fake.log if e[0] == "run" and e[2].startswith("h2d")]
    assert len(to_host) >= 4 and len(to_device) >= len(to_host)  # at least the layer inputs
    assert not fake.errors, fake.errors


def test_a_prefetched_copy_dropped_unused_keeps_its_memory_until_it_lands():
    """A wrong guess: backward never asks for the prefetched tensor (its graph is freed). Its device
    buffer must outlive the copy still writing into it."""
    fake = FakeStreams()
    off = _offload(fake)
    xs, values = _tensors(fake, 2)
    packed = [off.pack(x) for x in xs]
    assert torch.equal(off.unpack(packed[1]), values[1])
    assert ("issue", "side0", "h2d x0") in fake.log and fake.runs("h2d x0") == -1
    del packed  # x0's transfer, and its prefetched buffer, dropped before the copy ran
    fake.run_side()
    assert fake.runs("h2d x0") >= 0 and not fake.errors, fake.errors


def test_every_other_input_made_again_on_the_stand_in_streams():
    """Tiled layers offloading every other layer's input (``offload_every=2``) on the stand-in streams: the
    inputs between are made again from the one before (fetched early, then kept for its own unpacking), never
    read before their copy lands; loss and gradients bit for bit those without offload; the inputs of layers
    1 and 3 (of 4) not copied."""
    batch = tiny_batch(1, 40)
    grads, copies = {}, {}
    for every in (None, 1, 2):
        fake = FakeStreams()

        class Faked(OffloadActivations):
            def __init__(self, module, fake=fake):
                super().__init__(module, streams=fake)

        model = tiny_model("llama", "ring", num_hidden_layers=4)
        hf_ring.enable_activation_checkpointing(model, offload=Faked if every else False)
        hf_ring.enable_tiled_layers(model, 8, offload_every=every or 1)
        model.train()
        out = model(**hf_ring.shard_batch(batch))
        out.loss.backward()
        grads[every] = [out.loss.detach(), *(p.grad for p in model.parameters())]
        copies[every] = len([e for e in fake.log if e[0] == "run" and e[2].startswith("d2h")])
        assert not fake.errors, fake.errors
    for every in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(grads[None], grads[every])), every
    assert copies[1] - copies[2] == 2 and copies[None] == 0, copies
