"""Orpheus TTS's serving loop in many worker processes, with one shared decoder: see README.md."""
