"""The compiled CPU kernels: setup.py builds them here at install, one module per kernel and
instruction set (linear_avx512, linear_avx2, ...), and kvfence.model.kernels loads them."""
