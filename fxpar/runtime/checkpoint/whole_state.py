"""The trained state back from a bound rank: whole tensors on every rank, and checkpoints.

`Runner` inherits these from `WholeState`; they read the runner's bound state (its modules,
groups, communicator, step context and master weights) and issue only what the rank's state
program lists (`Program.state_program`, written by `full_state_lowering.lower_full_state`):

    full_state_dict()             the model's state dict, whole, on the CPU of every rank
    full_gradients()              each trained parameter's whole gradient
    full_optimizer_state_dict(o)  the optimizer's state as torch.optim keeps it on one device
    save(path) / load(path)       torch.distributed.checkpoint of this rank's pieces, any plan
    save_full(path)               one safetensors file of the whole model (and optimizer)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fxpar.ir import meta
from fxpar.runtime.checkpoint import save_load as checkpoint
from fxpar.runtime.checkpoint.full_file import write_full
from fxpar.runtime.checkpoint.full_state import full_optimizer_state, gather_full_tensors
from fxpar.runtime.checkpoint.optimizers import check_made_here, warn_unsaved
from fxpar.runtime.checkpoint.state import RankState
from fxpar.runtime.state.parameter_groups import ParameterGroups


class WholeState:
    """The runner's methods that give its state back (module doc)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained state with the keys of `model.state_dict()`, on the CPU, on every rank.

        Tensor-parallel shards are gathered over the tp group and pipeline stages broadcast
        over the pp group, as the rank's state program says (`runtime.checkpoint.full_state`): every rank
        must call it.
        """
        self._require_open("full_state_dict")
        state = self._gather_full({meta.stage_of(m): (m, self._masters.full_precision(m.state_dict(keep_vars=True)))
                                   for m in self.modules}, gradients=False)
        if self._flat_parameters and self._masters:  # ZeRO: the masters are sharded over dp
            masters = self._gather_full({meta.stage_of(m): (m, self._whole_masters(m)) for m in self.modules},
                                        gradients=True,
                                        shards=lambda owner, index, module: self._masters.shard_of(module, index))
            aliases = meta.graph_aliases(self.program.captured.graph_module)
            # a tied alias as its own copy, as the state program gives it (safetensors refuses shared memory)
            state.update(masters | {a: masters[n].clone() for a, n in aliases.items() if n in masters})
        return state

    def _whole_masters(self, module) -> dict[str, torch.Tensor]:
        """ZeRO-1/2 under bf16-mixed: the masters of the trained parameters in no bucket (an
        expert's weights under ep, stepped whole), by name."""
        masters = {n: self._masters.master_of(module.get_parameter(n)) for n in meta.unbucketed_parameters(module.graph)}
        return {n: master for n, master in masters.items() if master is not None}

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Each trained parameter's whole gradient (canonical names, tied weights once), on
        every rank; zeros for a parameter whose gradient is not there (no step since). Under
        ZeRO-1/2 the reduced shards are gathered from the data-parallel ranks (the experts'
        gradients under ep are in no bucket: each rank holds its experts' whole)."""
        self._require_open("full_gradients")
        local = {}
        for module in self.modules:
            trained = (set(meta.unbucketed_parameters(module.graph)) if self._flat_parameters
                       else meta.trained_parameters(module))
            local[meta.stage_of(module)] = (module, {
                n: (p.grad if p.grad is not None else torch.zeros_like(p)).to(self._masters.dtype or p.dtype)
                for n, p in graph_parameters(module).items() if n in trained
            })
        return self._gather_full(local, gradients=True)

    def full_optimizer_state_dict(self, optimizer) -> dict[str, Any]:
        """The optimizer's state as `torch.optim` keeps it on one device, keyed by parameter
        name, its groups as `runner.optimizer` was given them, on the CPU, on every rank
        (`runtime.checkpoint.full_state.full_optimizer_state`)."""
        self._require_open("full_optimizer_state_dict")
        captured = self.program.captured
        groups = self._groups.get(id(optimizer)) or ParameterGroups.whole(captured.parameters, captured.aliases)
        return full_optimizer_state(
            optimizer, groups=groups, modules=self.modules, buckets=self._context.buckets,
            module_of_stage=self._context.module_of_stage,
            gather=lambda local, shards: gather_full_tensors(
                self.program.state_program(self.rank, gradients=True), local, groups=self.groups,
                communicator=self.communicator,
                key_order=self.program.captured.graph_module.state_dict().keys(), gradient_shards=shards,
            ),
        )

    # -- checkpoints (`runtime.checkpoint.save_load`, `runtime.checkpoint.full_file`) ----------------------

    def save(self, path, *, optimizer=None, step: int | None = None, extra: Any = None) -> None:
        """Write this rank's shards of the parameters (and `optimizer`'s state, or each one's
        of a list over disjoint parameters), its generator states, `step` and the JSON value
        `extra` (the data position) to checkpoint folder `path` with
        torch.distributed.checkpoint, nothing gathered; every rank calls it, with one `path`.

        Without `optimizer=`, an optimizer `runner.optimizer` made that holds state is not
        saved, and a UserWarning names it: pass `optimizer=opt` to save it, `optimizer=[]` to
        save the model alone on purpose (`runtime.checkpoint.optimizers` says why it warns
        rather than adds). Every failure is a CheckpointError naming its cause, after which the
        checkpoint at `path` is as it was (`runtime.checkpoint.save_load`)."""
        self._require_open("save")
        given = checkpoint.listed(optimizer)
        check_made_here(self, given, action="save")
        warn_unsaved(self._optimizers, None if optimizer is None else given, Path(path))
        checkpoint.save(self._rank_state(), path, optimizer=optimizer, step=step, extra=extra)

    def load(self, path, *, optimizer=None) -> checkpoint.Resumed:
        """Read checkpoint folder `path`, saved under this plan or any other of the same model,
        into this rank's parameters (and `optimizer`'s state); returns its step and extra.
        Every byte read is checked against the checksums the save wrote. Without `optimizer=`,
        optimizer state the checkpoint holds is not restored, and a UserWarning says so."""
        self._require_open("load")
        check_made_here(self, checkpoint.listed(optimizer), action="load")
        return checkpoint.load(self._rank_state(), path, optimizer=optimizer)

    def save_full(self, path, *, optimizer=None) -> None:
        """The whole model as one safetensors file (`model.load_state_dict` takes it), and with
        `optimizer` its whole state beside it (with a list, each one's in a file of its own:
        `runtime.checkpoint.full_file`); gathered by the state programs, written by rank 0; every
        rank calls it."""
        self._require_open("save_full")
        state = self.full_state_dict()
        if isinstance(optimizer, (list, tuple)):  # several over disjoint parameters: a file each
            optimizer_state = [self.full_optimizer_state_dict(each) for each in optimizer]
        else:
            optimizer_state = self.full_optimizer_state_dict(optimizer) if optimizer is not None else None
        if self.is_main:
            write_full(path, state, optimizer_state)

    def _rank_state(self) -> RankState:
        return RankState(program=self.program, rank=self.rank, modules=tuple(self.modules),
                         buckets=self._context.buckets, device=self.device, masters=self._masters or None,
                         random=self._random)

    def _gather_full(self, local: dict, *, gradients: bool, shards=None) -> dict[str, torch.Tensor]:
        """Run the rank's state program over `local`; ZeRO's GRADIENT_SHARDS gather each
        bucket's reduced gradient, or `shards(buckets, index, module)` laid out as it, whole
        (in the masters' dtype under bf16-mixed)."""

        def gradient_shards(action) -> dict[str, torch.Tensor]:
            module = self._context.module_of_stage[action.stage]
            buckets = self._context.buckets[module]
            shard = shards(buckets, action.index, module) if shards else None
            return buckets.whole_gradients(action.index, tag=action.calls[0].tag, shard=shard,
                                           dtype=self._masters.dtype)

        return gather_full_tensors(
            self.program.state_program(self.rank, gradients=gradients), local,
            groups=self.groups, communicator=self.communicator,
            key_order=self.program.captured.graph_module.state_dict().keys(),
            gradient_shards=gradient_shards,
        )


def graph_parameters(module: torch.fx.GraphModule) -> dict[str, torch.nn.Parameter]:
    """A rank module's parameters by the names its graph reads them under."""
    return {n: module.get_parameter(n) for n in meta.parameter_nodes(module.graph)}
