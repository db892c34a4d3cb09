"""kernels: the ground floor's compute. The C++ MLX extension (paged decode attention, causal softmax,
gated activations), its build, and the one place that decides which backend runs.

    runtime.py      the one place mlx is first imported, right after the OpenBLAS preload (blas.py)
    backend.py      which implementation runs (C++ kernel or plain-MLX reference), read once
    ext.py          loads the compiled extension (kernels/_kernels*.so) and wraps its functions
    activations.py  gated MLP activations (SwiGLU, GeGLU) over the extension or plain MLX
    build.py        `python -m kernels.build`: CMake + nanobind over kernels/csrc/

Importing this package loads nothing; import what you use.
"""
