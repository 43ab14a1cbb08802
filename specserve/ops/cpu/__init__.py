"""Compiled CPU kernels of our own (C++ built on first use by torch.utils.cpp_extension)."""
