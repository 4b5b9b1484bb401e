"""Operations installed into a Hugging Face model: attention, fused kernels (C++ in csrc/), norm, rotary,
loss, MLP and the weight-gradient linear."""
