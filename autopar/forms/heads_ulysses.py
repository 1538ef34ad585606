"""`heads+ulysses`: attention split by heads over a model axis and by Ulysses over the sequence axis.

On a (t, u) pair of axes (`autopar.forms.two_axis`): outside the attention everything holds s/u tokens;
around it, all-to-alls on the sequence axis swap the sequence shard for a shard of the heads/t heads a
rank of the model axis holds (`ulysses` on them): attention runs on the whole sequence for heads/(t·u)
heads. Collectives per layer: the heads block's all-reduce forward and backward on the model axis, and
Ulysses' all-to-alls of q, k, v, o forward and backward on the sequence axis, each of its local buffer
`b·(s/u)·h/t` (`ulysses.layer_volume_bytes` with h/t, h_kv/t). Preconditions: those of `heads` on the
model axis; those of `ulysses` for the heads of one rank of it (heads/t % u == 0, sequence % u == 0);
and the KV heads at the attention divide over t·u (K/V split on both axes: replicating KV heads over one
axis while splitting them over the other is not lowered).
"""

from __future__ import annotations

import dataclasses

from autopar.forms.base import register
from autopar.forms.two_axis import HeadsAndSequence
from autopar.forms.ulysses import Ulysses, add_ulysses_comms, ulysses_precondition


@register
class HeadsUlysses(HeadsAndSequence):
    name = "heads+ulysses"
    within = Ulysses()

    def within_precondition(self, site, t, u):
        local = dataclasses.replace(site, heads=site.heads // t, kv_heads=max(1, site.kv_heads // t))
        why = ulysses_precondition(local, u)
        if why:
            return f"for the {local.heads} heads of each rank of the heads axis: {why}"
        kv = site.node.args[1].meta["val"].shape[1]  # KV heads as the attention takes them (after any repeat)
        if kv % (t * u):
            return (f"the attention takes {kv} KV heads, which do not divide over the {t}x{u} ranks of its two axes "
                    "(KV heads replicated over one axis and split over the other are not supported). Fix: axes "
                    f"whose sizes multiply to a divisor of {kv}, 'heads' or 'ulysses' alone, or 'replicate'")
        return None

    def add_within_comms(self, comms, site, st, mc, axis, t):
        add_ulysses_comms(comms, site, st, mc, axis, heads_split=t)
        return 0.0
