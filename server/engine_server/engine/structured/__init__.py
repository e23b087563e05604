"""Constrained decoding (structured output) with llguidance: grammars compiled off the step loop, one matcher
per completion, token masks filled beside the forward pass and applied before sampling."""
