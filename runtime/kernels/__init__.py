"""Native CPU kernels built on first use (``torch.utils.cpp_extension``), one module per kernel set."""
