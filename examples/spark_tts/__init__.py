"""Spark-TTS's inference in many worker processes, with one shared decoder: see README.md."""
