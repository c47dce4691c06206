"""Context parallelism: the sequence split over the cp ranks, through the whole model.

Each of the `cp` ranks of a group computes every layer for its slice of the sequence: rank i
the i-th of `cp` equal, contiguous pieces. Attention, the one op of a transformer that mixes
tokens, computes the rank's queries against the keys and values of the whole sequence,
all-gathered over the cp ranks (Llama 3's context parallelism, Dubey et al. 2024 Sec. 3.3.2,
which chose the all-gather over a ring for its simplicity and for masks other than causal;
the backward reduce-scatters the keys' and values' gradients to the ranks that own them).
Everything else a transformer does reads one token at a time.

What the model computes from its inputs alone (positions, the attention mask, rotary angles,
the labels shifted by one) is computed whole on every cp rank, as one device computes it, and
each rank takes its slice where such a value meets the activations. These are integers, bools
and small tables next to the activations, and computing them whole means that Hugging Face's
mask builders, its packed-sequence check (a cumsum over position ids) and its label shift,
which all read across the sequence, see the whole sequence and need no rule.

So every value is one of three kinds:

    whole    from the step's inputs, buffers and constants: the same on every cp rank     cp=R
    weight   from trained parameters (and whole values without a sequence dim)           cp=R
    tokens   from the activations: cp=S(d) on its sequence dim; a gathered key or value
             cp=R; a sum over the tokens (the loss) cp=P

An op is a tokens op when it has a tokens input, or a weight input and a sequence dim in its
output (the embedding lookup, where the activations start). A whole value with a sequence dim
that meets a tokens op is cut to the rank's slice there by `split_to_shard` (through the views
that flattened it: `labels.view(-1)` is sliced as labels, then viewed).

    before                                        after (cp=2)
    %emb = embedding(%wte, %input_ids)            %ids = split_to_shard(%input_ids, 'cp', 2, 1)
                                                  %emb = embedding(%wte, %ids)
    %q = view(%lin, [%b, %s, 4, 16])              %s_cp = floordiv(%s, 2)
                                                  %q = view(%lin, [%b, %s_cp, 4, 16])
    %y = sdpa(%q, %k, %v, %mask)                  %k_all = gather_to_region(%k, 'cp', 2, 2)
                                                  %v_all = gather_to_region(%v, 'cp', 2, 2)
                                                  %rows = split_to_shard(%mask, 'cp', 2, 2)
                                                  %y = sdpa(%q, %k_all, %v_all, %rows)

Sizes: a view of a tokens value is sized for the rank's slice (`cp_sizes.SymbolicSizes`).
SDPA's `is_causal` aligns its mask to the top left, wrong for a slice of the queries, so it
becomes an explicit mask of the queries' global positions against all keys'.

Any other op that reads across the sequence of tokens (attention written as matmuls, a
cumulative sum or a shift of activations, a pooling) is refused with a PlanError naming the
node (`passes.sequence_reads`): computed on a slice it would be silently wrong. The one
exception is a mixture of experts' experts module (the one that runs a grouped matmul over
experts): its dropless routing computes each token alone, however it sorts and counts the
tokens on the way, so it runs on the rank's tokens as it is, its sizes the slice's. So does
the MoE block around experts that multiply every token (Llama 4's `bmm` experts, run on a
copy of every token per expert, which the block makes with `repeat`). A tokens value
summed over the sequence (the loss) is partial over cp and may only be summed or scaled on
the way out. Each trained parameter's gradient is then a partial sum over cp
(`fxpar.grad_partial`), which the runtime completes after backward, as it does the loss.
"""

from __future__ import annotations

import operator
from functools import partial

import torch
import torch.fx as fx

from fxpar.errors import PlanError
from fxpar.ir import meta
from fxpar.ir.placement import P, R, Partial, Shard
from fxpar.ops.expert_routing import is_grouped_mm
from fxpar.passes.expert_bmm import is_expert_bmm
from fxpar.passes.contracts import broken, ensures
from fxpar.passes.cp_sizes import SymbolicSizes, is_symbolic, sequence_dims
from fxpar.passes.sequence_reads import EVERY_DIM, dims_read_across, first_tensor, packet, sums_across

aten = torch.ops.aten
AXIS = "cp"
WHOLE, WEIGHT, TOKENS = "whole", "weight", "tokens"
_SDPA = aten.scaled_dot_product_attention
_MATMULS = {aten.mm, aten.bmm, aten.matmul, aten.baddbmm, aten.addmm, aten.linear, aten.einsum}
_ATTENTION_FIX = ("compute attention with F.scaled_dot_product_attention (Hugging Face: "
                  "attn_implementation='sdpa'), or cp=1")
_READS_ACROSS_FIX = "keep what reads across the sequence out of the activations' path, or cp=1"
# What a partial sum over the cp ranks may meet on its way to the output: sums and scalings
# by values every rank holds alike, which commute with the sum the runtime takes.
_LINEAR_IN_PARTIALS = {aten.add, aten.sub, aten.mul, aten.div, aten.neg, aten.sum, aten.to, aten._to_copy,
                       aten.clone, aten.view, aten.reshape, aten.squeeze, aten.unsqueeze, aten.alias}


def no_whole_value_meets_tokens(gm: fx.GraphModule) -> None:
    """Ensures: no tokens op reads a whole value that has a sequence dim, except through
    `split_to_shard` (whose output is the rank's slice)."""
    for node in gm.graph.nodes:
        if node.meta.get(meta.CP_KIND) != TOKENS or packet(node) is _SDPA or node.target is fxpar_op("split_to_shard"):
            continue
        for source in node.all_input_nodes:
            if source.meta.get(meta.CP_KIND) == WHOLE and _tensor(source) \
                    and sequence_dims(source, gm.meta[meta.GRAPH_SEQ]):
                raise broken("a whole value with a sequence dim reaches tokens only as the rank's slice", node)


@ensures(no_whole_value_meets_tokens)
def split_sequence(gm: fx.GraphModule, *, cp: int, seq: frozenset) -> fx.GraphModule:
    """Split the sequence over `cp` ranks (module doc).

    Requires: export's `seq` symbols (`CapturedGraph.export_symbols("seq")`); a loss that is a
    sum over the step's count of valid targets (`passes.loss_normalisation`).
    Ensures: every tensor node carries its cp placement; each whole value with a sequence
    dim reaches tokens ops only as the rank's slice (`split_to_shard`); SDPA reads keys and
    values gathered over cp; trained parameters are `fxpar.grad_partial` over cp; each node
    holds its kind (`fxpar.cp_kind`) and `gm.meta["fxpar.cp_seq"]` the sequence's symbols."""
    if not seq:
        raise PlanError(
            "plan cp splits the sequence, and the capture fixed its length (no `seq` symbol "
            "in the example's shapes). Fix: give example inputs of shape (batch, seq) with "
            "seq > 1, as `fxpar.compile` captures them, or cp=1",
            field="cp", value=cp)
    if not meta.graph_loss(gm).sums:
        raise PlanError(
            "plan cp needs the loss as a sum over the step's valid targets (a cross entropy or "
            "NLL loss, mean or sum), and this model's loss is some other mean: a mean over each "
            "rank's tokens does not add up to the mean over the sequence. Fix: return "
            "F.cross_entropy(...) as the loss, or cp=1",
            field="cp", value=cp)
    _SequenceSplit(gm, cp=cp, seq=seq).run()
    return gm


class _SequenceSplit:
    """One walk over the graph in order, giving each node its kind and rewriting tokens ops."""

    def __init__(self, gm: fx.GraphModule, *, cp: int, seq: frozenset):
        self.gm, self.graph, self.cp, self.seq = gm, gm.graph, cp, seq
        self.kinds: dict[fx.Node, str] = {}
        self.sizes = SymbolicSizes(self.graph, cp=cp, seq=seq, placement=lambda n: meta.placement(n, AXIS),
                                   kind=self.kinds.get)
        self.slices: dict[object, fx.Node] = {}  # whole value (an input: and its reader) -> its slice
        # (experts that multiply every token, Llama 4's, take copies the whole MoE block makes)
        self.experts = {meta.module_path(n) for n in self.graph.nodes if is_grouped_mm(n)} | {
            meta.module_path(n).rpartition(".")[0] for n in self.graph.nodes if is_expert_bmm(n)}

    def run(self) -> None:
        for node in list(self.graph.nodes):
            self.kinds[node] = kind = self._kind(node)
            if node.op != "call_function":
                self._place(node, R)
                continue
            if not _holds_tensors(node):
                continue  # a size (its users size it: `cp_sizes`), or an assertion
            if kind == TOKENS:
                self._tokens_op(node)
            else:
                self.sizes.use_global(node)
                self._place(node, R)
        self._check_loss_is_split()
        for node in meta.parameter_nodes(self.graph).values():
            if meta.requires_grad(node) and node.users:
                meta.mark_gradient_partial(node, AXIS)
        for node, kind in self.kinds.items():
            node.meta[meta.CP_KIND] = kind
        self.gm.meta[meta.GRAPH_SEQ] = self.seq

    def _check_loss_is_split(self) -> None:
        """The loss must be a sum over the split activations (cp=P): one computed whole on
        every rank would be counted cp times. It is whole when the capture fixed the
        sequence's length inside the model (a Python loop over the positions, as in Mamba's
        scan, reads it as a number): then the activations have no dim sized by the symbol."""
        (loss, *_) = torch.utils._pytree.tree_leaves(self.graph.output_node().args[0])
        if isinstance(loss, fx.Node) and isinstance(meta.placement(loss, AXIS), Partial):
            return
        fixed = [f"{n.name} {tuple(n.meta['val'].shape)}" for n in self.graph.nodes
                 if n.op == "placeholder" and _tensor(n) and n.meta["val"].dim() > 1 and not sequence_dims(n, self.seq)]
        raise PlanError(
            f"plan cp={self.cp}: the loss is not computed from activations split along the "
            "sequence: no activation of this model has a dim sized by the sequence's length"
            + (f" (the capture fixed it in {', '.join(fixed)})" if fixed else "")
            + ". A model that reads the length as a number (a Python loop over the positions, "
            "as in a recurrent scan) cannot be split along it. Fix: cp=1 for this model",
            field="cp", value=self.cp)

    def _kind(self, node: fx.Node) -> str:
        if node.op == "get_attr":
            return WEIGHT if meta.requires_grad(node) else WHOLE
        inputs = {self.kinds[n] for n in node.all_input_nodes}
        if node.op != "call_function":
            return TOKENS if TOKENS in inputs else WHOLE
        if TOKENS in inputs or (WEIGHT in inputs and _tensor(node) and sequence_dims(node, self.seq)):
            return TOKENS
        if self._in_experts(node) and _tensor(node) and sequence_dims(node, self.seq):
            return TOKENS  # sized by the rank's tokens (`arange(tokens x k)`, the unsort's positions)
        return WEIGHT if WEIGHT in inputs else WHOLE

    def _tokens_op(self, node: fx.Node) -> None:
        """A tokens op: attention gathers its keys and values; any other reads whole inputs
        as the rank's slices, its sizes for the slice, and is checked not to read across the
        sequence."""
        if packet(node) is _SDPA:
            self._attention(node)
            self._place(node, Shard(node.meta["val"].dim() - 2))
            return
        experts = self._in_experts(node)
        if not experts:
            self._check_reads(node)
        for source in node.all_input_nodes:
            if self.kinds[source] == WHOLE and _tensor(source) and sequence_dims(source, self.seq):
                node.replace_input_with(source, self._slice(source, node))
        self.sizes.use_local(node, self._output_dim(node))
        dim = self._output_dim(node)
        self._place(node, (R if dim is None else Shard(dim)) if experts else self._placement(node))

    def _in_experts(self, node: fx.Node) -> bool:
        """Whether `node` runs inside a mixture of experts' experts module: dropless routing
        computes each token alone, however it sorts and counts the tokens on the way (the
        rank's own tokens, in the rank's order; what leaves the module is in token order)."""
        path = meta.module_path(node)
        return any(path == m or path.startswith(m + ".") for m in self.experts)

    def _placement(self, node: fx.Node):
        """S(d) on the value's sequence dim; P for a sum over the tokens (or what a partial
        sum makes); R for a tokens value with no sequence dim left that sums nothing."""
        if not _tensor(node):
            return None
        dims = sequence_dims(node, self.seq)
        if dims:
            return Shard(dims[0])
        sources = [meta.placement(s, AXIS) for s in node.all_input_nodes if _tensor(s)]
        return P if sums_across(node) or any(isinstance(p, Partial) for p in sources) else R

    def _output_dim(self, node: fx.Node) -> int | None:
        dims = sequence_dims(node, self.seq) if _tensor(node) else ()
        return dims[0] if dims else None

    # -- the checks -------------------------------------------------------------------------

    def _check_reads(self, node: fx.Node) -> None:
        """Refuse an op that reads across the sequence of a tokens input (module doc)."""
        tokens = [s for s in node.all_input_nodes if self.kinds[s] == TOKENS and _tensor(s)]
        partial_inputs = [s for s in tokens if isinstance(meta.placement(s, AXIS), Partial)]
        if partial_inputs and (packet(node) not in _LINEAR_IN_PARTIALS or self._mixes_partial(node)):
            raise self._refusal(node, "uses a sum over the rank's tokens (a partial sum over cp) in "
                                "a way that does not commute with summing over the ranks")
        if packet(node) in _MATMULS and len(tokens) > 1:
            raise self._refusal(node, "multiplies two activations: attention written out as "
                                "matmuls reads every key for each query", _ATTENTION_FIX)
        first = first_tensor(node)  # the input whose dims `dims_read_across` names
        if first is None or self.kinds[first] != TOKENS or not isinstance(meta.placement(first, AXIS), Shard):
            return
        sharded = {meta.placement(first, AXIS).dim}
        across = dims_read_across(node)
        if across is None:
            raise self._refusal(node, f"is an op ({packet(node)}) that fxpar does not know to "
                                "read each position of the sequence alone")
        if (across == EVERY_DIM or sharded & set(across)) and not sums_across(node):
            raise self._refusal(node, "reads across the sequence dim, of which this rank holds a slice")

    def _mixes_partial(self, node: fx.Node) -> bool:
        """A sum or difference of a partial value with one that is not partial, or a product
        of two partial values: neither commutes with summing over the ranks."""
        partial = [_tensor(s) and isinstance(meta.placement(s, AXIS), Partial) for s in node.all_input_nodes]
        if packet(node) in (aten.add, aten.sub):
            return not all(partial) or any(not isinstance(a, fx.Node) for a in node.args[:2])
        return packet(node) in (aten.mul, aten.div) and sum(partial) > 1

    def _refusal(self, node: fx.Node, what: str, fix: str = _READS_ACROSS_FIX) -> PlanError:
        return PlanError(
            f"plan cp={self.cp}: {meta.describe(node)} {what}. Each cp rank holds a slice of the "
            f"sequence, so this would be silently wrong. Fix: {fix}",
            field="cp", value=self.cp)

    # -- rewrites ---------------------------------------------------------------------------

    def _attention(self, node: fx.Node) -> None:
        """SDPA on the rank's queries against the keys and values of every cp rank, with the
        mask's rows for the rank's queries (a causal flag made an explicit mask)."""
        q, k, v = node.args[:3]
        if _argument(node, 4, "dropout_p", 0.0):
            raise self._refusal(node, "drops attention weights at random (dropout_p > 0), which "
                                "context parallelism does not draw as one device does")
        for x in (q, k, v):
            if self.kinds[x] != TOKENS or meta.placement(x, AXIS) != Shard(x.meta["val"].dim() - 2):
                raise self._refusal(node, f"attends with {x.name}, which is not split along its "
                                    "sequence dim (dim -2) as the queries are")
        dim = q.meta["val"].dim() - 2
        keys, values = (self._insert(fxpar_op("gather_to_region"), (x, AXIS, self.cp, dim), R, before=node, like=x)
                        for x in (k, v))
        mask = _argument(node, 3, "attn_mask", None)
        if isinstance(mask, fx.Node):
            mask = self._mask_rows(mask, node)
        elif _argument(node, 5, "is_causal", False):
            mask = self._causal_rows(q, dim, before=node)
        kwargs = {k: w for k, w in node.kwargs.items() if k not in ("attn_mask", "is_causal", "dropout_p")}
        node.args, node.kwargs = (q, keys, values, mask), kwargs

    def _mask_rows(self, mask: fx.Node, node: fx.Node) -> fx.Node:
        """The rows of a whole mask for the rank's queries: its dim -2 split, its keys whole."""
        if self.kinds[mask] != WHOLE:
            raise self._refusal(node, f"takes a mask ({mask.name}) computed from the activations")
        rows = mask.meta["val"].dim() - 2
        if not is_symbolic(mask.meta["val"].shape[rows], self.seq):
            return mask  # one row for every query (a padding mask over the keys)
        return self._insert(fxpar_op("split_to_shard"), (mask, AXIS, self.cp, rows), Shard(rows), before=node,
                            like=mask)

    def _causal_rows(self, queries: fx.Node, dim: int, *, before: fx.Node) -> fx.Node:
        """mask[i, j] = position(query i) >= position(key j), for the rank's queries: the
        causal mask's rows, as positions counted on the queries' own device. (Read off the
        queries, not the gathered keys: a gather recomputed in backward must have no reader
        outside attention's region.)"""
        insert = partial(self._insert, before=before, like=None)
        piece = insert(aten.sym_size.int, (queries, dim), None)  # the slice's length, at run time
        length = insert(operator.mul, (piece, self.cp), None, val=queries.meta["val"].shape[dim])
        ones = insert(aten.new_ones.default, (queries, [length]), R, kwargs={"dtype": torch.int64})
        positions = insert(aten.cumsum.default, (ones, 0), R)
        mine = insert(fxpar_op("split_to_shard"), (positions, AXIS, self.cp, 0), Shard(0))
        rows = insert(aten.unsqueeze.default, (mine, 1), Shard(0))
        columns = insert(aten.unsqueeze.default, (positions, 0), R)
        return insert(aten.ge.Tensor, (rows, columns), Shard(0))

    def _slice(self, whole: fx.Node, consumer: fx.Node) -> fx.Node:
        """The rank's slice of `whole`: cut along its one dim sized by the sequence, or, where
        the sequence is flattened into another dim (`labels.view(-1)`, and what tensor
        parallelism's loss computes from it), the ops that made it replayed on the slices of
        their inputs (`_replayable`)."""
        # A step input's slice is taken where each consumer reads it: one shared slice would be
        # an op living from the first consumer to the last (the token ids and the labels, when
        # they are one tensor), which no pipeline cut between blocks could leave out.
        key = (whole, consumer) if whole.op == "placeholder" else whole
        if key in self.slices:
            return self.slices[key]
        dims = sequence_dims(whole, self.seq) if _tensor(whole) else ()
        if len(dims) == 1 and whole.meta["val"].shape[dims[0]].node.expr in self.seq:
            piece = self._insert(fxpar_op("split_to_shard"), (whole, AXIS, self.cp, dims[0]), Shard(dims[0]),
                                 before=consumer, like=whole)
        elif self._replayable(whole):
            piece = self._replay(whole, consumer)
        else:
            shape = tuple(whole.meta["val"].shape) if _tensor(whole) else "a tuple"
            raise self._refusal(consumer, f"reads {whole.name}, computed from the inputs with the "
                                f"sequence in dims {list(dims)} of shape {shape}, of which fxpar "
                                "can take a rank's slice only along one dim sized by the sequence")
        self.slices[key] = piece
        return piece

    def _replayable(self, node: fx.Node) -> bool:
        """An op of whole values that reads no position across (a view, a cast, a comparison,
        tensor parallelism's local indices): the rank's slice of its output is the op on the
        slices of its inputs."""
        return (node.op == "call_function" and dims_read_across(node) == ()
                and all(self.kinds[s] == WHOLE for s in node.all_input_nodes if _holds_tensors(s)))

    def _replay(self, node: fx.Node, consumer: fx.Node) -> fx.Node:
        """`node`'s op on the slices of its inputs that hold the sequence, sized for the slice."""
        def sliced(source: fx.Node):
            holds = _holds_tensors(source) and (not _tensor(source) or sequence_dims(source, self.seq))
            return self._slice(source, consumer) if holds else source

        args, kwargs = fx.node.map_arg((node.args, dict(node.kwargs)), sliced)
        dims = sequence_dims(node, self.seq) if _tensor(node) else ()
        piece = self._insert(node.target, args, Shard(dims[0]) if dims else None, before=consumer, like=node,
                             kwargs=kwargs, val=node.meta["val"])
        self.kinds[piece] = TOKENS
        self.sizes.use_local(piece, dims[0] if dims else None)
        return piece

    def _insert(self, target, args: tuple, placement, *, before: fx.Node, like: fx.Node | None,
                kwargs: dict | None = None, val=None) -> fx.Node:
        """`target(*args, **kwargs)` before `before`, its global value `val` (by default its
        inputs' values through `target`), at cp `placement`, in `before`'s module."""
        with self.graph.inserting_before(before):
            node = self.graph.call_function(target, args, kwargs or {})
        value = lambda n: n.meta["val"]  # noqa: E731
        if val is None and getattr(target, "namespace", None) == "fxpar":
            val = value(args[0])  # a distributed op moves the global value's pieces; it is the same value
        node.meta["val"] = val if val is not None else target(*fx.node.map_arg(args, value),
                                                               **fx.node.map_arg(kwargs or {}, value))
        node.meta[meta.MODULE_PATH] = meta.module_path(before)
        node.meta[meta.REQUIRES_GRAD] = meta.requires_grad(like) if like is not None else False
        # A slice is the rank's own, as tokens are; so is what tokens make.
        slices = target is fxpar_op("split_to_shard")
        self.kinds[node] = TOKENS if slices or (like is not None and self.kinds.get(like) == TOKENS) else WHOLE
        if like is not None and meta.PLACEMENT in like.meta:
            node.meta[meta.PLACEMENT] = meta.placements(like)  # the other axes' layout: the value's own
        if placement is not None:
            meta.set_placement(node, AXIS, placement)
        return node

    def _place(self, node: fx.Node, placement) -> None:
        if placement is not None and _tensor(node):
            meta.set_placement(node, AXIS, placement)


def fxpar_op(name: str):
    """fxpar's distributed op `name` (`fxpar.ops.distributed`), by its overload."""
    return getattr(torch.ops.fxpar, name).default


def _tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _holds_tensors(node: fx.Node) -> bool:
    """A tensor, or a tuple of them (a split, a layer norm's output and statistics)."""
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) or (
        isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value))


def _argument(node: fx.Node, index: int, name: str, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)

