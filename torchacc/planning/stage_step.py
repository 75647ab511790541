"""One fake training step of this rank's pipeline stages, in the order its schedule runs them: ``StageStep``.

[Note: fake pipeline step] A pipelined model cannot run ``model(**batch).loss.backward()``, and the real schedule
(``torch.distributed.pipelining``) cannot run under a fake process group: its first step learns the shapes of
the activations a stage receives from the previous stage's messages, which a fake group never delivers. What a
rank holds does not depend on the values it receives, only on what the schedule keeps alive, so the trace runs
this rank's actions of the schedule itself, with the stage modules and ``PipelineStage`` objects the engine
built:

* the order: 1F1B runs ``min(M, S - s)`` forwards on stage ``s`` of ``S`` before its first backward, then
  alternates one backward and one forward; GPipe runs every forward, then every backward; Interleaved 1F1B runs
  the schedule's own ``pipeline_order`` for this rank. The outputs and inputs of each forward stay alive until
  its backward, as in the stage's ``fwd_cache``; the last stage keeps every microbatch's logits to the end of
  the step (``output_chunks``: the schedule returns them), detached after their backward as the stage does.
* the buffers: a stage receives each microbatch's activations (all stages but the first) and their gradients
  (all but the last) into buffers allocated once for all ``M`` microbatches, alive for the whole run.
* FSDP: every backward runs with gradient synchronization off, so each stage's unsharded gradients accumulate
  over the microbatches, and after the last one ``perform_reduce_grad`` reduce-scatters them, as the schedule
  does (``backward_maybe_with_nosync``); a stage's parameters stay gathered from its first forward to that
  reduction (``reshard_after_forward=False`` under a pipeline, see parallel/layout.py).
* the loss: the last stage calls ``model.loss_function`` on each microbatch's logits, as the runtime does.

What it leaves out: the point-to-point sends themselves (a send holds no new memory), the first step's shape
inference, and the loss values (scalars).
"""

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from ..parallel.layout import Layout
from ..parallel.memory_tracking import LiveBytes
from ..parallel.pipeline_step import pipeline_runtime

__all__ = ["StageStep", "stage_actions"]


def stage_actions(schedule: str, *, stage: int, num_stages: int, microbatches: int) -> list[tuple[str, int]]:
    """This stage's ("F" | "B", microbatch) actions in the order 1F1B or GPipe runs them (single-stage ranks).

    Example:
        >>> stage_actions("1F1B", stage=0, num_stages=2, microbatches=3)
        [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
    """
    if schedule == "GPipe":
        return [("F", m) for m in range(microbatches)] + [("B", m) for m in range(microbatches)]
    warmup = min(microbatches, num_stages - stage)
    actions = [("F", m) for m in range(warmup)]
    forward, backward = warmup, 0
    while backward < microbatches:
        actions.append(("B", backward))
        backward += 1
        if forward < microbatches:
            actions.append(("F", forward))
            forward += 1
    return actions


class StageStep:
    """This rank's part of one pipeline step, run on fake tensors (see [Note: fake pipeline step]).

    Build it inside ``FakeTensorMode`` after the model is sharded; ``tensors`` are the receive buffers (alive
    before the step: track them), ``run(live)`` runs the step and marks "backward" at its first backward.
    """

    def __init__(self, model: nn.Module, layout: Layout, batch: Mapping[str, Any]) -> None:
        runtime = pipeline_runtime(model)
        if runtime is None or layout.pipeline is None:
            raise AssertionError("StageStep traces a model the engine laid out with dist.pp.size > 1")
        self.model, self.runtime = model, runtime
        self.num_stages, self.microbatches = runtime.num_stages, runtime.microbatches
        input_ids, labels = batch["input_ids"], batch["labels"]
        if input_ids.shape[0] % self.microbatches:
            raise AssertionError("the traced batch holds a whole number of microbatches")
        self.inputs = input_ids.chunk(self.microbatches)
        self.labels = labels.chunk(self.microbatches)
        self.num_items = (labels[..., 1:] != -100).sum()
        self.stages = {m.index: m for m in runtime.stage_modules}
        self.schedule = schedule = runtime.schedule_of(batch)
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        self.pipeline_stages = {stage.stage_index: stage for stage in stages}
        config = model.config
        width = config.hidden_size
        dtype = layout.param_dtype or torch.float32
        shape = (*self.inputs[0].shape, width)
        # the receive buffers of every microbatch: activations in (all stages but the first), gradients in (all
        # but the last); a stage allocates them once and keeps them
        self.received = {(s, m): torch.empty(shape, dtype=dtype).requires_grad_()
                         for s in self.stages if s > 0 for m in range(self.microbatches)}  # fmt: skip
        self.grads_in = {(s, m): torch.empty(shape, dtype=dtype)
                         for s in self.stages if s < self.num_stages - 1 for m in range(self.microbatches)}  # fmt: skip
        self.schedule_name = layout.pipeline.schedule

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [*self.received.values(), *self.grads_in.values()]

    def _actions(self) -> list[tuple[str, int, int]]:
        """(kind, stage, microbatch) for this rank, in order."""
        if len(self.stages) == 1 and self.schedule_name != "Interleaved1F1B":
            (stage,) = self.stages
            return [(kind, stage, m) for kind, m in stage_actions(self.schedule_name, stage=stage,
                    num_stages=self.num_stages, microbatches=self.microbatches)]  # fmt: skip
        order = self.schedule.pipeline_order[self.runtime.rank]
        found = []
        for action in order:
            kind = getattr(
                getattr(action, "computation_type", None), "name", str(getattr(action, "computation_type", ""))
            )
            if action is not None and kind in ("FORWARD", "FULL_BACKWARD", "F", "B"):
                found.append(("F" if kind in ("FORWARD", "F") else "B", action.stage_index, action.microbatch_index))
        return found

    def run(self, live: LiveBytes) -> None:
        """The step: this rank's forwards and backwards in schedule order, then the gradient reduction."""
        cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]] = {}
        outputs: list[torch.Tensor] = []  # the last stage's logits, kept to the end of the step
        model, last = self.model, self.num_stages - 1
        marked = False
        for kind, stage, mb in self._actions():
            module = self.stages[stage]
            if kind == "F":
                x = self.inputs[mb] if stage == 0 else self.received[(stage, mb)]
                out = module(x)
                loss = None
                if stage == last:
                    outputs.append(out)
                    loss = model.loss_function(logits=out, labels=self.labels[mb], vocab_size=model.config.vocab_size,
                                               num_items_in_batch=self.num_items)  # fmt: skip
                cache[(stage, mb)] = (out, loss, [x] if stage > 0 else [])
                continue
            if not marked:
                live.mark("backward")
                marked = True
            out, loss, inputs = cache.pop((stage, mb))
            pipeline_stage = self.pipeline_stages[stage]
            bwd = {"stage_output": loss if loss is not None else (out,),
                   "output_grads": None if loss is not None else (self.grads_in[(stage, mb)],),
                   "input_values": inputs}  # fmt: skip
            pipeline_stage.backward_maybe_with_nosync("full", bwd)  # the input gradients it returns are sent
            del bwd
            if stage == last and stage > 0:
                out.detach_()  # as the stage does: the logits are only kept to be returned
            del out, loss, inputs
        for pipeline_stage in self.pipeline_stages.values():
            pipeline_stage.perform_reduce_grad(1)
        del outputs
