"""DeepSpeed backend (ZeRO 0-3). Imported only when `backend: deepspeed` is chosen."""
