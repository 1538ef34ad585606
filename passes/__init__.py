"""Graph passes: recognise structures, plan their forms, lower to a local SPMD program.

Each pass is a plain function `<name>_pass(gm, ctx) -> gm`; `passes.pipeline.PIPELINE` lists
them in order. Anything passes share lives in `ctx` (a `PassContext`) or in the `node.meta` keys
declared in `passes.meta`.
"""
