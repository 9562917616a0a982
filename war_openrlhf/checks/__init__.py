"""Checks a user runs on their own engines: does speculation preserve what the model samples."""
