"""CUDA graphs for pipeline stages: a stage's forward and backward replayed, not relaunched.

A ViT-L stage run on 16-32 samples launches some thousand kernels per micro-batch, each a
few microseconds of GPU work: the GPU waits on Python. Shapes are static (the plan fixes
every boundary tensor), so each stage's forward and backward are captured once with
``torch.cuda.make_graphed_callables`` and replayed per micro-batch.

[Note: graph slots]
A captured graph keeps the activations its backward needs in its own memory, overwritten by
its next forward replay. 1F1B keeps several micro-batches of one stage between forward and
backward, so a stage gets one graph per micro-batch it may hold at once ("slots", counted
from the schedule: pp - rank for 1F1B, m for GPipe); a forward takes a free slot, its
backward frees it (``autopipe.runtime.schedule.stage_slots``; which slot a micro-batch
takes: slot_table.py). What crosses the stage's boundary: [Note: graph slots as boundaries].

[Note: gradients inside the graph]
Each slot is two graphs in one private memory pool: the forward, and the backward that takes
the gradients of the stage's inputs and parameters (``torch.autograd.grad``) and adds the
parameters' into their ``.grad`` tensors (one ``_foreach_add_``). Parameters are not inputs
of the replay's autograd Function, so autograd runs no accumulation of its own: with
``make_graphed_callables`` it did, one kernel launch and some Python per parameter and
micro-batch, outside the graph. On an H200 that host work made channels-last ResNet-50 and
EfficientNet-B0 stages of 32 images (20-60 parameter tensors each, about a millisecond of GPU
work) take 0.7-2.5 ms a micro-batch, varying by 40% between timings of one stage; now 0.3-0.9
ms. The graphs write into the ``.grad`` tensors that existed at capture, so ``prepare_grads``
(before every step) puts them back where an optimizer's ``zero_grad(set_to_none=True)`` or a
user replaced them, carrying over whatever gradient the replaced tensor held.

Capture runs each slot's forward and backward a few times on stand-in inputs first (on a side
stream, the random generators forked); the stage's buffers (BatchNorm's running statistics,
the sums of deferred statistics) are restored after capture, so those passes leave no trace. A
captured forward replays every in-place update it made: BatchNorm's own
(``batchnorm="microbatch"``) or the collection of deferred statistics into buffers that the
end of the step reads and zeroes in place (see [Note: deferred batch norm]).

[Note: graph slots as boundaries]
A slot's static tensors are the stage's boundary; nothing is copied in or out per micro-batch
where the pipeline can avoid it:
- outputs leave as views of the slot's static outputs. They stay valid until the slot's next
  forward, which comes after this micro-batch's backward; that backward waited for the gradient
  the next stage sent back after receiving the outputs, so the send has read them. Only outputs
  kept for the caller (``return_outputs``) are copied;
- received activations land in the slot's static inputs when the slot is known at the
  receive ([Note: slots taken at the receive] in slot_table.py), and received gradients in the
  slot's static output gradients (the slot is known once the forward ran);
- the inputs' gradients are the slot's static ones: received inputs are not leaves of autograd,
  so no accumulation copies them into ``.grad`` (the replay's ``anchor`` always requires grad,
  which makes autograd record it). The driver sends them from there through a shared-memory
  link and waits on its stream for that copy before the slot's next backward; elsewhere (NCCL,
  whose send completes only with its peer, or a stage handing them to one on its own rank) it
  copies them first.
On an H200, ResNet-50's stages of 32 images paid about 0.85 us per MB crossing their boundaries
for five such copies (benchmarks/results/2026-11-29-h200-measured-balance-boundary-rate-*.json).

Limits: stages with collectives inside (tp > 1, ``batchnorm="sync"``) are not captured; dropout
draws through the graph-safe generator.
"""
from __future__ import annotations

import gc
from typing import Any, Sequence

import torch
import torch.nn as nn

from autopipe.runtime.grad_buffers import GradientViews
from autopipe.runtime.p2p import TensorSpec
from autopipe.runtime.slot_table import SlotTable
from autopipe.runtime.warmup import stand_in_inputs

__all__ = ["StageGraphs"]


class _Captured:
    """One slot: ``stage``'s forward and backward captured on static inputs; see
    [Note: gradients inside the graph]."""

    def __init__(self, stage: nn.Module, inputs: tuple[torch.Tensor, ...], params: list[nn.Parameter],
                 grad_buffers: list[torch.Tensor], warmup: int = 3) -> None:
        self.inputs = inputs
        self.wants = [x.requires_grad for x in inputs]
        n_in = sum(self.wants)
        wrt = [x for x in inputs if x.requires_grad] + params
        # Warm up on a side stream, as make_graphed_callables does: library handles, autotuning
        # and the caching allocator settle outside the capture; no .grad is written.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                outs = _as_tuple(stage(*inputs))
                diff = [o for o in outs if o.requires_grad]
                if diff and wrt:
                    torch.autograd.grad(diff, wrt, [torch.empty_like(o) for o in diff], allow_unused=True)
                del outs, diff
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        self.forward_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward_graph, pool=pool):
            outs = _as_tuple(stage(*inputs))
        self.outputs = tuple(o.detach() for o in outs)
        self.differentiable = [o.requires_grad for o in outs]
        diff = [o for o in outs if o.requires_grad]
        self.grad_outputs = [torch.empty_like(o) for o in diff]
        self.backward_graph = None
        self.input_grads: list[torch.Tensor | None] = [None] * n_in
        if diff and wrt:
            self.backward_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.backward_graph, pool=pool):
                got = torch.autograd.grad(diff, wrt, self.grad_outputs, allow_unused=True)
                pairs = [(g, b) for g, b in zip(got[n_in:], grad_buffers) if g is not None]
                if pairs:
                    torch._foreach_add_([b for _, b in pairs], [g for g, _ in pairs])
            self.input_grads = [g.detach() if g is not None else None for g in got[:n_in]]
        # An input's gradient that is another static tensor of the slot (a stage passing an input
        # through) is overwritten by the slot's next receive: it must be copied before it leaves.
        others = {t.untyped_storage().data_ptr() for t in (*inputs, *self.outputs, *self.grad_outputs)}
        self.input_grads_shared = any(g is not None and g.untyped_storage().data_ptr() in others
                                      for g in self.input_grads)
        del outs, diff

    def replay_forward(self, inputs: Sequence[torch.Tensor]) -> None:
        for static, x in zip(self.inputs, inputs):
            if static.data_ptr() != x.data_ptr():
                static.copy_(x)
        self.forward_graph.replay()

    def replay_backward(self, grads: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        """The gradients of the inputs (None for those that take none), after the replay."""
        if self.backward_graph is not None:
            diff = [g for g, d in zip(grads, self.differentiable) if d]
            for static, g in zip(self.grad_outputs, diff):
                if g is None:
                    static.zero_()
                elif static.data_ptr() != g.data_ptr():
                    static.copy_(g)
            self.backward_graph.replay()
        return self.grads_by_input()

    def grads_by_input(self) -> tuple[torch.Tensor | None, ...]:
        """The static gradients of the inputs, one per input (None for those that take none)."""
        it = iter(self.input_grads)
        return tuple(next(it) if wants else None for wants in self.wants)


class _Replay(torch.autograd.Function):
    """A slot's forward replayed, its backward replayed when autograd reaches it. ``anchor``
    (a scalar that requires grad) makes autograd record the replay where no input needs a
    gradient (the first stage, on the model's images): the parameters' are taken inside."""

    @staticmethod
    def forward(ctx: Any, slot: _Captured, anchor: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        slot.replay_forward(inputs)
        ctx.slot = slot
        ctx.set_materialize_grads(False)
        outputs = tuple(o.detach() for o in slot.outputs)  # fresh views: autograd marks what it returns
        ctx.mark_non_differentiable(*[o for o, d in zip(outputs, slot.differentiable) if not d])
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return (None, None, *ctx.slot.replay_backward(grads))


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


class StageGraphs:
    """The captured slots of one stage; see [Note: graph slots] and [Note: graph slots as
    boundaries]. Each micro-batch holds a slot from its forward (or its receive's posting) to
    its backward.

    ``input_specs`` are the stage's inputs for one micro-batch; ``grad_inputs`` says which of
    them carry a gradient (received activations do, the model's images do not).
    """

    def __init__(self, stage: nn.Module, input_specs: Sequence[TensorSpec], grad_inputs: Sequence[bool],
                 slots: int, device: torch.device) -> None:
        self.stage = stage
        self.training = stage.training
        self.table = SlotTable(slots)
        self._slots: list[_Captured] = []
        self._grads_of: dict[int, int] = {}  # slot -> the micro-batch whose input gradients it holds
        self._fits: dict[tuple, bool] = {}  # (inputs?, specs) -> whether the slots' tensors are laid out so
        buffers = list(stage.buffers())
        saved = [b.clone() for b in buffers]
        # One buffer, so that the dp all-reduce takes them where they lie: [Note: gradients as
        # views of one buffer] in runtime/grad_buffers.py.
        self._views = GradientViews(list(stage.parameters()))
        self._params, self._grads = self._views.params, self._views.views
        for p, g in zip(self._params, self._grads):
            p.grad = g
        # Always requires grad: received inputs are no leaves ([Note: graph slots as boundaries]).
        self._anchor = torch.zeros((), device=device, requires_grad=True)
        # Graphs no longer used hold their memory pools until their last reference goes, which
        # may sit in a reference cycle only the collector breaks, and torch no longer collects
        # before a capture. Where many stages are captured in turn (the stage timer tries one
        # plan after another), that memory piles up until an allocation inside a capture fails
        # and invalidates it ("operation failed due to a previous error during capture").
        # Collect once here, before this stage's captures.
        gc.collect()
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.random.fork_rng(devices=[index]):  # the warm-up passes draw nothing the step would
            for _ in range(slots):
                sample = stand_in_inputs(input_specs, grad_inputs, device)
                self._slots.append(_Captured(stage, sample, self._params, self._grads))
        with torch.no_grad():  # in place: the graphs read and write these very tensors
            for b, s in zip(buffers, saved):
                b.copy_(s)

    def usable(self) -> bool:
        """Replays are valid only in the train/eval mode the graphs were captured in."""
        return self.stage.training == self.training and torch.is_grad_enabled()

    def prepare_grads(self) -> None:
        """Gives every parameter back the ``.grad`` tensor the backward graphs add into, holding
        the gradient it had (zero where it had none); see [Note: gradients inside the graph]."""
        self._views.prepare()

    def reset(self) -> None:
        """Frees every slot (those a failed step still held)."""
        self.table.reset()
        self._grads_of.clear()

    def destination(self, activations: bool, mb: int, specs: Sequence[TensorSpec],
                    floating: Sequence[int]) -> list[torch.Tensor] | None:
        """Where a receive for micro-batch ``mb`` lands when posted: its inputs (``activations``)
        or the gradients of its outputs at positions ``floating``, laid out as ``specs``; None
        where no static tensors may take them now."""
        return self.reserved_inputs(mb, specs) if activations else self.grad_outputs_of(mb, floating, specs)

    def reserved_inputs(self, mb: int, specs: Sequence[TensorSpec]) -> list[torch.Tensor] | None:
        """Where micro-batch ``mb``'s received inputs (``specs``) may land, at the posting of
        the receive: the static inputs of a slot free now, or None ([Note: slots taken at the
        receive] in slot_table.py)."""
        if not self._fit(True, specs):
            return None
        slot = self.table.reserve(mb)
        return None if slot is None else [x.detach() for x in self._slots[slot].inputs]

    def inputs_of(self, mb: int, specs: Sequence[TensorSpec]) -> list[torch.Tensor] | None:
        """The static inputs of the slot micro-batch ``mb``'s forward replays (taken now), for
        a receive not yet copied out; None where they are not laid out as ``specs``."""
        if not self._fit(True, specs):
            return None
        return [x.detach() for x in self._slots[self.table.take(mb)].inputs]

    def grad_outputs_of(self, mb: int, floating: Sequence[int], specs: Sequence[TensorSpec]) -> list[torch.Tensor] | None:
        """Where the gradients of micro-batch ``mb``'s outputs at positions ``floating``
        (``specs``) may land: the static output gradients of its slot, once its forward took
        one and where those are exactly the floating outputs; else None."""
        slot = self.table.holds(mb)
        if slot is None:
            return None
        captured = self._slots[slot]
        if [i for i, d in enumerate(captured.differentiable) if d] != list(floating):
            return None
        return captured.grad_outputs if self._fit(False, specs) else None

    def _fit(self, inputs: bool, specs: Sequence[TensorSpec]) -> bool:
        """Whether every slot's static inputs (or output gradients) are laid out as buffers of
        ``specs`` are (so that both ends of a transfer see the same bytes); slots are alike."""
        key = (inputs, tuple(specs))
        if key not in self._fits:
            tensors = self._slots[0].inputs if inputs else self._slots[0].grad_outputs
            self._fits[key] = len(tensors) == len(specs) and all(
                t.shape == s.shape and t.dtype == s.dtype and t.stride() == s.empty(torch.device("meta")).stride()
                for t, s in zip(tensors, specs))
        return self._fits[key]

    def forward(self, mb: int, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Replays micro-batch ``mb``'s slot; returns views of its static outputs, attached to
        the graph's backward (valid until the slot's next forward)."""
        return _Replay.apply(self._slots[self.table.take(mb)], self._anchor, *inputs)

    @property
    def input_grads_shared(self) -> bool:
        """Whether the inputs' static gradients share memory with another static tensor of
        their slot (then they must be copied before they leave)."""
        return self._slots[0].input_grads_shared

    def lent_input_grads(self, mb: int) -> int | None:
        """The micro-batch whose static input gradients, in the slot ``mb`` holds, were lent
        to a send at their backward: that send must have read them before this backward."""
        return self._grads_of.get(self.table.holds(mb))

    def leaving_input_grads(self, mb: int, floating: Sequence[int], *, lend: bool) -> list[torch.Tensor | None]:
        """After micro-batch ``mb``'s backward, the gradients of its inputs at positions
        ``floating`` as they leave the stage: lent uncopied where ``lend`` allows (their send
        needs nothing from its peer) and no other static tensor shares their memory, else
        copies; frees the slot."""
        lend = lend and not self.input_grads_shared
        grads = self.input_grads(mb, lent=lend)
        return [grads[i] if lend or grads[i] is None else grads[i].clone() for i in floating]

    def input_grads(self, mb: int, *, lent: bool) -> tuple[torch.Tensor | None, ...]:
        """After micro-batch ``mb``'s backward: the static gradients of its inputs (None for
        those that take none); frees the slot. ``lent``: they leave uncopied (see
        :meth:`lent_input_grads`)."""
        slot = self.table.release(mb)
        if lent:
            self._grads_of[slot] = mb
        else:
            self._grads_of.pop(slot, None)
        return self._slots[slot].grads_by_input()

