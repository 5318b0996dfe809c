"""cuDNN and PyTorch-SDPA backends for attention (registered on import; packages loaded lazily)."""
