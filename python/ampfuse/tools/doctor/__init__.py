"""`python -m ampfuse doctor`: versions, kernels, the GPU and a smoke test of every op."""
