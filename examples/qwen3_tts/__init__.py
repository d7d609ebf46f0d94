"""Qwen3-TTS's streaming loop in many worker processes, with one shared decoder: see README.md."""
