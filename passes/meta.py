"""The node.meta keys that passes share, declared once."""

KIND = "autopar_kind"  # recognised structure: "linear", "embedding", "attention", "loss"
PLACEMENTS = "autopar_placements"  # tuple of placements per mesh axis (list of tuples for multi-output ops)
COMM = "autopar_comm"  # on inserted collective nodes: CommInfo
ORIGIN = "autopar_origin"  # module path of the node a collective was inserted for
REPLICATED = "autopar_replicated"  # why an op was replicated (no rule / precondition)
UNFUSED = "autopar_unfused"  # on the 2nd matmul of an explicit attention left unfused: why (passes.fuse_attention)
# passes.batch_local:
ROWS = "autopar_rows"  # on nodes without a sharding rule: RowLocality, whether capture found them batch-local
GATHERED = "autopar_gathered"  # on nodes without a sharding rule: (op, mesh axes where lowering gathered split inputs)
WORK = "autopar_work"  # on a lowered GraphModule's meta: its Work, forward FLOPs on one device and per rank
