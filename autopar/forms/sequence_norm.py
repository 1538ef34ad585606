"""`sequence` of a norm: Megatron sequence parallelism (Korthikanti et al. 2205.05198).

On the axis of the tensor-parallel blocks: the norm's input — the residual stream — is sharded on
the sequence (`S(seq_dim)`, a `HINT` directive), so norms, residual adds and dropout run on s/t
tokens. The lowering then needs no special case: a column-parallel linear consuming the
sequence-sharded stream all-gathers it (forward) and reduce-scatters its input gradient (backward);
the row-parallel outputs of the tensor-parallel blocks on that axis are reduce-scattered onto the
sequence (forward, before their bias; all-gather backward: `ROW_OUTPUT` directives); norm weights
see partial gradients, summed over the axis by `grad_all_reduce`, and so do the row-parallel biases
(added after the reduce-scatter); all of them in one bucket per axis (`bucket_gradients_pass`). The
column-parallel linears keep their gathered input's shard for backward, not the gathered copy, and
all-gather it again there for their weight gradients (`regather_linear_inputs_pass`), as Megatron
does: every activation saved in the layer is then 1/t (Korthikanti's 34sbh/t). Volume per layer: 6
all-gathers (2 of them the backward re-gathers) + 4 reduce-scatters of b·s·h, `10(t-1)/t · bsh`
(`layer_volume_bytes`): tensor parallelism's volume and one all-gather per norm more.
Preconditions: sequence % t == 0; every attention and MLP tensor parallel on the axis (an ILP
constraint; a hand plan whose blocks are not keeps them replicated around sequence-sharded norms).
"""

from __future__ import annotations

from autopar.estimate import compute_s
from autopar.forms import blocks, dp
from autopar.forms.base import Form, Role, register
from autopar.plan import Directive, DirectiveKind
from autopar.sites import Kind, NormSite
from autopar.spec import Shard, fmt
from cost_model.analytical import send_bytes


def layer_volume_bytes(b: int, s: int, h: int, t: int, itemsize: int) -> float:
    """Bytes each rank sends per transformer layer, forward + backward: 4 all-gathers + 4 reduce-scatters, and the
    2 backward re-gathers of the column-parallel inputs."""
    return (6 * send_bytes("all_gather", b * s * h, t) + 4 * send_bytes("reduce_scatter", b * s * h, t)) * itemsize


@register
class SequenceNorm(Form):
    name = "sequence"
    kinds = (Kind.NORM,)
    roles = (frozenset({Role.MODEL}),)

    def precondition(self, site: NormSite, sizes):
        (t,) = sizes
        if site.seq_len % t:
            return (f"it needs the sequence ({site.seq_len}) to divide over {t} ranks. Fix: pad the sequence or "
                    "'replicate'")
        return None

    def directives(self, site: NormSite, axes):
        (axis,) = axes
        return [Directive(kind=DirectiveKind.HINT, node=site.input.name, axis=axis, value=fmt(Shard(site.seq_dim)))]

    def plan_directives(self, site, axes, chosen):
        (axis,) = axes
        out = []
        for other, form, cand in chosen:
            if form.tensor_parallel and cand.axis == axis:
                for lin in form.row_linears(other):
                    if len(lin.node.meta["val"].shape) >= 3:  # (b, s, h): the sequence is dim 1
                        out.append(Directive(kind=DirectiveKind.ROW_OUTPUT, node=lin.node.name, axis=axis,
                                             value=fmt(Shard(1))))
        return out

    def add_constraints(self, view, site, cand, var):
        view.require_every(var, (Kind.ATTENTION, Kind.MLP),
                           lambda c, form: form.tensor_parallel and c.axis == cand.axis,
                           why="a sequence-parallel norm needs every attention and MLP tensor parallel on its axis")

    def cost(self, site, st, cand, mc):
        t = mc.size(cand.axis)
        comms = blocks.Comms(mc, cand.axis)
        # Norm weights stay replicated and see partial gradients; so do the row-parallel biases. All are summed in
        # one bucket on the axis: each norm pays its bytes and its share of the biases at the bucket's per-byte
        # rate, and its share of the bucket's fixed cost (exact when every norm is sequence parallel).
        sync_s, sync_bytes = dp.grad_sync(mc, st.param_bytes + st.sequence_bias_bytes, axes=(cand.axis,))
        comms.time_s += sync_s + st.sequence_bucket_share * mc.bucket_rate(cand.axis)[0]
        comms.bytes += sync_bytes
        # The norm's output (the size of the stream it normalises) feeds column-parallel linears, which save its
        # shard and all-gather it again backward (`regather_linears`).
        stream = site.input.meta["val"]
        out_bytes = stream.numel() * stream.element_size() / mc.dp
        comms.add("all_gather", out_bytes)
        # what it saves (its share of the residual stream, its output, its statistics: `attribute_saved`) is split
        # on the sequence
        return blocks.finish(st, cand, mc, compute=compute_s(st, mc.dp * t, mc.cluster), comms=comms,
                             act=st.saved_bytes / mc.dp / t)
