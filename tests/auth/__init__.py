"""tidings.auth: keys, tokens, the verifier and the authorizers."""
