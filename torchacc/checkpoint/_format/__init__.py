"""File formats written tensor by tensor: torch's zip container (``zip.py``, ``torch_writer.py``),
safetensors (``safetensors_writer.py``), byte ranges copied between files (``file_ranges.py``) and where
a loaded file's tensors lie in it (``storage_records.py``)."""
