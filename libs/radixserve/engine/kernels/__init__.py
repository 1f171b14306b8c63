"""Fused elementwise ops of the decoder: RMSNorm (with the residual add), rotary, SiLU x mul.

Each public function runs a Triton kernel on CUDA tensors (where triton is installed)
and the torch reference, the ops Hugging Face runs, everywhere else: the CPU path is
that reference, op for op. The kernels round where the reference rounds, so 16-bit
results match it bit for bit (rotary), or in all but a few elements, which are within
2 ulps (RMSNorm's reduction order and SiLU's exp can move an intermediate by an ulp,
which the following product can make two); see each module.
"""
