"""The pass author's tools: compare_mfu (tps / MFU / memory of two sides), loss_compare (losses
and final-state hashes, bit for bit), numerics_diff (the first op whose output differs), and
profiling / timeline (kernel time by category, a step's timeline; timeline needs no torch)."""
