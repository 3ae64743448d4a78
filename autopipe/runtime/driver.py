"""The stage driver: runs one rank's share of a pipeline schedule over its local stages.

The schedule is compiled once into a list of bound steps; a train step splits the batch, runs
the steps, and leaves parameter gradients of the mean loss in ``.grad`` on every rank.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.distributed_c10d import _get_default_store
from torch.utils import _pytree as pytree

from autopipe.errors import ConfigError, InputError, ScheduleError
from autopipe.runtime.batch_shapes import BatchShapes, Shapes
from autopipe.runtime.graphs import StageGraphs
from autopipe.runtime.host_links import ring_slots, shared_links, slot_bytes
from autopipe.runtime.host_threads import pinned_host_threads
from autopipe.failure.monitor import DEFAULT_DEADLINE, FailureMonitor, failure_key
from autopipe.runtime.microbatch import SPLITS, batch_loss, batch_size, merge, microbatch_sizes, split_inputs, split_targets
from autopipe.runtime.p2p import P2P, Link, TensorSpec, check_boundary, floating_indices, world_links
from autopipe.runtime.stage_set import StageSet, check_layout
from autopipe.runtime.program import Compute, Step, compile_program
from autopipe.runtime.schedule import ActionKind, stage_slots, validate
from autopipe.runtime import streams
from autopipe.runtime.timeline import Timeline
from autopipe.runtime.transfers import StepTransfers
from autopipe.runtime.warmup import warm_up_once

__all__ = ["PipelineDriver", "StageSet"]

# pp: pipeline ranks; m: micro-batches; S = pp * chunks stages, stage s on rank s % pp.


class PipelineDriver:
    """Runs ``schedule`` over this rank's ``stages`` (``{stage index: module}``).

    Construction is collective over ``pp_group`` (every pipeline rank builds its driver, in the
    same order as its other drivers). ``boundary_specs[k]`` lists the tensors between stages k
    and k + 1 for one micro-batch; ``input_specs`` (optional) the model inputs', checked at
    every step. With pp = 1 all stages are local and tensors are handed over in memory.
    ``links`` gives each directed link between pipeline ranks its process group (from
    :func:`~autopipe.runtime.p2p.link_groups`; built here when ``pp_group`` spans the world).
    ``store``/``deadline`` tune failure propagation (see [Note: failure propagation]);
    ``monitor`` replaces the driver's own (a ParallelModel shares one over its whole mesh).
    ``warm_up_stages`` runs each local stage once before the first step of each mode, so that
    compiled stages compile on every rank at once (see [Note: stage warm-up]).
    ``variants(size)`` gives the stages and boundary specs for micro-batches of another size
    (see [Note: other batch sizes]); with it, batches of any size run, split as ``split`` says
    in training ([Note: batch splits]) and unevenly in evaluation. A rank that passes neither
    inputs nor targets then runs the planned size, so every rank should pass the inputs.
    ``eval_set`` holds the stages of the model's eval-mode graph where it has one (see [Note:
    one graph per mode] in autopipe/stages/mode_plan.py): :meth:`train` switches between
    the two sets, and ``training`` says which one runs first.
    """

    def __init__(
        self,
        stages: dict[int, nn.Module],
        boundary_specs: Sequence[Sequence[TensorSpec]],
        *,
        pp: int,
        chunks: int,
        pp_rank: int,
        pp_group: dist.ProcessGroup | None,
        schedule: str,
        microbatches: int,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        postprocess: Callable[[tuple[torch.Tensor, ...]], Any],
        device: torch.device | str,
        timeline: Timeline | None = None,
        input_specs: Sequence[TensorSpec] | None = None,
        store: dist.Store | None = None,
        deadline: float = DEFAULT_DEADLINE,
        cuda_graphs: bool = False,
        warm_up_stages: bool = False,
        links: dict[Link, dist.ProcessGroup] | None = None,
        variants: Callable[[int], Shapes] | None = None,
        split: str = "equal",
        monitor: FailureMonitor | None = None,
        eval_set: StageSet | None = None,
        training: bool = True,
    ) -> None:
        validate(schedule, pp, microbatches, chunks)
        if split not in SPLITS:
            raise ConfigError(f"split={split!r}; use one of {', '.join(map(repr, SPLITS))}")
        n = pp * chunks
        self._sets = {True: StageSet(stages, boundary_specs, postprocess, variants)}
        if eval_set is not None:
            self._sets[False] = eval_set
        for stage_set in self._sets.values():
            check_layout(stage_set.stages, stage_set.boundary_specs, pp, chunks, pp_rank, pp_group)
        self.pp, self.chunks, self.pp_rank, self.group = pp, chunks, pp_rank, pp_group
        self.schedule, self.microbatches = schedule, microbatches
        self.loss_fn = loss_fn
        self.device = torch.device(device)
        self.timeline, self.input_specs = timeline, input_specs
        self._last = n - 1
        self.split = split
        # Stages and specs per mode and micro-batch size; see [Note: other batch sizes].
        self._shapes_of = {mode: BatchShapes(st.stages, st.boundary_specs, input_specs, st.variants)
                           for mode, st in self._sets.items()}
        self._graphs_of: dict[bool, dict[int, StageGraphs]] = {mode: {} for mode in self._sets}
        self._programs: dict[tuple[str, int], list[Step]] = {}
        self._activate(training)
        self.p2p = P2P(pp_group, links if links is not None else world_links(pp_group)) if pp > 1 else None
        # CPU tensors travel over gloo, whose p2p works finish only inside wait().
        self.monitor = monitor if monitor is not None else FailureMonitor(
            pp_rank, (store if store is not None else _get_default_store()) if pp > 1 else None,
            failure_key(pp_group) if pp > 1 else "", deadline=deadline, threaded=self.device.type == "cpu")
        self.transfers = StepTransfers(self.p2p, self.device, self.monitor, timeline)
        self.transfers.destination = self._graph_destination
        # (CUDA, one host): how transfers are posted, and whether through shared memory (host_links.py).
        self._link = (self.device.type == "cuda", self.p2p is not None and self.p2p.one_host)
        self._shared = pp > 1 and shared_links(*self._link)
        if cuda_graphs and (self.device.type != "cuda" or schedule == "forward_only" or
                            (0 in stages and input_specs is None)):
            raise ConfigError("cuda_graphs=True needs CUDA stages, a training schedule and the model's "
                              "input specs; pass cuda_graphs=False")
        self.cuda_graphs = cuda_graphs
        self.warm_up_stages = warm_up_stages
        self._warm: set[tuple] = set()  # (stage, micro-batch size, training, grad) already run
        self._train_program = None if schedule == "forward_only" else self._program(schedule, microbatches)
        self._eval_program = self._program("forward_only", microbatches)
        self._reset()
        if pp > 1:
            self._last_global = self.p2p.global_rank(self._last % pp)
            # Brings up the group's communicator (NCCL needs every rank in the first batched
            # p2p call) and proves that every rank built its driver.
            with self.monitor.guard():
                work = dist.all_reduce(torch.zeros(1, device=self.device), group=pp_group, async_op=True)
                self._wait_collective(work, "start-up all-reduce of the pipeline group")
                shared = (ring_slots(schedule, pp, microbatches, chunks),
                          slot_bytes([b for st in self._sets.values() for b in st.boundary_specs])) if self._shared else None
                self.transfers.connect([self._train_program or [], self._eval_program], pp_rank, shared=shared)

    def close(self) -> None:
        """Lets go of the shared-memory links (host_links.py); nothing is sent afterwards."""
        self.transfers.close()

    def train(self, mode: bool = True) -> PipelineDriver:
        """Sets train/eval mode of every local stage (dropout, batch norm), at every batch size,
        and runs the stages of that mode's graph from now on where the model has one per mode."""
        for shapes in self._shapes_of.values():
            shapes.train(mode)
        self._activate(mode)
        return self

    def _activate(self, training: bool) -> None:
        """Run the stage set of this mode: its stages, boundaries, outputs and CUDA graphs."""
        mode = training if training in self._sets else True
        active, self._mode = self._sets[mode], mode  # receive buffers are pooled per mode
        n = self._last + 1
        self.stages, self.postprocess, self.shapes = active.stages, active.postprocess, self._shapes_of[mode]
        self._specs = [list(b) for b in active.boundary_specs]
        self._in_float = {s: floating_indices(self._specs[s - 1]) if s else () for s in self.stages}
        self._out_float = {s: floating_indices(self._specs[s]) if s < n - 1 else () for s in self.stages}
        self._graphs = self._graphs_of[mode]  # captured at the set's first train step

    def microbatch_sizes(self, batch: int, *, training: bool = True) -> list[int]:
        """The micro-batch sizes a batch of ``batch`` samples runs as (see [Note: batch splits]):
        ``split`` for training, uneven for evaluation; m equal ones of the planned size when
        the driver has no ``variants``."""
        if self.shapes.variants is None:
            return microbatch_sizes(batch, self.microbatches, "equal")
        return microbatch_sizes(batch, self.microbatches, self.split if training else "uneven")

    def parameters(self) -> Iterator[nn.Parameter]:
        """Parameters of the local stages, for the optimizer (those of the train-mode graph's
        stages, which the eval-mode graph's share)."""
        stages = self._sets[True].stages
        for s in sorted(stages):
            yield from stages[s].parameters()

    def train_step(self, inputs: Sequence[torch.Tensor] | None, targets: Any = None, *,
                   return_outputs: bool = False) -> Any:
        """Forward and backward of one batch; returns the mean loss (float32 scalar) on every rank.

        ``inputs`` is needed on the rank of stage 0, ``targets`` on the rank of the last stage;
        others may pass None (what is given is checked everywhere). Gradients of the mean loss
        over the batch accumulate in ``.grad``; the caller steps the optimizer. With
        ``return_outputs=True`` returns ``(loss, outputs)``: the postprocessed outputs of the
        whole batch on the last stage's rank, None elsewhere.
        """
        if self._train_program is None:
            raise ScheduleError("schedule 'forward_only' has no backward; call eval_step, or build the "
                                "driver with schedule='gpipe', '1f1b' or 'interleaved_1f1b'")
        try:
            with self.monitor.guard():
                program = self._prepare(inputs, targets, grad=True, keep=return_outputs)
                if self.cuda_graphs:
                    self._capture_graphs()
                self._warm_up(grad=True)
                self._run(program)
                loss = self._broadcast_loss()
                outputs = self._collect() if return_outputs else None
        finally:
            self._reset()
        return (loss, outputs) if return_outputs else loss

    def eval_step(self, inputs: Sequence[torch.Tensor] | None) -> Any:
        """The "forward_only" schedule under no_grad, keeping no activations.

        Returns the postprocessed outputs of the whole batch on the last stage's rank and None
        on every other rank. Train/eval mode of the stages is left as it is (see :meth:`train`).
        """
        try:
            with self.monitor.guard(), torch.no_grad():
                program = self._prepare(inputs, None, grad=False, keep=True)
                self._warm_up(grad=False)
                self._run(program)
                return self._collect()
        finally:
            self._reset()

    def _warm_up(self, grad: bool) -> None:
        """See [Note: stage warm-up]; stage 0 needs the model's input specs. Once per
        micro-batch size and mode; the planned size is warmed by CUDA graph capture instead."""
        if self.warm_up_stages and (0 not in self.stages or self.input_specs is not None):
            sizes = {self.shapes.key(n) for n in self._sizes or [None]} - ({None} if grad and self.cuda_graphs else set())
            warm_up_once(self.shapes, sizes, self.device, backward=grad, done=self._warm)

    def _capture_graphs(self) -> None:
        """Captures every local stage once, in the mode it is in now; see runtime/graphs.py."""
        if not self._graphs:
            slots = stage_slots(self.schedule, self.pp, self.microbatches, self.chunks, self.pp_rank)
            self._graphs.update({s: StageGraphs(self.stages[s], *self.shapes.stage_inputs(s), slots[s], self.device)
                                 for s in sorted(self.stages)})
        for graphs in self._graphs.values():
            graphs.prepare_grads()

    def _program(self, schedule: str, m: int) -> list[Step]:
        """The bound steps of ``schedule`` over ``m`` micro-batches, compiled once."""
        if (schedule, m) not in self._programs:
            validate(schedule, self.pp, m, self.chunks)
            delay = streams.delay_sends(*self._link) and not self._shared  # a shared-memory send holds no SM
            self._programs[(schedule, m)] = compile_program(schedule, self.pp, m, self.chunks, self.pp_rank,
                                                            streams.receive_lead(*self._link), delay)
        return self._programs[(schedule, m)]

    def _reset(self) -> None:
        for graphs in self._graphs.values():  # the slots a failed step still held
            graphs.reset()
        self._inputs: dict[tuple[int, int], tuple] = {}  # (stage, mb) -> inputs handed over locally
        self._grads: dict[tuple[int, int], list] = {}  # (stage, mb) -> output grads handed over locally
        self._saved: dict[tuple[int, int], tuple] = {}  # what backward needs; it frees it
        self.transfers.reset()
        self._losses: dict[int, torch.Tensor] = {}  # micro-batch -> its loss, on the last stage
        self._outputs: dict[int, tuple] = {}
        self._mb_inputs: list[tuple] = []
        self._targets: list[Any] = []
        self._m = self.microbatches  # this step's micro-batch count
        self._sizes: list[int] | None = None  # this step's micro-batch sizes (None: as planned)
        self._mb_shapes: list[Shapes] = []  # per micro-batch: its stages and boundary specs
        self._weights: list[float] | None = None  # per micro-batch loss weights (None: 1 / m)

    def _prepare(self, inputs: Any, targets: Any, *, grad: bool, keep: bool) -> list[Step]:
        """Splits the batch, finds each micro-batch's stages and shapes; returns the program."""
        m = self.microbatches
        self._grad, self._keep = grad, keep
        if inputs is None and 0 in self.stages:
            raise InputError(f"pipeline rank {self.pp_rank} holds stage 0 and needs the inputs; got None")
        batch = None
        if inputs is not None:
            inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
            if 0 in self.stages:
                inputs = tuple(x.to(self.device, non_blocking=True) for x in inputs)
            batch = batch_size(inputs)
        elif grad and targets is not None and self.shapes.variants is not None:
            leaves = [t for t in pytree.tree_leaves(targets) if isinstance(t, torch.Tensor) and t.dim()]
            batch = leaves[0].shape[0] if leaves else None
        # Ranks that see no batch (no inputs, no targets) run the planned shapes.
        if self.shapes.variants is not None and batch is not None:
            self._sizes = self.microbatch_sizes(batch, training=grad)
            m = len(self._sizes)
            if len(set(self._sizes)) > 1:
                self._weights = [n / batch for n in self._sizes]
        if inputs is not None:
            # Ranks without stage 0 check too, so that a bad batch fails on every rank alike.
            self._mb_inputs = split_inputs(inputs, m, self.input_specs, sizes=self._sizes)
        if grad and self._last in self.stages:
            targets = pytree.tree_map_only(torch.Tensor, lambda t: t.to(self.device, non_blocking=True), targets)
        if grad:
            self._targets = split_targets(targets, m, batch, sizes=self._sizes)
        try:
            program = self._program(self.schedule if grad else "forward_only", m)
        except ScheduleError as exc:
            raise InputError(f"a batch of {batch} samples runs as {m} micro-batches of {self._sizes}, "
                             f"which the schedule cannot run ({exc}); use a batch of at least "
                             f"{self.microbatches} samples") from None
        sizes = self._sizes if self._sizes is not None else [None] * m
        self._mb_shapes = [self.shapes.of(n) for n in sizes]
        self._m = m
        # Receive buffers are pooled per mode and micro-batch size (None: the planned size).
        self.transfers.start([(self._mode, self.shapes.key(n)) for n in sizes],
                             [specs for _, specs in self._mb_shapes], self._out_float)
        return program

    def _run(self, program: list[Step]) -> None:
        # The schedule runs with its host threads on this rank's core; see [Note: host thread
        # placement] (stages compile and capture before, on the process's cores).
        with pinned_host_threads(self.device):
            for step in program:
                if isinstance(step, Compute):
                    (self._forward if step.forward else self._backward)(step.stage, step.microbatch)
                else:
                    self.transfers.post(step.transfers)
            self.transfers.finish()

    def _graphs_for(self, s: int, mb: int) -> StageGraphs | None:
        """Stage ``s``'s CUDA graphs where micro-batch ``mb`` replays them (training, as planned)."""
        graphs = self._graphs.get(s)
        if graphs is None or not self._grad or self._m != self.microbatches or not graphs.usable():
            return None
        return graphs if self._mb_shapes[mb][0] is self.stages else None

    def _graph_destination(self, kind: ActionKind, s: int, mb: int, specs: list[TensorSpec]) -> list | None:
        """Where a receive lands when posted: a slot's static tensors where free (graphs.py)."""
        graphs = self._graphs_for(s, mb)
        return graphs.destination(kind is ActionKind.RECV_ACT, mb, specs, self._out_float[s]) if graphs else None

    def _forward(self, s: int, mb: int) -> None:
        stages, specs = self._mb_shapes[mb]
        graphs = self._graphs_for(s, mb)
        into = graphs.inputs_of(mb, specs[s - 1]) if graphs is not None and s else None
        bufs = self.transfers.received(ActionKind.RECV_ACT, s, mb, into=into) if s else None
        if s == 0:
            args = self._mb_inputs[mb]
        elif bufs is not None:
            args = tuple(bufs)
        else:
            args = self._inputs.pop((s, mb))
        if self._grad and s:  # received activations become leaves: backward stops here, and
            # leaves their .grad (a graph's replay returns them: graphs.py)
            args = tuple(x.detach().requires_grad_(graphs is None) if x.is_floating_point() else x for x in args)
        mark = self.timeline.begin() if self.timeline is not None else None
        outputs = graphs.forward(mb, *args) if graphs is not None else stages[s](*args)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        roots: tuple = outputs
        if s == self._last:
            if self._grad:
                loss = self.loss_fn(self.postprocess(outputs), self._targets[mb])
                if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    raise ConfigError(f"loss_fn must return a scalar tensor, got {getattr(loss, 'shape', loss)!r}")
                self._losses[mb] = loss.detach()
                roots = (loss / self._m if self._weights is None else loss * self._weights[mb],)
            if self._keep:  # a graph's outputs are its slot's until the slot's next forward
                self._outputs[mb] = tuple(o.detach().clone() if graphs is not None else o.detach() for o in outputs)
        else:
            check_boundary(outputs, specs[s], s, mb)
            if (s + 1) % self.pp == self.pp_rank:
                self._inputs[(s + 1, mb)] = outputs
            else:
                self.transfers.outbox[(s, mb)] = outputs
        if self.timeline is not None:
            self.timeline.end(mark, "F", s, mb)
        if self._grad:
            self._saved[(s, mb)] = (args, roots, bufs, outputs)
        elif bufs is not None:
            self.transfers.release(ActionKind.RECV_ACT, s, mb, bufs, live=outputs)

    def _backward(self, s: int, mb: int) -> None:
        args, roots, bufs, outputs = self._saved.pop((s, mb))
        graphs = self._graphs.get(s)
        graphs = graphs if graphs is not None and graphs.table.holds(mb) is not None else None
        gbufs = None
        if s == self._last:
            pairs = [(r, None) for r in roots if r.requires_grad]
        else:
            specs = self._mb_shapes[mb][1][s]
            into = graphs.grad_outputs_of(mb, self._out_float[s], [specs[i] for i in self._out_float[s]]) if graphs else None
            gbufs = self.transfers.received(ActionKind.RECV_GRAD, s, mb, into=into)
            grads = gbufs if gbufs is not None else self._grads.pop((s, mb))
            pairs = [(roots[i], g) for i, g in zip(self._out_float[s], grads)
                     if g is not None and roots[i].requires_grad]
        mark = self.timeline.begin() if self.timeline is not None else None
        lent = graphs.lent_input_grads(mb) if graphs is not None else None
        if lent is not None:  # their send must have read them before this backward overwrites them
            self.transfers.fence(ActionKind.SEND_GRAD, s, lent)
        if pairs:
            torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
        if graphs is not None:  # lent uncopied where a shared-memory link sends them on
            lend = s > 0 and (s - 1) % self.pp != self.pp_rank and self.transfers.through_shared_memory((s - 1) % self.pp)
            in_grads = graphs.leaving_input_grads(mb, self._in_float[s], lend=lend)
        else:
            in_grads = [args[i].grad for i in self._in_float[s]]
        if s and (s - 1) % self.pp == self.pp_rank:
            self._grads[(s - 1, mb)] = in_grads
        elif s:  # static shapes: an input autograd did not reach gets zeros
            specs = self._mb_shapes[mb][1][s - 1]
            self.transfers.outbox[(s, mb)] = [g if g is not None else self.transfers.pool.zeros(specs[i])
                                              for i, g in zip(self._in_float[s], in_grads)]
        if self.timeline is not None:
            self.timeline.end(mark, "B", s, mb)
        if bufs is not None:  # a stage returning its input hands on (or keeps) the buffer itself
            self.transfers.release(ActionKind.RECV_ACT, s, mb, bufs, live=outputs)
        if gbufs is not None:  # autograd may keep a received gradient as a leaf output's .grad
            self.transfers.release(ActionKind.RECV_GRAD, s, mb, gbufs,
                                   live=in_grads + [r.grad for r, _ in pairs if r.is_leaf])

    def _broadcast_loss(self) -> torch.Tensor:
        loss = batch_loss(self._losses, self._weights, self.device)
        if self.pp > 1:
            work = dist.broadcast(loss, src=self._last_global, group=self.group, async_op=True)
            self._wait_collective(work, f"broadcast of the loss from pipeline rank {self._last % self.pp}")
        return loss

    def _wait_collective(self, work: dist.Work, what: str) -> None:
        if self.device.type == "cpu":  # gloo: see [Note: collective waits]
            self.monitor.wait_collective([work], what, host=True)
        else:  # polled on the host: see [Note: stream-side waits]
            self.monitor.wait([work], what)

    def _collect(self) -> Any:
        if self._last not in self.stages:
            return None
        return self.postprocess(merge([self._outputs[mb] for mb in range(self._m)]))
