"""Fast attention kernels. Kernels know nothing about the public API: they take tensors, strides and
flags that flashtile.interface has already validated."""
