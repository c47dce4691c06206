"""Sizes under context parallelism: which length of the sequence an op's size arguments mean.

An exported graph reads its sizes off tensors (`%s = sym_size(%input_ids, 1)`) and passes
them to views (`view(%x, [%b, %s, 4, 16])`). Under context parallelism
(`passes.context_parallel`) a rank's tokens values hold `seq / cp` positions while the whole
values computed from the inputs hold all `seq`, so one size node may mean the wrong length
where it is used:

    size read off                    at run time     a view of tokens, along its slice
    a whole value (%input_ids)       seq             floordiv(%s, cp)
    a tokens value's sliced dim      seq / cp        as read
                                                     a whole op (arange(%s)): mul(%s, cp)

`SymbolicSizes` gives each op the sizes it needs: `use_local` for a tokens op (its output's
sequence dim sized for the slice, any other dim whole: a gathered key's is the whole
sequence), `use_global` for a whole or weight op. A size computed from the sequence length
other than as a product (seq + 1, seq // 2) has no slice size fxpar can name, and is refused.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from fxpar.errors import PlanError
from fxpar.ir import meta
from fxpar.ir.placement import Shard

aten = torch.ops.aten
# Ops whose size list argument (index) is the output's shape, one entry per output dim.
_SHAPE_LISTS = {aten.view: 1, aten.reshape: 1, aten._unsafe_view: 1, aten.expand: 1, aten.new_zeros: 1,
                aten.new_ones: 1, aten.new_empty: 1, aten.new_full: 1}


def sequence_dims(node: fx.Node, seq: frozenset) -> tuple[int, ...]:
    """The dims of `node`'s value whose size involves the sequence length."""
    return tuple(d for d, size in enumerate(node.meta["val"].shape) if is_symbolic(size, seq))


def is_symbolic(size, seq: frozenset) -> bool:
    """Whether `size` (an int or SymInt) involves one of the `seq` symbols."""
    return isinstance(size, torch.SymInt) and bool(size.node.expr.free_symbols & seq)


class SymbolicSizes:
    """Size nodes made local or global where an op needs them (module doc)."""

    def __init__(self, graph: fx.Graph, *, cp: int, seq: frozenset, placement: Callable, kind: Callable):
        self.graph, self.cp, self.seq = graph, cp, seq
        self.placement, self.kind = placement, kind  # a node's cp placement and kind, as placed so far
        self.local: dict[fx.Node, fx.Node] = {}
        self.whole: dict[fx.Node, fx.Node] = {}

    def use_local(self, node: fx.Node, sharded_dim: int | None) -> None:
        """Give the tokens op `node` its sizes: its output's sharded dim for the slice."""
        packet = node.target.overloadpacket if isinstance(node.target, torch._ops.OpOverload) else None
        args = list(node.args)
        if packet in _SHAPE_LISTS and len(args) > _SHAPE_LISTS[packet]:
            index = _SHAPE_LISTS[packet]
            args[index] = [self._sized(size, node, local=dim == sharded_dim) for dim, size in enumerate(args[index])]
            node.args = tuple(args)
        elif packet is aten.arange and len(args) == 1 and sharded_dim == 0:  # positions of the rank's tokens
            node.args = (self._sized(args[0], node, local=True),)
        elif any(self._involves(a) for a in node.all_input_nodes if not isinstance(a.meta.get("val"), torch.Tensor)):
            raise PlanError(
                f"plan cp={self.cp}: {meta.describe(node)} takes a size computed from the sequence "
                "length, and fxpar sizes only views and new tensors for a rank's slice of the "
                "sequence. Fix: write the op with -1 for the sequence dim, or cp=1",
                field="cp", value=self.cp)

    def use_global(self, node: fx.Node) -> None:
        """Give the whole or weight op `node` the whole sequence's sizes."""
        for source in node.all_input_nodes:
            if self._involves(source) and self._local_at_run_time(source):
                node.replace_input_with(source, self._global(source))

    def _sized(self, size, user: fx.Node, *, local: bool):
        if not isinstance(size, fx.Node) or not self._involves(size):
            return size
        if local:
            return self._local(size, user)
        return self._global(size) if self._local_at_run_time(size) else size

    def _involves(self, node: fx.Node) -> bool:
        return is_symbolic(node.meta.get("val"), self.seq)

    def _local_at_run_time(self, node: fx.Node) -> bool:
        """A size read off a tokens value along its sliced dim, or computed from one."""
        if node.target is aten.sym_size.int:
            source, dim = node.args
            return self.kind(source) == "tokens" and self.placement(source) == Shard(dim)
        return any(self._local_at_run_time(a) for a in node.all_input_nodes)

    def _local(self, node: fx.Node, user: fx.Node) -> fx.Node:
        """`node`'s size for the rank's slice: seq // cp, or a product with it."""
        if self._local_at_run_time(node):
            return node
        if node not in self.local:
            if node.target is aten.sym_size.int:
                self.local[node] = self._add(operator.floordiv, (node, self.cp), after=node)
            elif node.target is operator.mul and sum(map(self._involves, node.all_input_nodes)) == 1:
                args = tuple(self._local(a, user) if isinstance(a, fx.Node) and self._involves(a) else a
                             for a in node.args)
                self.local[node] = self._add(operator.mul, args, after=node)
            else:
                raise PlanError(
                    f"plan cp={self.cp}: {meta.describe(user)} sizes the sequence's slice by "
                    f"{node.name} ({node.meta['val']}), which fxpar cannot divide among the cp "
                    "ranks. Fix: write the view with -1 for the sequence dim, or cp=1",
                    field="cp", value=self.cp)
        return self.local[node]

    def _global(self, node: fx.Node) -> fx.Node:
        """`node`'s size for the whole sequence: a slice's length times cp."""
        if node not in self.whole:
            if node.target is aten.sym_size.int:
                self.whole[node] = self._add(operator.mul, (node, self.cp), after=node, val=node.meta["val"])
            else:
                args = tuple(self._global(a) if isinstance(a, fx.Node) and self._involves(a)
                             and self._local_at_run_time(a) else a for a in node.args)
                self.whole[node] = self._add(node.target, args, after=node, val=node.meta["val"])
        return self.whole[node]

    def _add(self, target, args: tuple, *, after: fx.Node, val=None) -> fx.Node:
        with self.graph.inserting_after(after):
            node = self.graph.call_function(target, args)
        node.meta["val"] = val if val is not None else target(*fx.node.map_arg(args, lambda n: n.meta["val"]))
        node.meta[meta.MODULE_PATH] = meta.module_path(after)
        return node
