"""The graph passes, one per module, each ``(gm, example_inputs, **kwargs) -> gm`` with its declaration ``PASS``
(:class:`graph_trainer.compiler.registry.GraphPass`); :data:`ORDER` is the default order (``docs/passes.md``)."""

ORDER = [
    "remove_dead_code",
    "remove_noop_views",
    "sac_recompute",            # op-level SAC: what the backward recomputes   [compile.sac]
    "reshard_after_forward",    # FSDP: re-gather in the backward               [compile.fsdp]
    "async_tp",                 # TP: all-gather/reduce-scatter + matmul fused   (CUDA; else opt-in)
    "overlap_collectives",
    "bucket_collectives",       # FSDP: collectives of N blocks as one          [compile.fsdp]
    "annotate_flex_attention",
    "annotate_rmsnorm",         # --compile.numerics_changing_optim (regional)
    "annotate_residual_rmsnorm",  # opt-in, numerics-changing: the residual add joins each norm region
    "annotate_pointwise",       # opt-in, numerics-changing
    "annotate_exact_pointwise",  # CUDA, regional: fused with eager's rounding, numerics unchanged
    "regional_inductor",        # --compile.inductor_compilation regional
    "isolate_rmsnorm",          # opt-in, numerics-changing, full only: each norm in kernels of its own
    "full_inductor",            # --compile.inductor_compilation full
    "cudagraph",                # CUDA, one process: the memory policy's choice        (compiler/memory_policy.py)
]
