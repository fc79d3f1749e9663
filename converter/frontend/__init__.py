"""The converter's front ends: a source model (a GGUF file, or a Hugging Face folder of safetensors)
read lazily and checked before any tensor is read, and the architecture registry that maps its
tensors to roles."""
