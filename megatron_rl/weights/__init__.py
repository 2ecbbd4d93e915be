"""HF <-> Megatron weight layouts (tables.py) and HF safetensors I/O (hf_io.py)."""
