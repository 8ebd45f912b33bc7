"""Megatron-core backend (TP, PP, VPP, CP). Imported only when `backend: megatron` is chosen."""
