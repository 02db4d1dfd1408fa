"""Wire protocol: generated messages, Status, validation, labels and selectors."""
