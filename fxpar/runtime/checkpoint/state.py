"""What a checkpoint holds of one rank, keyed by the model's own names (`runtime.checkpoint.save_load`).

    <name>                       a parameter or persistent buffer (tied aliases once, by the
                                 canonical name), as `model.state_dict()` names it
    optim.state.<name>.<key>     the optimizer's state of parameter <name>: a tensor shaped as
                                 the parameter (exp_avg), or a 0-dim one (Adam's step)
    rng.<rank>.cpu, .cuda        each rank's torch generator states (uint8 tensors)

Each is a `GlobalTensor`: its global shape and the pieces this rank holds
(`pieces`), placed by the parameters' placements, and under ZeRO-1/2 by where this
rank's flat shard falls in each parameter. Under bf16-mixed a parameter is its fp32 master:
the checkpoint holds what training updates, in the model's own dtype, whatever precision
saved it or loads it. Saving, a tensor several ranks hold is listed by
each of them and written once (DCP's dedup); one held by several pipeline stages (a tied
embedding and head) is written by its first stage only, since under ZeRO the stages' flat
layouts differ and their pieces would overlap. Loading, every holder reads its pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fxpar.errors import CheckpointError
from fxpar.ir import meta
from fxpar.ir.placement import REPLICATED, Placements
from fxpar.ops.random_streams import RandomStream
from fxpar.runtime.checkpoint.pieces import GlobalTensor, Piece, flat_range_pieces, tensor_pieces
from fxpar.runtime.state.master_weights import MasterWeights

OPTIMIZER_PREFIX = "optim.state."
RNG_PREFIX = "rng."


@dataclass(frozen=True)
class RankState:
    """The parts of a bound rank a checkpoint reads: its program, modules, gradient buckets
    and master weights."""

    program: object  # CompiledProgram
    rank: int
    modules: tuple[torch.fx.GraphModule, ...]
    buckets: tuple  # per module, its GradientBuckets (empty without data parallelism)
    device: torch.device
    masters: MasterWeights | None = None  # bf16-mixed's fp32 masters of the working parameters
    random: RandomStream | None = None  # the stream dropout draws from: its seed and step
    shapes: dict[str, tuple[int, ...]] = field(init=False)  # tensor name -> its global shape
    dtypes: dict[str, torch.dtype] = field(init=False)  # tensor name -> the dtype it is checkpointed in

    def __post_init__(self) -> None:
        # The value's own shape (a ZeRO-3 piece does not say it): the captured model's. Its
        # dtype too, but a parameter the runner made a bf16 working copy is its master's.
        captured = self.program.captured.graph_module.state_dict(keep_vars=True)
        object.__setattr__(self, "shapes", {k: tuple(v.shape) for k, v in captured.items()})
        working = self.masters is not None
        object.__setattr__(self, "dtypes", {
            k: self.masters.dtype if working and self.masters.is_working(v) else v.dtype for k, v in captured.items()
        })

    @property
    def coord(self):
        return self.program.mesh.coord(self.rank)

    @property
    def sizes(self) -> dict[str, int]:
        return self.program.mesh.sizes

    def placements(self, module: torch.fx.GraphModule, name: str) -> Placements:
        node = meta.parameter_nodes(module.graph).get(name)
        return meta.placements(node) if node is not None else REPLICATED

    def writer_stage(self) -> dict[str, int]:
        """Tensor name -> the first pipeline stage that holds it (the one that writes it)."""
        if self.program.stages is None:
            return {}
        first: dict[str, int] = {}
        for stage in sorted(self.program.stages, key=lambda s: s.index):
            aliases = meta.graph_aliases(stage.graph_module)
            for key in stage.graph_module.state_dict():
                first.setdefault(aliases.get(key, key), stage.index)
        return first


def model_tensors(state: RankState, *, writing: bool) -> tuple[dict[str, GlobalTensor], Callable[[], None]]:
    """The parameters and persistent buffers this rank holds (writing: those it writes), and
    what to run once they are loaded: a tensor held twice on this rank (a tied embedding in
    two of its stages) copied from the first, and bf16-mixed's working copies and masters
    filled from what was read.

    Under bf16-mixed a parameter is checkpointed as its fp32 master, so a checkpoint holds
    what training updates, in the captured model's dtype, and loads under any precision. A
    whole master (no ZeRO, or ZeRO-3's piece) is placed as its parameter is. Under ZeRO-1/2
    a rank keeps only its shard of each flat bucket's masters (`MasterWeights.shard`):
    saving, it writes the parts of its shards that fall in each parameter (the other dp
    ranks write the rest, as for the sharded optimizer state); loading, it reads its whole
    local piece into an fp32 buffer (`_fill_masters` copies it on). Nothing is gathered."""
    writers = state.writer_stage() if writing else {}
    tensors: dict[str, GlobalTensor] = {}
    held: dict[str, torch.Tensor] = {}
    read_into: dict[str, torch.Tensor] = {}  # bf16-mixed: the fp32 tensor a load reads a parameter into
    after_load: list[Callable[[], None]] = []
    for index, module in enumerate(state.modules):
        stage, aliases = meta.stage_of(module), meta.graph_aliases(module)
        for key, tensor in module.state_dict(keep_vars=True).items():
            if key in aliases or writers.get(key, stage) != stage:
                continue
            working = state.masters is not None and state.masters.is_working(tensor)
            master = state.masters.master_of(tensor) if working else None
            tensor = tensor.detach()
            placements = state.placements(module, key)
            if key in held:
                if working:
                    after_load.append(_fill_masters(state, index, key, tensor, master, read_into[key]))
                elif tensor.data_ptr() != held[key].data_ptr():
                    after_load.append(partial(tensor.copy_, held[key]))
                continue
            held[key] = tensor
            if not working:
                tensors[key] = _placed(tensor, key, placements, state)
            elif writing and master is None:
                tensors[key] = GlobalTensor(state.shapes[key], state.masters.dtype, [
                    piece for shard, (_, _, start, shard_start, shard_stop) in _master_spans(state, index, key)
                    for piece in flat_range_pieces(shard[shard_start:shard_stop], start, tensor.shape, placements,
                                                   state.coord, state.sizes, state.shapes[key])])
            else:
                read_into[key] = source = master if master is not None else torch.empty(
                    tensor.shape, dtype=state.masters.dtype, device=tensor.device)
                after_load.append(_fill_masters(state, index, key, tensor, master, source))
                tensors[key] = _placed(source, key, placements, state)

    def finish() -> None:
        with torch.no_grad():
            for step in after_load:
                step()

    return tensors, finish


def _master_spans(state: RankState, module: int, name: str) -> list[tuple[torch.Tensor, tuple]]:
    """(master shard, `GradientBuckets.shard_spans` span) of each part of this rank's ZeRO-1/2
    master shards that falls in parameter `name` of module `module`."""
    buckets = state.buckets[module]
    return [(state.masters.shard_of(module, index), span) for index in range(len(buckets.states))
            for span in buckets.shard_spans(index) if span[0] == name]


def _fill_masters(state: RankState, module: int, name: str, working: torch.Tensor, master: torch.Tensor | None,
                  source: torch.Tensor) -> Callable[[], None]:
    """After a load: the fp32 values read into `source` (the local piece of `name`) copied
    into `working` (rounded to bf16) and its master, whole or this rank's shards' parts."""
    spans = _master_spans(state, module, name) if master is None else []

    def fill() -> None:
        working.copy_(source)
        if master is not None and master is not source:
            master.copy_(source)
        for shard, (_, _, start, shard_start, shard_stop) in spans:
            shard[shard_start:shard_stop].copy_(source.reshape(-1)[start : start + shard_stop - shard_start])

    return fill


def optimizer_tensors(optimizer, state: RankState, *, stored: Mapping[str, TensorStorageMetadata] | None = None
                      ) -> tuple[dict[str, GlobalTensor], Callable[[], None]]:
    """The optimizer state this rank holds, as `optim.state.<name>.<key>` tensors, and what to
    run once they are loaded. Saving (`stored` None): the state as it is, each tensor written
    by its parameter's first stage. Loading: fresh state tensors for every key `stored` (the
    checkpoint's tensors) has of this rank's parameters, replacing the optimizer's state."""
    from fxpar.runtime.state.sharded_optimizer import ShardedOptimizer

    writers = state.writer_stage() if stored is None else {}
    by_parameter = _stored_by_parameter(stored) if stored is not None else {}
    if isinstance(optimizer, ShardedOptimizer):
        return _sharded_tensors(optimizer, state, writers, by_parameter, loading=stored is not None)
    return _whole_tensors(optimizer, state, writers, by_parameter, loading=stored is not None)


def _whole_tensors(optimizer, state, writers, by_parameter, *, loading, only: set[int] | None = None):
    """Each stepped tensor's state, whole per parameter (`only`: of these tensors alone, the
    ones a ZeRO-1/2 optimizer steps whole beside its shards)."""
    names = {}  # what the optimizer steps -> (name, module): a parameter, or bf16-mixed's master of it
    for module in state.modules:
        for name, node in meta.parameter_nodes(module.graph).items():
            parameter = module.get_parameter(name)
            master = state.masters.master_of(parameter) if state.masters is not None else None
            names.setdefault(id(parameter if master is None else master), (name, module))
    tensors: dict[str, GlobalTensor] = {}
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if only is not None and id(parameter) not in only:
                continue
            if id(parameter) not in names:
                raise CheckpointError(
                    f"optimizer {type(optimizer).__name__} steps a tensor of shape {tuple(parameter.shape)} that "
                    "is none of the model's parameters, so the checkpoint has no name for its state. "
                    "Fix: checkpoint the optimizer runner.optimizer(...) made"
                )
            name, module = names[id(parameter)]
            stage = meta.stage_of(module)
            if writers.get(name, stage) != stage:
                continue
            if loading:
                optimizer.state[parameter] = {
                    key: _fresh(entry, like=parameter, group=group) for key, entry in by_parameter.get(name, {}).items()
                }
            placements = state.placements(module, name)
            for key, value in _state_items(optimizer, parameter, name):
                if value.dim() and value.shape != parameter.shape:
                    raise CheckpointError(
                        f"optimizer {type(optimizer).__name__} keeps {key!r} of {name} with shape "
                        f"{tuple(value.shape)}, not the parameter's {tuple(parameter.shape)}: only state "
                        "shaped as its parameter (or 0-dim) reshards. Fix: an elementwise optimizer"
                    )
                tensors[f"{OPTIMIZER_PREFIX}{name}.{key}"] = _placed(value, name, placements, state)
    return tensors, lambda: None


def _sharded_tensors(optimizer, state, writers, by_parameter, *, loading):
    """ZeRO-1/2: each flat shard's state, cut where the shard crosses its parameters, and the
    state of what it steps whole beside them."""
    inner = optimizer.optimizer
    tensors: dict[str, GlobalTensor] = {}
    scalars: list[tuple[int, dict[str, list[tuple[str, torch.Tensor]]]]] = []
    group = inner.param_groups[0]
    for position, (buckets, index, shard) in enumerate(optimizer.shards):
        module = state.modules[next(i for i, b in enumerate(state.buckets) if b is buckets)]
        stage = meta.stage_of(module)
        spans = list(buckets.shard_spans(index))
        if loading:  # fresh tensors shaped as the shard, its runs' state views of them
            keys = {k: e for name, *_ in spans for k, e in by_parameter.get(name, {}).items()}
            shard_state = {k: _fresh(e, like=shard, group=group) for k, e in keys.items() if len(e.size)}
            optimizer.load_shard_state(position, shard_state)
            loaded_scalars: dict[str, list[tuple[str, torch.Tensor]]] = {}
            scalars.append((position, loaded_scalars))
        else:
            shard_state = optimizer.shard_state(position)
        for name, parameter, param_start, shard_start, shard_stop in spans:
            if writers.get(name, stage) != stage:
                continue
            placements = state.placements(module, name)
            if loading:
                for key, entry in by_parameter.get(name, {}).items():
                    if not len(entry.size):
                        value = _fresh(entry, like=shard, group=group)
                        loaded_scalars.setdefault(key, []).append((name, value))
                        tensors[f"{OPTIMIZER_PREFIX}{name}.{key}"] = _whole(value)
            for key, value in shard_state.items():
                if not isinstance(value, torch.Tensor):
                    raise _not_a_tensor(inner, name, key, value)
                full_key = f"{OPTIMIZER_PREFIX}{name}.{key}"
                if value.dim() == 0:
                    tensors.setdefault(full_key, _whole(value))
                    continue
                pieces = flat_range_pieces(value[shard_start:shard_stop], param_start, parameter.shape,
                                           placements, state.coord, state.sizes, state.shapes[name])
                tensors[full_key] = GlobalTensor(state.shapes[name], value.dtype, pieces)

    whole, _ = _whole_tensors(inner, state, writers, by_parameter, loading=loading,
                              only={id(t) for t in optimizer.whole.values()})
    tensors |= whole  # an expert's weights under ep, stepped whole

    def finish() -> None:  # one scalar per shard: every parameter's copy must agree
        for position, by_key in scalars:
            for key, values in by_key.items():
                first_name, first = values[0]
                for name, value in values[1:]:
                    if not torch.equal(value, first):
                        raise CheckpointError(
                            f"the checkpoint's {OPTIMIZER_PREFIX}{name}.{key} is {value.item()} but "
                            f"{OPTIMIZER_PREFIX}{first_name}.{key} is {first.item()}; under ZeRO they share one "
                            "flat shard and must have been stepped together. Fix: load it with zero=0"
                        )
                optimizer.load_shard_state(position, {key: first})

    return tensors, finish


def rng_tensors(state: RankState, *, loading: bool) -> tuple[dict[str, GlobalTensor], Callable[[], None]]:
    """This rank's generator states (`rng.<rank>.cpu`, and `.cuda` on a CUDA device), and what
    sets them once loaded."""
    states = {"cpu": torch.get_rng_state()}
    if state.device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(state.device)
    buffers = {kind: torch.zeros_like(s) if loading else s for kind, s in states.items()}

    def restore() -> None:
        torch.set_rng_state(buffers["cpu"])
        if "cuda" in buffers:
            torch.cuda.set_rng_state(buffers["cuda"], state.device)

    return {f"{RNG_PREFIX}{state.rank}.{kind}": _whole(b) for kind, b in buffers.items()}, restore


def _stored_by_parameter(stored: Mapping[str, TensorStorageMetadata]) -> dict[str, dict[str, TensorStorageMetadata]]:
    result: dict[str, dict[str, TensorStorageMetadata]] = {}
    for key, entry in stored.items():
        if key.startswith(OPTIMIZER_PREFIX):
            name, _, state_key = key[len(OPTIMIZER_PREFIX):].rpartition(".")
            result.setdefault(name, {})[state_key] = entry
    return result


def _state_items(optimizer, parameter, name):
    for key, value in optimizer.state.get(parameter, {}).items():
        if not isinstance(value, torch.Tensor):
            raise _not_a_tensor(optimizer, name, key, value)
        yield key, value


def _fresh(entry: TensorStorageMetadata, *, like: torch.Tensor, group: dict) -> torch.Tensor:
    """A zero tensor to load a stored optimizer state into: shaped as `like` (a parameter or a
    flat shard) for an elementwise state, else 0-dim, on the CPU as torch.optim keeps its step
    counters unless the optimizer is capturable or fused."""
    dtype = entry.properties.dtype
    if len(entry.size):
        return torch.zeros(like.shape, dtype=dtype, device=like.device)
    on_device = group.get("capturable") or group.get("fused")
    return torch.zeros((), dtype=dtype, device=like.device if on_device else "cpu")


def _placed(value: torch.Tensor, name: str, placements: Placements, state: RankState) -> GlobalTensor:
    """`value`, this rank's piece of tensor `name` (or a state shaped as it), by its placements."""
    if value.dim() == 0:  # a 0-dim tensor, or a 0-dim state of a parameter (Adam's step)
        return _whole(value)
    shape = state.shapes[name]
    return GlobalTensor(shape, value.dtype, tensor_pieces(value, shape, placements, state.coord, state.sizes))


def _whole(value: torch.Tensor) -> GlobalTensor:
    return GlobalTensor(tuple(value.shape), value.dtype, [Piece((0,) * value.dim(), value.detach())])


def _not_a_tensor(optimizer, name, key, value) -> CheckpointError:
    return CheckpointError(
        f"optimizer {type(optimizer).__name__} keeps {key!r} of {name} as {type(value).__name__}, not a "
        "tensor; a checkpoint stores tensors only (nothing is pickled). Fix: an optimizer whose "
        "state is tensors (every torch.optim one with default options)"
    )
