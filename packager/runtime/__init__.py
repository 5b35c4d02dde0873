"""Runtime pieces a bundle carries to the device: TVM runtime libraries from wheels, and the CUDA 12 bridge."""
