# Sourced by the device-machine scripts (tools/gpu_*.sh), from the repository root: the
# environment every run there takes (NVLink multicast off, lazy module loading), the pack
# in .carry/gpu.tar.xz unpacked once, its libraries on the path, and BIN, its programs.
export NCCL_NVLS_ENABLE=0 CUDA_MODULE_LOADING=LAZY
[[ -d .carry/gpu/bin ]] || tar -C .carry -xJf .carry/gpu.tar.xz
export LD_LIBRARY_PATH="$PWD/.carry/gpu/lib:${LD_LIBRARY_PATH:-}"
BIN="$PWD/.carry/gpu/bin"
