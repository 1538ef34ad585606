"""`heads+ring`: attention split by heads over a model axis and by ring attention over the sequence axis.

On a (t, p) pair of axes (`autopar.forms.two_axis`): q, k, v hold heads/t heads (KV heads/t, or the one
KV head a rank's query heads use when there are fewer KV heads than t) of s/p tokens in the zigzag
layout; K/V of those heads circulate over the sequence axis in p-1 steps (`ring`). Collectives per
layer: the heads block's all-reduce forward and backward on the model axis (`b·s/p·h` each), and the
ring's p-1 K/V steps forward, p-1 K/V + p-1 dK/dV steps backward on the sequence axis, each of
`2·b·(s/p)·h_kv/t` elements (`ring.layer_volume_bytes` with h_kv/t). Preconditions: those of `heads` on
the model axis, then those of `ring` on the sequence axis (SDPA, no mask other than causal, no dropout,
sequence % 2p == 0).
"""

from __future__ import annotations

from autopar.forms.base import register
from autopar.forms.ring import Ring, add_ring_comms, ring_precondition
from autopar.forms.two_axis import HeadsAndSequence


@register
class HeadsRing(HeadsAndSequence):
    name = "heads+ring"
    within = Ring()
    recomputed_whole = True  # ring attention on each rank's heads

    def within_precondition(self, site, t, p):
        return ring_precondition(site, p)

    def add_within_comms(self, comms, site, st, mc, axis, t):
        return add_ring_comms(comms, site, st, mc, axis, heads_split=t)
