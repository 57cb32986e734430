"""Backends: callables with the Transformer.forward / MTPHead.forward signatures, run from an engine directory."""
