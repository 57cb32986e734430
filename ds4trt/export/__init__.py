"""Export: GGUF -> ONNX step graphs + external weights + manifest (an engine directory), and checks on them."""
