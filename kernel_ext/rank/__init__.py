"""Code that runs on the ranks. Imports nothing from the notebook side."""
