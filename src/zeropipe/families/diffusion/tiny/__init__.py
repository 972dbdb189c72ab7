"""The tiny presets' shared pieces, in one place beside the entries: tokenizers (``tokenizers.py``) and
components (``components.py``: text encoders, VAEs, denoisers), built from config without a download.

Tests and demos build a tiny pipeline of every entry from them; nothing here is used by a real model.
"""
