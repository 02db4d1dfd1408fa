"""The wire protocol: generated code, statuses, validators."""
