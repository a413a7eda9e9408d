"""Structured outputs (layer 2): grammars compiled from a request's constraint, one matcher
per request, and the token bitmask applied to its logits before sampling.

The grammar engine is llguidance (docs/design-notes.md says why); nothing here parses JSON
or regexes itself.
"""
