"""The forms: one module per form, each registered in `autopar.forms.base.FORMS` when imported here.

| module            | kind        | form          | axes              |
|-------------------|-------------|---------------|-------------------|
| `replicate`       | every kind  | replicate     | -                 |
| `colwise`         | linear      | colwise       | model             |
| `rowwise`         | linear      | rowwise       | model             |
| `heads`           | attention   | heads         | model             |
| `ulysses`         | attention   | ulysses       | sequence          |
| `ring`            | attention   | ring          | sequence          |
| `heads_ring`      | attention   | heads+ring    | model, sequence   |
| `heads_ulysses`   | attention   | heads+ulysses | model, sequence   |
| `mlp_tp`          | mlp         | tp            | model             |
| `vocab_embedding` | embedding   | vocab         | model             |
| `vocab_loss`      | loss        | vocab         | model             |
| `sequence_norm`   | norm        | sequence      | model             |
| `expert`          | moe         | expert        | data or model     |
| `moe_tp`          | moe         | tp            | model             |

and the parameters' forms over the data axes: `dp` (gradient buckets), `fsdp` (sharded, gathered) and `zero`
(ZeRO-1 / ZeRO-2: the optimizer state, and gradients, sharded; the parameters whole for compute).
`checkpoint`: the activation checkpointing levels of a layer (none, selective, full), a registry of their own
(`checkpoint.LEVELS`: a layer is not a structure), taken per layer besides its structures' forms.
`two_axis` is the base the two-axis attention forms share (it registers nothing).
"""

from autopar.forms import replicate  # noqa: F401  (first: candidates list it first, ties break by order)
from autopar.forms import (colwise, expert, heads, heads_ring, heads_ulysses, mlp_tp, moe_tp, ring,  # noqa: F401
                           rowwise, sequence_norm, ulysses, vocab_embedding, vocab_loss)
from autopar.forms.base import FORMS, Candidate, Form, Role, form_names, form_of, forms_for

__all__ = ["FORMS", "Candidate", "Form", "Role", "form_names", "form_of", "forms_for"]
