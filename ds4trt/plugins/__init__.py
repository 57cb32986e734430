"""Custom ops the exported graphs use, one module per op: its written contract, a reference implementation,
the torch module that emits it at export, and thin backend registrations. Imports nothing else of ds4trt."""
