"""`ulysses`: DeepSpeed-Ulysses attention over the sequence axis.

Everything outside attention holds s/u tokens (the inputs are split on the sequence). Around the
attention, all-to-alls swap the sequence shard for a heads shard: q, k, v sequence -> heads
(`ATTENTION` directive, mode all-to-all), attention runs on the whole sequence for heads/u heads, and
the output goes back heads -> sequence (a `HINT` on the attention's output). K/V that `repeat_kv` expands
before the attention (Hugging Face GQA models), with KV heads that divide over the axis: the lowering sends the
KV heads, before the expansion, and each rank repeats its own (`passes.lower.kv_before_repeat_hints`), so K/V
cost h_kv, not h, per token, as the volume below counts. Fewer KV heads than ranks: K/V are gathered and each
rank picks the KV heads its query heads use. Volume per layer,
forward: `(u-1)/u² · b·s·(2h + 2h_kv)` (q, k, v, o), twice that forward + backward
(`layer_volume_bytes`). Preconditions: SDPA (or explicit attention fused to it); heads % u == 0;
KV heads % u == 0 or u % KV heads == 0; sequence % u == 0.
"""

from __future__ import annotations

from autopar.estimate import compute_s
from autopar.forms import blocks
from autopar.forms.base import Form, Role, register
from autopar.plan import AttentionMode, Directive, DirectiveKind
from autopar.sites import AttentionSite, Kind
from autopar.spec import Shard, fmt
from cost_model.analytical import send_bytes


def ulysses_precondition(site: AttentionSite, u: int) -> str | None:
    if site.spelling != "sdpa":
        return (f"it is explicit matmul-softmax-matmul attention, not fused into SDPA: {site.unfused_why}. "
                "Fix: 'heads' or 'replicate'")
    if site.heads % u:
        return f"{site.heads} heads do not divide over {u} ranks. Fix: an axis whose size divides the heads"
    if site.kv_heads % u and u % site.kv_heads:
        return f"{site.kv_heads} KV heads neither divide over nor into {u} ranks. Fix: another axis size"
    if site.seq_len % u:
        return f"sequence {site.seq_len} does not divide over {u} ranks. Fix: pad the sequence"
    return None


def layer_volume_bytes(b: int, s: int, h: int, h_kv: int, u: int, itemsize: int, *, backward: bool = True) -> float:
    """Bytes each rank sends per layer: all-to-alls of q, k, v (seq -> heads) and o (heads -> seq)."""
    local = b * s / u  # tokens on one rank
    fwd = sum(send_bytes("all_to_all", local * w, u) for w in (h, h_kv, h_kv, h)) * itemsize
    return 2 * fwd if backward else fwd


@register
class Ulysses(Form):
    name = "ulysses"
    kinds = (Kind.ATTENTION,)
    roles = (frozenset({Role.SEQUENCE}),)
    sequence = True

    def precondition(self, site: AttentionSite, sizes):
        return ulysses_precondition(site, sizes[0])

    def directives(self, site: AttentionSite, axes):
        (axis,) = axes
        return [Directive(kind=DirectiveKind.ATTENTION, node=site.node.name, axis=axis, value=AttentionMode.ALL_TO_ALL),
                # (b, heads, s, d) back to the sequence shard after the attention
                Directive(kind=DirectiveKind.HINT, node=site.node.name, axis=axis, value=fmt(Shard(2)))]

    def cost(self, site: AttentionSite, st, cand, mc):
        comms = blocks.Comms(mc, cand.axis)
        add_ulysses_comms(comms, site, st, mc, cand.axis)
        return blocks.finish(st, cand, mc, compute=compute_s(st, mc.dp, mc.cluster), comms=comms,
                             act=(st.saved_bytes + st.attn_out_bytes) / mc.dp)


# Saved beyond what the graph says (`attribute_saved`): the output projection's input is the heads -> sequence
# all-to-all's result, a new tensor the size of the attention's output, which the attention also keeps (its own
# saved output): `st.attn_out_bytes` once more.


def add_ulysses_comms(comms: blocks.Comms, site: AttentionSite, st, mc, axis: str, heads_split: int = 1) -> None:
    """Add the all-to-alls of q, k, v (sequence -> heads) and o (heads -> sequence), forward and backward, on
    `axis` to `comms` (this rank's tokens, their heads split `heads_split` ways by a heads axis)."""
    kv = site.kv_heads / site.heads
    m = st.io_bytes / mc.dp / heads_split  # one (b, s/u, h/t) buffer on this rank
    for nbytes in (m, m * kv, m * kv, m) * 2:  # q, k, v seq->heads and o heads->seq, forward and backward
        comms.add("all_to_all", nbytes, axis=axis)
