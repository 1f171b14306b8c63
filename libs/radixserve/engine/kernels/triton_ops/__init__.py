"""Triton kernels behind kernels/norm.py, rotary.py and activation.py.

Importing these modules imports triton and defines the kernels (compiled, or
interpreted when TRITON_INTERPRET=1 is set before), so the public ops import them
only for CUDA tensors; the CPU tests import them under the interpreter.
"""
