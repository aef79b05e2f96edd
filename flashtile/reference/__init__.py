"""The papers' algorithms, written to be read beside the seeds. Pure PyTorch, any dtype (float64 for ground
truth), CPU or GPU. Slow on purpose; never in a hot path."""
