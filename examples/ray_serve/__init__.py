"""Ray Serve in front of one shared decoder per node: see README.md here."""
