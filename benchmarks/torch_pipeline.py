"""torch.distributed.pipelining's side of `bench_pipeline.py`: one rank's stage and schedule.

Map: `GPTLogits` (examples/gpt.py's GPT ending at the logits, what torch's `pipeline` traces),
`cross_entropy` (the schedule's loss), `TORCH_SCHEDULES` (fxpar's schedule names to torch's
classes), `TorchPipeline` (stage, schedule, optimizer and the tied weight's gradient sum; it
can record its compute spans for `bubble.torch_bubble`). bench_pipeline.py's docstring says
why each choice matches fxpar's side.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import (
    Schedule1F1B, ScheduleGPipe, ScheduleInterleavedZeroBubble, SplitPoint, pipeline,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from harness import OPTIMIZER

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT  # noqa: E402

# torch's ScheduleInterleavedZeroBubble is the paper's ZB1P (= ZB-H1) for any number of
# stages per rank, here one.
TORCH_SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe,
                   "zb-h1": ScheduleInterleavedZeroBubble}


class GPTLogits(GPT):
    """examples/gpt.py's GPT without the loss: `forward(idx) -> logits`, for torch's pipeline.

    The same modules under the same names (so `split_spec={"h.2": ...}` names the same block
    and `load_state_dict` copies fxpar's weights), the same forward up to the logits.
    """

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        B, T = idx.size()
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """GPT.forward's loss on one microbatch's logits."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class TorchPipeline:
    """One rank's side of torch.distributed.pipelining: stage, schedule, optimizer, tied copy."""

    def __init__(self, model: GPTLogits, cut: str, schedule_name: str, microbatches: int,
                 example: torch.Tensor):
        self.rank = dist.get_rank()
        self.microbatches = microbatches
        micro = example.tensor_split(microbatches)[0]
        pipe = pipeline(model, mb_args=(micro,), split_spec={cut: SplitPoint.BEGINNING})
        if pipe.num_stages != 2:
            raise RuntimeError(f"torch's pipeline made {pipe.num_stages} stages, expected 2")
        self.stage = pipe.build_stage(self.rank, torch.device("cpu"))
        self.module = self.stage.submod
        schedule_class = TORCH_SCHEDULES[schedule_name]
        multi = issubclass(schedule_class, PipelineScheduleMulti)  # takes a list of stages
        self.schedule = schedule_class(
            [self.stage] if multi else self.stage, microbatches, loss_fn=cross_entropy,
            scale_grads=True,
        )
        # `pipeline` REPLICATEs the tied weight: stage 0 reads it as wte.weight, stage 1 as
        # lm_head.weight, two separate tensors whose gradients must be summed (as fxpar does).
        tied_name = "wte.weight" if self.rank == 0 else "lm_head.weight"
        self.tied = self.module.get_parameter(tied_name)
        used = [p for p in self.module.parameters() if p is not self._unused_copy()]
        self.optimizer = torch.optim.AdamW(used, **OPTIMIZER)
        self.spans: list[tuple[str, float, float]] | None = None  # set to [] to record

    def _unused_copy(self) -> torch.Tensor | None:
        """Stage 0 also carries an lm_head.weight copy it never reads (no grad: AdamW skips it
        anyway; left out so the optimizer holds exactly the parameters the stage trains)."""
        if self.rank == 0:
            try:
                return self.module.get_parameter("lm_head.weight")
            except AttributeError:
                return None
        return None

    def order(self) -> list[list[str]] | None:
        """Each rank's compute actions in fxpar's notation ("0B3" for torch's input-gradient
        "0I3") for the schedules that run their `pipeline_order`, else None.

        Schedule1F1B and ScheduleGPipe also carry a `pipeline_order` (torch 2.13), but run their
        own loop: for 1F1B with 8 microbatches it lists rank 1 as 1F1 1B0 ... 1F8 1B7, a
        microbatch 8 that does not exist, so it is not compared."""
        if not isinstance(self.schedule, PipelineScheduleMulti):
            return None
        order = self.schedule.pipeline_order
        return [[str(a).replace("I", "B") for a in order[r]
                 if a is not None and re.fullmatch(r"\d+[FIBW]\d+", str(a))]
                for r in sorted(order)]

    def record(self) -> None:
        """Time each forward_one_chunk / backward_one_chunk / backward_weight_one_chunk (compute
        only, no comm waits)."""
        self.spans = []
        for name, tag in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                          ("backward_weight_one_chunk", "W")):
            original = getattr(self.stage, name)

            def timed(*args, _original=original, _tag=tag, **kwargs):
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    if self.spans is not None:
                        self.spans.append((f"{self.rank}{_tag}", start, time.perf_counter()))

            setattr(self.stage, name, timed)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.spans is not None:
            self.spans.clear()
        losses: list[torch.Tensor] = []
        if self.stage.is_first:
            self.schedule.step(x, return_outputs=False)
        else:
            self.schedule.step(target=y, losses=losses, return_outputs=False)
        if self.tied.grad is None:
            self.tied.grad = torch.zeros_like(self.tied)
        dist.all_reduce(self.tied.grad)
        self.optimizer.step()
        self.optimizer.zero_grad()
        # This rank's share of the global loss (only the last stage has it).
        return torch.stack(losses).mean().detach() if losses else torch.zeros(())
