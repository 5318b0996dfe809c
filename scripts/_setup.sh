# The set-up shared by scripts/test.sh and scripts/main.sh (sourced, not run): `setup EXTRA` installs torch
# when none imports, then delta-attn from this checkout (editable) with the extra EXTRA.
#
# torch: a torch that already imports is kept (a CUDA build on a GPU machine, or one installed by hand).
# Otherwise, on a machine without an NVIDIA GPU (no `nvidia-smi` on PATH and no /dev/nvidia0) the CPU build
# comes from PyTorch's CPU index, so that pip never pulls the CUDA libraries; with an NVIDIA GPU the default
# build comes from PyPI (CUDA included).

TORCH_VERSION=2.13.0
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

has_nvidia_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 || [ -e /dev/nvidia0 ]
}

install_torch() {
  if python -c "import torch" 2>/dev/null; then
    return 0
  fi
  if has_nvidia_gpu; then
    echo "set-up: installing torch $TORCH_VERSION (CUDA build: an NVIDIA GPU is present)" >&2
    python -m pip install -q "torch==$TORCH_VERSION"
  else
    echo "set-up: installing torch $TORCH_VERSION (CPU build: no NVIDIA GPU here)" >&2
    python -m pip install -q "torch==$TORCH_VERSION" --index-url "$TORCH_CPU_INDEX"
  fi
}

setup() {
  install_torch
  python -m pip install -q -e ".[$1]"
}
