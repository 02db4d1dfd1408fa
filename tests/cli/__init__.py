"""The `tidings` command as users run it."""
