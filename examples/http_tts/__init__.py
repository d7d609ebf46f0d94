"""A multi-worker HTTP TTS service in front of one shared decoder: see README.md here."""
