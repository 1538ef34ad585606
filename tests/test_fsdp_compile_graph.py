"""The FSDP runtime's gather copy-out and full views trace into one dynamo graph (no graph break).

A generator passed to `math.prod` inside `_full_shape` (the uneven-shard change) broke dynamo's graph at every
parameter and, inside `_finish`'s own generator, made dynamo skip the whole copy-out to eager: under
`torch.compile(pm)` an FSDP call recompiled 10 times instead of once (test_contract_compile's fsdp cell). Checked
here on the pure pieces (no process group: a plain tensor stands for the gathered buffer, which `wait_tensor`
passes through), even and uneven shards, in well under a second.
"""

from __future__ import annotations

import torch

from autopar.mesh import AxisRef
from autopar.runtime import fsdp


def _spec(pad: tuple) -> "fsdp._Spec":
    axis = AxisRef(mesh_id=0, index=0, name="dp", size=2)
    return fsdp._Spec((axis,), (0, 0), "g", False, None, None, False, pad)


def _explain(fn, *args):
    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(*args)


def test_finish_and_full_views_trace_without_graph_breaks():
    shards = (torch.randn(3, 4), torch.randn(2))
    for pad in ((), (None, (0, 3))):  # even shards; the second sharded unevenly (3 rows over 2 ranks, padded to 2)
        spec = _spec(pad)
        sent = fsdp._copy_in(shards, None, spec if pad else None)
        gathered = torch.cat([sent, sent + 1])  # (world x travelled) as the all-gather lays it out
        explained = _explain(fsdp._finish, (gathered, sent), shards, spec, False)
        assert explained.graph_break_count == 0, (pad, explained.break_reasons)
        buf = fsdp._finish((gathered, sent), shards, spec, False)
        assert explained.graph_count == 1 and buf.numel() == 3 * 4 * 2 + (3 if pad else 4), (pad, buf.shape)
        views = _explain(fsdp._full_views, buf, shards, spec)
        assert views.graph_break_count == 0, (pad, views.break_reasons)
