"""Fused elementwise ops of the decoder: RMSNorm (with the residual add), rotary, SiLU x mul.

Each public function runs a Triton kernel on CUDA tensors (where triton is installed)
and the torch reference, the ops Hugging Face runs, everywhere else: the CPU path is
that reference, op for op. The kernels round where the reference rounds, so 16-bit
results match it bit for bit (rotary) or within one unit in the last place (RMSNorm's
reduction order, SiLU's exp); see each module.
"""
