"""The converter's back end: the ONNX graphs of the file, the verification of the written file
through the runtime, and the report."""
